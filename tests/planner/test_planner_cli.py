"""`hf-scale plan` and `hf-scale generate --strategy auto` through the real CLI: table, JSON, PNG, the written
config, and one-line errors with exit code 2 for bad input (nothing written)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn
from paths import TINY_LLAMA

from hf_scale.commands.cli import main
from hf_scale.config.distributed_config import load_config
from hf_scale.config.presets import get_preset
from hf_scale.planner.report import clipped_bars, plan_figure

TINY = str(TINY_LLAMA)
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


@pytest.fixture
def llama8b(tmp_path):
    path = tmp_path / "llama8b.json"
    path.write_text(json.dumps(LLAMA_8B))
    return str(path)


def test_plan_prints_a_table_with_every_candidate_and_the_verdict(llama8b, capsys):
    assert main(["plan", llama8b, "--gpus-per-machine", "8", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out
    for label in ("DDP", "ZeRO-1", "ZeRO-2 + opt offload", "ZeRO-3 + opt+param offload", "FSDP2 full shard"):
        assert label in out
    # The time model ranks FSDP2 first here (nothing faster to reject); DDP still says why it does not fit.
    assert "recommended: FSDP2 full shard" in out and "predicted: " in out and "tokens/s per GPU, MFU" in out
    assert "slower candidates that fit" in out and "needs 192.0 GiB per GPU" not in out


def test_a_mixture_of_experts_model_is_planned_with_expert_parallelism_and_lora_says_why_not(tmp_path, capsys):
    """Issue 35: an MoE config plans FSDP2 x EP candidates (their ep in --json), silently; with LoRA, where train.py
    refuses ep > 1, it plans no EP and says so in one line."""
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
                                "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
                                "num_experts_per_tok": 2, "vocab_size": 1024, "max_position_embeddings": 4096}))
    assert main(["plan", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    data = json.loads(captured.out)
    assert data["recommended"]
    assert {c["parallelism"].get("ep", 1) for c in data["candidates"]} == {1, 2, 4, 8}
    assert main(["plan", str(path), "--json", "--lora-r", "8"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line == ("hf-scale: warning: a mixture-of-experts model (8 experts per layer) with LoRA: expert parallelism "
                    "is not planned (train.py refuses --lora_r with parallelism.ep > 1: peft's adapters on "
                    "expert-parallel weights are not proven); the experts are sharded like the rest")
    assert {c["parallelism"].get("ep", 1) for c in json.loads(captured.out)["candidates"]} == {1}


def test_plan_json_has_byte_breakdowns_that_add_up(llama8b, capsys):
    main(["plan", llama8b, "--json", "--activation-checkpointing", "off"])
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["parameters"] == 8_030_261_248
    assert all(not c["activation_checkpointing"] for c in data["candidates"])
    for c in data["candidates"]:
        parts = {k: v for k, v in c["bytes_per_gpu"].items() if k != "total"}
        assert sum(parts.values()) == c["bytes_per_gpu"]["total"]
    assert data["recommended"] == "fsdp2_full_shard"
    ddp = next(c for c in data["candidates"] if c["key"] == "ddp")
    assert ddp["rejected_because"].startswith("needs 192.0 GiB per GPU")
    # The workload's keys are the config's field names, with the same values in the recommended config.
    workload, config = data["workload"], data["recommended_config"]
    assert workload["num_machines"] == config["topology"]["num_machines"] == 1
    assert workload["micro_batch_size"] == config["batch"]["micro_batch_size"] == 1
    assert workload["gpus_per_machine"] == config["topology"]["processes_per_machine"] == 8


def test_older_flag_spellings_and_torch_dtype_names_plan_the_same(llama8b, capsys):
    """--machines is an alias of --num-machines, --micro-batch of --micro-batch-size, and --precision takes a
    dtype in either spelling (hf_scale.knowledge.rules): each pair gives the same JSON."""
    def plan_json(*flags):
        assert main(["plan", llama8b, "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    new = plan_json("--num-machines", "2", "--micro-batch-size", "2", "--precision", "bf16")
    assert new == plan_json("--machines", "2", "--micro-batch", "2", "--precision", "bfloat16")
    assert new["workload"]["num_machines"] == 2 and new["workload"]["micro_batch_size"] == 2
    assert plan_json("--precision", "float32") == plan_json("--precision", "no")


def test_write_config_and_plot_write_a_loadable_config_and_a_png(llama8b, tmp_path, capsys):
    config, png = tmp_path / "out" / "plan.yaml", tmp_path / "plan.png"
    main(["plan", llama8b, "--num-machines", "2", "--write-config", str(config), "--plot", str(png)])
    cfg = load_config(config)
    assert cfg.world_size == 16 and cfg.topology.num_machines == 2
    assert cfg.strategy == "fsdp" and cfg.fsdp.sharding == "full_shard"  # the fastest predicted on 2 x 8 H100
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {config}" in capsys.readouterr().out


def test_generate_strategy_auto_plans_and_writes_the_files(tmp_path, capsys):
    assert main(["generate", "--strategy", "auto", "--model", TINY, "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "recommended: DDP" in out
    accelerate_yaml = tmp_path / "accelerate_configs" / "ddp.yaml"
    assert "hf-scale generate --strategy auto --model" in accelerate_yaml.read_text()
    assert (tmp_path / "launch" / "ddp.torchrun.sh").exists()


def test_generate_strategy_auto_writes_a_deepspeed_config_when_sharding_is_needed(llama8b, tmp_path, capsys):
    """One 80 GiB GPU: the 8B full fine-tune fits only with the optimizer in CPU RAM; ZeRO-2's offload is the fastest
    of those (its weights stay on the GPU)."""
    argv = ["generate", "--strategy", "auto", "--model", llama8b, "--deepspeed-mode", "resolved",
            "--gpus-per-machine", "1", "--cpu-memory", "512GiB"]
    main([*argv, "--output-dir", str(tmp_path)])
    ds = json.loads((tmp_path / "ds_configs" / "zero2_offload.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # named after the strategy catalogue's entry, which is the same setup: the preset zero2_offload
    planned = load_config(str(tmp_path / "hf_scale_configs" / "zero2_offload.yaml"))
    assert planned.deepspeed == get_preset("zero2_offload").deepspeed
    assert ds["train_batch_size"] == 1


BAD = [
    (["plan", TINY, "--gpus-per-machine", "0"], "--gpus-per-machine 0 is invalid: allowed an integer from 1 to 1024"),
    (["plan", TINY, "--num-machines", "-1"], "--num-machines -1 is invalid"),
    (["plan", TINY, "--machines", "-1"], "--num-machines -1 is invalid"),  # the older spelling, an alias
    (["plan", TINY, "--gpu-memory", "80XB"], "--gpu-memory '80XB' is invalid: expected a positive number"),
    (["plan", TINY, "--cpu-memory", "lots"], "--cpu-memory 'lots' is invalid"),
    (["plan", TINY, "--seq-len", "0"], "--seq-len 0 is invalid"),
    (["plan", TINY, "--seq-len", "-5"], "--seq-len -5 is invalid"),
    (["plan", TINY, "--lora-r", "0"], "--lora-r 0 is invalid"),
    (["plan", "./no/such/model"], "MODEL './no/such/model': no such file or directory"),
    (["plan", "no/such/model"], "no such file or directory (a Hub id is NAME or ORG/NAME;"),
    (["plan", "my model"], "no such file or directory (nor a valid Hub id;"),
    (["plan", TINY, "--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["generate", "--strategy", "auto"], "--strategy auto needs --model MODEL"),
    (["generate", "--preset", "zero2", "--strategy", "auto", "--model", TINY], "drop CONFIG.yaml/--preset"),
    (["generate", "--model", TINY], "--model is only used with --strategy auto"),
]


@pytest.mark.parametrize(("argv", "fragment"), BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, fragment, tmp_path, capsys):
    config = tmp_path / "plan.yaml"
    extra = ["--write-config", str(config)] if argv[0] == "plan" else ["--output-dir", str(tmp_path / "gen")]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *extra])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment in lines[0]
    assert not config.exists() and not (tmp_path / "gen").exists()


def _plan(*args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_scale", "plan", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=180)


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    return line


def test_unreachable_hub_model_tells_how_to_pass_a_local_config(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    line = _one_error_line(_plan("no-such-org/no-such-model", env=env))
    assert line.startswith("hf-scale: error: MODEL 'no-such-org/no-such-model': cannot get its config.json: not in "
                           "the local cache, and HF_HUB_OFFLINE is set")
    assert "pass its path (hf-scale plan ./config.json) or a local model directory" in line


def test_a_hub_id_is_fetched_once_then_read_from_the_cache_and_a_mistyped_path_never_asks(tmp_path):
    """The Hub (a local stand-in, huggingface_hub's real client) serves one config.json; the second plan reads the
    cache offline. `models/llama3_8b` where `models/` is a folder is a missing path: the Hub is never asked."""
    (tmp_path / "models" / "llama3-8b").mkdir(parents=True)
    with HubStandIn() as hub:
        hub.repos["meta-x/Llama-8B"] = {"config.json": json.dumps(LLAMA_8B).encode()}
        env = hub.env({**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache")})
        done = _plan("meta-x/Llama-8B", "--json", env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["model"]["parameters"] == 8_030_261_248
        assert [r for r in hub.requests if r.startswith("GET")] == ["GET /meta-x/Llama-8B/resolve/main/config.json"]
        again = _plan("meta-x/Llama-8B", "--json", env={**env, "HF_HUB_OFFLINE": "1"})
        assert again.returncode == 0 and json.loads(again.stdout) == json.loads(done.stdout)

        asked = list(hub.requests)
        line = _one_error_line(_plan("models/llama3_8b", env=env, cwd=tmp_path))
        assert line == ("hf-scale: error: MODEL 'models/llama3_8b': no such file or directory (models/ is a folder "
                        "here, so this is a local path (did you mean models/llama3-8b?), not a Hub id; expected a Hub "
                        "id, a model directory or a config.json)")
        missing = _one_error_line(_plan("meta-x/No-Such-Model", env=env))
        assert "no such repository on the Hub" in missing
        assert hub.requests[len(asked):] == ["HEAD /meta-x/No-Such-Model/resolve/main/config.json"]
        assert not hub.unexpected


def test_an_unreachable_hub_is_one_attempt_and_one_line(tmp_path):
    """No retries (huggingface_hub's backoff takes half a minute): a closed port answers at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    env = {**os.environ, "HF_ENDPOINT": closed, "HF_HUB_CACHE": str(tmp_path / "cache"), "NO_PROXY": "127.0.0.1"}
    for switch in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # huggingface_hub reads either one
        env.pop(switch, None)
    line = _one_error_line(_plan("meta-x/Llama-8B", env=env))
    assert "cannot reach the Hugging Face Hub" in line and "pass its path (hf-scale plan ./config.json)" in line


def test_no_candidate_fits_exits_1_with_the_reasons_and_writes_no_config(tmp_path, llama8b, capsys):
    config = tmp_path / "plan.yaml"
    argv = ["plan", llama8b, "--gpus-per-machine", "1", "--gpu-memory", "8GiB", "--write-config", str(config)]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "no candidate fits; every one was rejected:" in captured.out
    assert captured.err.splitlines() == [f"hf-scale plan: no candidate fits, so {config} was not written"]
    assert not config.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--strategy", "auto", "--model", llama8b, "--gpus-per-machine", "1", "--gpu-memory", "8GiB",
              "--output-dir", str(tmp_path / "gen")])
    assert exit_info.value.code == 1 and not (tmp_path / "gen").exists()
    assert "no strategy fits" in capsys.readouterr().err


def test_plan_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "exit codes: 0 a candidate fits (the recommendation), 1 no candidate fits" in capsys.readouterr().out


def test_the_plot_labels_every_clipped_bar_with_its_total(llama8b, tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", llama8b, "--gpus-per-machine", "2", "--gpu-memory", "40GiB", "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    from hf_scale.commands.plan import plan_from_args

    args = _planned_args(llama8b, "--gpus-per-machine", "2", "--gpu-memory", "40GiB")
    plan = plan_from_args(args, llama8b)
    clipped = clipped_bars(plan)
    top = 40 * 1.6
    assert [i for i, _ in clipped] == [i for i, a in enumerate(plan.assessments) if a.estimate.gpu_total / 2**30 > top]
    assert "192.0 GiB \u2191" in dict(clipped).values()  # DDP: 8B params x (2 + 2 + 12) bytes + activations
    import matplotlib.pyplot as plt

    figure = plan_figure(plan)
    try:
        texts = [t.get_text() for t in figure.axes[0].texts]
    finally:
        plt.close(figure)
    assert all(text in texts for _, text in clipped) and "recommended" in texts


def _planned_args(*argv: str):
    from hf_scale.commands.cli import build_parser

    return build_parser(["plan"]).parse_args(["plan", *argv])
