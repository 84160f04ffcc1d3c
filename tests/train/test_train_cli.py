"""train.py's interface: --hf_scale_config, LoRA, packing, trackers, torch.compile, the DeepSpeed op pre-check.

(Bad input: tests/train/test_train_bad_input.py.)"""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from train_helpers import (
    REPO,
    TRAIN_PY,
    assert_saved_model_verified,
    child_env,
    generate_config,
    launcher_command,
    logits,
    no_compiler_env,
    path_without_compilers,
    run,
    run_ok,
    stale_lock,
)


def test_optimizer_offload_without_a_compiler_stops_before_the_model_loads(tmp_path):
    """DeepSpeedCPUAdam (optimizer offload) is a C++ op: with no compiler it cannot be built; one line says so
    (and what else is missing) before anything is set up. train.py runs from its own directory's presets."""
    env = no_compiler_env(path_without_compilers(tmp_path / "bin"), tmp_path / "empty_jit_cache")
    out = tmp_path / "out"
    result = run([sys.executable, TRAIN_PY, "--deepspeed", "ds_configs/zero2_offload.json", "--max_steps", "1",
                  "--output_dir", str(out)], env=env, timeout=180)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert ("ds_configs/zero2_offload.json: optimizer.type=AdamW with zero_optimization.offload_optimizer.device=cpu "
            "needs DeepSpeed's cpu_adam op, which is not prebuilt and cannot be JIT-built here (missing: a C++ "
            "compiler (c++ is not on PATH)); fix: install a C++ compiler") in line
    assert "deepspeed.torch_adam=true" in line
    assert not out.exists()


def test_a_stale_deepspeed_build_lock_is_said_at_start_not_waited_on_forever(tmp_path):
    """A run killed while JIT-building cpu_adam left TORCH_EXTENSIONS_DIR/cpu_adam/lock: every later CPU-Adam run
    waited on it with no output, forever (the timeout stands for that). train.py names it before anything is set up."""
    lock = stale_lock(tmp_path / "jit")
    out = tmp_path / "out"
    result = run([sys.executable, TRAIN_PY, "--deepspeed", "ds_configs/zero2_offload.json", "--max_steps", "1",
                  "--output_dir", str(out)], env={**child_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit")},
                 timeout=180)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert (f"needs DeepSpeed's cpu_adam op, but torch's JIT-build lock {lock} exists since" in line
            and "no process on this machine holds it (a run killed while building cpu_adam left it)" in line
            and f"remove it (rm {lock})" in line), line
    assert lock.exists() and not out.exists()  # said, not removed: another machine may share the folder


def test_max_seq_length_defaults_to_the_model_limit_said_once(tmp_path):
    """A model with max_position_embeddings 256 trains with the default (min(2048, 256)); above it is an error."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR

    config = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    config.max_position_embeddings = 256
    model_dir = tmp_path / "short"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR).save_pretrained(model_dir)
    command = [sys.executable, TRAIN_PY, "--model_name_or_path", str(model_dir), "--max_steps", "1"]
    result = run_ok(command + ["--output_dir", str(tmp_path / "out")], timeout=300)
    said = [line for line in result.stderr.splitlines() if "--max_seq_length" in line]
    assert said == ["hf_scale: --max_seq_length 256 (default: the smaller of 2048 and the model's "
                    "max_position_embeddings 256)"]
    too_long = run(command + ["--max_seq_length", "257", "--output_dir", str(tmp_path / "out2")], timeout=300)
    assert too_long.returncode == 2
    assert too_long.stderr.strip().splitlines()[-1] == (
        "train.py: error: --max_seq_length 257 is above the model's max_position_embeddings 256; use at most 256")


def test_help_lists_trainer_and_hf_scale_flags():
    result = run_ok([sys.executable, TRAIN_PY, "--help"], timeout=120)
    for flag in (
        "--per_device_train_batch_size",
        "--deepspeed",
        "--loop",
        "--hf_scale_config",
        "--packing",
        "--lora_r",
        "--model_name_or_path",
        "--train_file",
        "--max_seq_length",
    ):
        assert flag in result.stdout


@pytest.mark.multiprocess
def test_hf_scale_config_supplies_deepspeed_under_torchrun(tmp_path):
    config = tmp_path / "zero2.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "strategy": "deepspeed",
                "precision": "no",
                "topology": {"processes_per_machine": 2},
                "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
                "deepspeed": {"zero_stage": 2, "torch_adam": True},
            }
        )
    )
    out = tmp_path / "out"
    result = run_ok(
        launcher_command("torchrun")
        + ["--hf_scale_config", str(config), "--max_steps", "2", "--output_dir", str(out)],
        env=child_env(),
    )
    # The run spec, built once after the config filled the flags, said once (main process).
    said = [line for line in result.stderr.splitlines() if line.startswith("hf_scale: run: ")]
    assert said == ["hf_scale: run: deepspeed ZeRO-2 on 2 process(es) (torchrun), trainer loop: global batch size 8, "
                    "gradient accumulation steps 2, local batch size 2; precision no"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["strategy"] == "deepspeed" and summary["world_size"] == 2
    assert summary["saved_model_verified"] is True


@pytest.mark.multiprocess
def test_accelerate_launch_of_a_bf16_zero3_config_runs_in_bf16_without_the_flag(tmp_path):
    """The issue-10 case: `accelerate launch --config_file <generated zero3 yaml> train.py` with no --bf16 used to
    die in transformers' mismatch traceback. Now the JSON's bf16 is followed (DeepSpeed bf16 on CPU, checked by
    the runtime guard) and the 16-bit ZeRO-3 save is verified bit-exactly."""
    generate_config(tmp_path, "z3", preset="zero3", sets=["topology.processes_per_machine=2",
                                                           "batch.micro_batch_size=2"])
    out = tmp_path / "out"
    result = run_ok(launcher_command("accelerate", config=tmp_path / "accelerate_configs" / "z3.yaml")
                    + ["--max_steps", "2", "--per_device_train_batch_size", "2", "--output_dir", str(out)],
                    cwd=tmp_path)
    followed = [line for line in result.stderr.splitlines() if "following the launcher's config" in line]
    assert followed == ["hf_scale: following the launcher's config: bf16=True (ds_configs/z3.json bf16.enabled=true "
                        "and ds_configs/z3.json fp16.enabled=false)"]
    report = assert_saved_model_verified(out)
    assert report["saved_dtypes"] == ["bfloat16"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["strategy"] == "deepspeed" and summary["world_size"] == 2


def test_lora_saves_a_nonempty_adapter_that_reloads(tmp_path):
    from peft import AutoPeftModelForCausalLM
    from safetensors.torch import load_file

    run_ok(
        [
            sys.executable,
            TRAIN_PY,
            "--lora_r",
            "4",
            "--max_steps",
            "2",
            "--learning_rate",
            "1e-2",
            "--output_dir",
            str(tmp_path),
        ],
        timeout=300,
    )
    adapter = load_file(tmp_path / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    assert any(
        t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name
    )  # trained, not the zero init
    AutoPeftModelForCausalLM.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "hf_scale_verify.json").read_text())["ok"]


def test_packing_run_trains_and_saves(tmp_path):
    run_ok(
        [
            sys.executable,
            TRAIN_PY,
            "--packing",
            "--loop",
            "accelerate",
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path),
        ],
        cwd=REPO,
        timeout=300,
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["tokens"] > 0 for r in records)
    assert json.loads((tmp_path / "hf_scale_verify.json").read_text())["ok"]


def _tensorboard_scalars(root) -> dict[str, list[float]]:
    """Read the scalar summaries of every TensorBoard event file under root (TFRecord framing)."""
    import struct
    from pathlib import Path

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[float]] = {}
    for path in Path(root).rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(value.simple_value)
    return scalars


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_report_to_tensorboard_logs_the_loss_in_both_loops(loop, tmp_path):
    run_ok([sys.executable, TRAIN_PY, "--max_steps", "3", "--loop", loop, "--report_to", "tensorboard",
            "--output_dir", str(tmp_path)], timeout=300)
    scalars = _tensorboard_scalars(tmp_path)
    loss_tag = next(tag for tag in scalars if tag.endswith("loss"))
    assert len(scalars[loss_tag]) == 3


@pytest.mark.multiprocess
def test_torch_compile_with_packing_compiles_once_and_saves_and_exports_plain_weights(tmp_path):
    """--torch_compile --packing: every packed row is padded to the budget, so 20 steps of rows holding
    different examples compile a bounded number of times (metrics.jsonl counts the graphs). The model is
    wrapped; the saved model and the export must use the module's own names."""
    from hf_scale.commands.cli import main as cli_main

    run_ok([sys.executable, TRAIN_PY, "--torch_compile", "--packing", "--max_seq_length", "128",
            "--per_device_train_batch_size", "1", "--loop", "accelerate", "--max_steps", "20",
            "--save_steps", "20", "--output_dir", str(tmp_path / "run")], timeout=600)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 20 and len({r["tokens"] for r in records}) > 1, "rows of different real lengths"
    compilations = [r["compilations"] for r in records]
    assert 1 <= max(compilations) <= 2 and compilations[-1] == compilations[1], compilations
    assert all(r["data_wait_s"] >= 0 for r in records)
    assert_saved_model_verified(tmp_path / "run")  # the plain names, exactly the trained tensors
    assert cli_main(["export", str(tmp_path / "run" / "checkpoint-20"), str(tmp_path / "exported")]) == 0
    import torch

    torch.testing.assert_close(logits(tmp_path / "exported"), logits(tmp_path / "run"), rtol=1e-5, atol=1e-5)
