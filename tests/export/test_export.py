"""`hf-scale export`: real checkpoints of every layout -> from_pretrained (no DeepSpeed) -> the trained logits."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from checkpoint_runs import trained
from safetensors.torch import load_file
from train_helpers import PROBE_IDS, logits, run, run_ok
from transformers import AutoModelForCausalLM

from hf_scale.contract import checkpoint_layout

pytestmark = pytest.mark.multiprocess

EXPORT = [sys.executable, "-m", "hf_scale", "export"]
SMALL_SHARDS = ["--max-shard-size", "200KB"]  # the tiny model (~430 KB in fp32) really splits into shards


def _export(checkpoint_dir, out, *flags):
    return run_ok(EXPORT + [str(checkpoint_dir), str(out), *flags], timeout=180)


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def _assert_final_logits(exported, run_dir, *, atol=1e-5):
    """The export of checkpoint-4 reproduces the logits of the model train.py saved after step 4 (which its
    save check proved equal, tensor by tensor, to the live, still sharded trained model)."""
    model = AutoModelForCausalLM.from_pretrained(exported)
    torch.testing.assert_close(_logits(model, PROBE_IDS), logits(run_dir), rtol=1e-5, atol=atol)
    return model


# ZeRO-1 is left out: its checkpoint has ZeRO-2's layout (whole 16-bit weights in mp_rank_00_model_states.pt,
# optimizer states partitioned), read by the same code.
@pytest.mark.parametrize(("strategy", "label"), [("zero2", "ZeRO-2"), ("zero3", "ZeRO-3"), ("fsdp", "FSDP2"),
                                                  ("ddp", "full weights")])
def test_export_of_a_two_process_checkpoint_loads_with_the_trained_logits(strategy, label, tmp_path_factory,
                                                                          tmp_path):
    run_dir = trained(tmp_path_factory, strategy, 2)
    out = tmp_path / "exported"
    result = _export(run_dir / "checkpoint-4", out, *SMALL_SHARDS)
    assert label in result.stderr and "done" in result.stderr  # progress says what it read

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert not list(tmp_path.glob(".tmp-export-*"))
    model = _assert_final_logits(out, run_dir)
    assert model.config.use_cache  # training switched the KV cache off; inference wants it back


def test_export_dtype_bf16_writes_bf16_weights_close_to_the_trained_logits(tmp_path_factory, tmp_path):
    run_dir = trained(tmp_path_factory, "zero3", 2)
    out = tmp_path / "bf16"
    _export(run_dir / "checkpoint-4", out, "--dtype", "bf16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert (_logits(model, PROBE_IDS) - logits(run_dir)).abs().max() < 0.1


def test_lora_under_zero3_exports_a_non_empty_adapter_and_a_merged_model(tmp_path_factory, tmp_path):
    from peft import AutoPeftModelForCausalLM

    run_dir = trained(tmp_path_factory, "zero3", 2, extra=("--lora_r", "4"))

    adapter = tmp_path / "adapter"
    _export(run_dir / "checkpoint-4", adapter, "--lora", "adapter")
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert tensors and all(t.numel() > 0 for t in tensors.values())
    assert {k.split(".")[-2] for k in tensors} == {"lora_A", "lora_B"}
    # lora_B starts at zero: non-zero values prove the trained adapter was gathered, not the initial one.
    assert all(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)
    reloaded = AutoPeftModelForCausalLM.from_pretrained(adapter)
    torch.testing.assert_close(_logits(reloaded, PROBE_IDS), logits(run_dir), rtol=1e-5, atol=1e-5)

    merged = tmp_path / "merged"
    _export(run_dir / "checkpoint-4", merged, "--lora", "merged", *SMALL_SHARDS)
    assert not (merged / "adapter_config.json").exists()
    assert (merged / "model.safetensors.index.json").is_file()
    _assert_final_logits(merged, run_dir, atol=1e-4)  # merging re-associates the sums: rounding only


def test_export_refuses_an_incomplete_checkpoint_in_one_line(tmp_path_factory, tmp_path):
    broken = tmp_path / "checkpoint-4"
    shutil.copytree(trained(tmp_path_factory, "zero2", 2) / "checkpoint-4", broken)
    (broken / checkpoint_layout.MANIFEST).unlink()
    out = tmp_path / "out"
    result = run(EXPORT + [str(broken), str(out)], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hf-scale: error: CHECKPOINT_DIR {broken}: incomplete or corrupt checkpoint (no "
        f"{checkpoint_layout.MANIFEST} (an interrupted save, or not written by hf_scale)); export a complete "
        "OUTPUT_DIR/checkpoint-STEP"
    ]
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))


def test_export_of_a_run_directory_takes_its_newest_complete_checkpoint_and_says_which(tmp_path_factory, tmp_path):
    run_dir = tmp_path / "run"
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(trained(tmp_path_factory, "ddp", 2) / name, run_dir / name)
    (run_dir / "checkpoint-4" / checkpoint_layout.MANIFEST).unlink()  # interrupted while saving
    out = tmp_path / "exported"
    result = _export(run_dir, out)
    assert (f"hf-scale export: {run_dir} is a training output directory: exporting its newest verified checkpoint, "
            f"checkpoint-2 (checkpoint-4: no {checkpoint_layout.MANIFEST} (an interrupted save, or not written by "
            "hf_scale))") in result.stderr.splitlines()
    AutoModelForCausalLM.from_pretrained(out)
    refused = run(EXPORT + [str(run_dir / "checkpoint-4"), str(tmp_path / "out4")], timeout=120)
    assert refused.stderr.strip().endswith(f"the newest verified one beside it is {run_dir / 'checkpoint-2'}")

    (run_dir / "checkpoint-2" / checkpoint_layout.MANIFEST).unlink()
    result = run(EXPORT + [str(run_dir), str(tmp_path / "out2")], timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"hf-scale: error: CHECKPOINT_DIR {run_dir}: a training output directory without a checkpoint of verified "
        f"content (checkpoint-4: no {checkpoint_layout.MANIFEST} (an interrupted save, or not written by hf_scale); "
        f"checkpoint-2: no {checkpoint_layout.MANIFEST} (an interrupted save, or not written by hf_scale))"
    ]
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "merged"], "is not a LoRA checkpoint"),
        (["--max-shard-size", "big"], "--max-shard-size 'big'"),
        ([], "already exists and is not empty"),
    ],
    ids=["lora-on-full-model", "bad-shard-size", "non-empty-out-dir"],
)
def test_export_refuses_bad_input_without_writing(flags, message, tmp_path_factory, tmp_path):
    out = tmp_path / "out"
    if message.startswith("already"):
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    result = run(EXPORT + [str(trained(tmp_path_factory, "ddp", 2) / "checkpoint-4"), str(out), *flags], timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if out.exists() else [])
    if out.exists():
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_help_shows_examples():
    result = run_ok(EXPORT + ["--help"], timeout=60)
    assert "examples:" in result.stdout and "--lora merged" in result.stdout and "--dtype" in result.stdout
