"""`hf-scale plan` and `hf-scale generate --strategy auto` through the real CLI: table, JSON, PNG, the written
config, and one-line errors with exit code 2 for bad input (nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_scale.cli import main
from hf_scale.config import load_config

TINY = str(Path(__file__).resolve().parents[1] / "hf_scale" / "assets" / "tiny-llama")
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
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
    assert "recommended: ZeRO-2" in out and "DDP: needs 192.0 GiB per GPU" in out


def test_plan_json_has_byte_breakdowns_that_add_up(llama8b, capsys):
    main(["plan", llama8b, "--json", "--activation-checkpointing", "off"])
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["parameters"] == 8_030_261_248
    assert all(not c["activation_checkpointing"] for c in data["candidates"])
    for c in data["candidates"]:
        parts = {k: v for k, v in c["bytes_per_gpu"].items() if k != "total"}
        assert sum(parts.values()) == c["bytes_per_gpu"]["total"]
    assert data["recommended"] == "zero2"


def test_write_config_and_plot_write_a_loadable_config_and_a_png(llama8b, tmp_path, capsys):
    config, png = tmp_path / "out" / "plan.yaml", tmp_path / "plan.png"
    main(["plan", llama8b, "--machines", "2", "--write-config", str(config), "--plot", str(png)])
    cfg = load_config(config)
    assert cfg.world_size == 16 and cfg.topology.num_machines == 2
    # 16 GPUs shard the optimizer states thinly enough for ZeRO-1 (ZeRO-2 on one machine, see above).
    assert cfg.strategy == "deepspeed" and cfg.deepspeed.zero_stage == 1
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
    argv = ["generate", "--strategy", "auto", "--model", llama8b, "--deepspeed-mode", "resolved"]
    main([*argv, "--set", "deepspeed.torch_adam=true", "--output-dir", str(tmp_path)])
    ds = json.loads((tmp_path / "ds_configs" / "zero2.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["optimizer"]["params"]["torch_adam"]
    assert ds["train_batch_size"] == 8


BAD = [
    (["plan", TINY, "--gpus-per-machine", "0"], "--gpus-per-machine 0 is invalid: allowed an integer from 1 to 1024"),
    (["plan", TINY, "--machines", "-1"], "--machines -1 is invalid"),
    (["plan", TINY, "--gpu-memory", "80XB"], "--gpu-memory '80XB' is invalid: expected a positive number"),
    (["plan", TINY, "--cpu-memory", "lots"], "--cpu-memory 'lots' is invalid"),
    (["plan", TINY, "--seq-len", "0"], "--seq-len 0 is invalid"),
    (["plan", TINY, "--seq-len", "-5"], "--seq-len -5 is invalid"),
    (["plan", TINY, "--lora-r", "0"], "--lora-r 0 is invalid"),
    (["plan", "./no/such/model"], "MODEL './no/such/model': no such file or directory"),
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


def test_unreachable_hub_model_tells_how_to_pass_a_local_config(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no network here: fail at once instead of retrying
    done = subprocess.run(
        [sys.executable, "-m", "hf_scale.cli", "plan", "no-such-org/no-such-model"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert line.startswith("hf-scale: error: MODEL 'no-such-org/no-such-model': cannot get its config.json")
    assert "pass its path (hf-scale plan ./config.json) or a local model directory" in line


def test_no_candidate_fits_gives_a_refusal_and_no_config(tmp_path, llama8b, capsys):
    config = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", llama8b, "--gpus-per-machine", "1", "--gpu-memory", "8GiB", "--write-config", str(config)])
    assert exit_info.value.code == 2
    assert "no candidate fits" in capsys.readouterr().err
    assert not config.exists()
