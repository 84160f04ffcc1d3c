"""A mixture-of-experts fine-tune in one process (issue 35's first point): a tiny Qwen3-MoE (4 experts, 2 active),
whose experts transformers keeps fused at run time and saves per expert, trains in both loops, with and without
LoRA, ends with exit 0 and a verified save; the saved model loads with from_pretrained; `hf-scale export` of the
final step's checkpoint gives a model with the same logits."""

from __future__ import annotations

import sys

import pytest
import torch
from train_helpers import TRAIN_PY, assert_saved_model_verified, build_tiny_moe, logits, run_ok

pytestmark = pytest.mark.multiprocess

EXPORT = [sys.executable, "-m", "hf_scale", "export"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("moe") / "moe")


@pytest.mark.parametrize(("loop", "lora_r"), [("trainer", 0), ("accelerate", 0), ("accelerate", 4)],
                         ids=["trainer", "accelerate", "accelerate-lora"])
def test_moe_fine_tune_saves_a_verified_model_and_exports_its_checkpoint(loop, lora_r, moe_dir, tmp_path):
    out = tmp_path / "run"
    result = run_ok([sys.executable, TRAIN_PY, "--model_name_or_path", str(moe_dir), "--output_dir", str(out),
                     "--max_steps", "2", "--loop", loop, "--lora_r", str(lora_r)])
    assert "verified" in result.stdout + result.stderr
    if lora_r:
        assert (out / "adapter_model.safetensors").is_file()
    else:
        # The check compared every trained tensor (the fused experts as their 8 and 4 saved pieces per layer),
        # and from_pretrained loads the directory.
        assert_saved_model_verified(out)
    exported = tmp_path / "exported"
    # The Trainer's checkpoint is save_pretrained's (experts per expert); the manual loop's keeps them fused.
    run_ok([*EXPORT, str(out / "checkpoint-2"), str(exported), *(["--merge"] if lora_r else [])], timeout=300)
    torch.testing.assert_close(logits(exported), logits(out), rtol=1e-5, atol=1e-5)
