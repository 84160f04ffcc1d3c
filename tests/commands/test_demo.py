"""`hf-scale demo`, the Quickstart's first command: generate, check, 2-process ZeRO-3 fine-tune, save."""

from __future__ import annotations

import json
import sys

import pytest
from train_helpers import assert_live_values, assert_quiet, child_env, run, run_ok


@pytest.mark.multiprocess
def test_demo_generates_checks_trains_two_processes_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    result = run_ok([sys.executable, "-m", "hf_scale", "demo", "--output-dir", str(tmp_path), "--max-steps", "3"],
                    env=child_env())
    assert (tmp_path / "accelerate_configs" / "zero3_demo.yaml").is_file()
    assert json.loads((tmp_path / "ds_configs" / "zero3_demo.json").read_text())["zero_optimization"]["stage"] == 3
    summary = json.loads((tmp_path / "model" / "train_summary.json").read_text())
    assert summary["strategy"] == "deepspeed" and summary["world_size"] == 2 and summary["steps"] == 3
    assert "step  loss" in result.stdout and f"model saved to {tmp_path / 'model'}" in result.stdout
    # The demo checks its own files clean, and says nothing a user learns to ignore.
    assert "ok: 0 error(s), 0 warning(s)" in result.stdout
    assert_quiet(result, steps=3)
    # Launched by its generated script with no value flags: the config's values are what ran.
    assert assert_live_values(tmp_path / "model", tmp_path / "hf_scale_configs" / "zero3_demo.yaml")["optimizer"][
        "lr"] == 1e-3
    AutoModelForCausalLM.from_pretrained(tmp_path / "model")


def test_demo_rejects_nonpositive_steps(tmp_path):
    result = run([sys.executable, "-m", "hf_scale", "demo", "--output-dir", str(tmp_path), "--max-steps", "0"],
                 timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["hf-scale: error: --max-steps=0: must be >= 1"]
    assert not any(tmp_path.iterdir())
