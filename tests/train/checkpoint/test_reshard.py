"""Resuming at another world size (2 -> 1 and 1 -> 2 processes) in the manual loop, and the refusals.

Both runs of a pair have the same global batch (2 processes x accumulation 2 = 1 process x accumulation
4), so the resumed steps must equal the uninterrupted run's (rtol 1e-4: the reduction order differs).
"""

from __future__ import annotations

import shutil
import sys

import pytest
from checkpoint_runs import COMMON, launcher, strategy_args, trained
from train_helpers import TRAIN_PY, launcher_command, read_metrics, run, run_ok, training_traceback_frames

from hf_scale.train.checkpoint import layout as checkpoint_layout

pytestmark = pytest.mark.multiprocess


def _resume(tmp_path_factory, tmp_path, strategy: str, saved_procs: int, new_procs: int):
    """Resume `checkpoint-2` of a `saved_procs` run with `new_procs` processes; (uninterrupted, resumed) metrics."""
    full = trained(tmp_path_factory, strategy, saved_procs)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    result = run_ok(launcher(strategy, new_procs) + COMMON + strategy_args(tmp_path_factory, strategy, new_procs)
                    + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert f"resuming from {out / 'checkpoint-2'}" in result.stderr
    return read_metrics(full), read_metrics(out), result


@pytest.mark.parametrize(
    ("strategy", "saved_procs", "new_procs"),
    # DeepSpeed: ZeRO-2 grows (1 -> 2), ZeRO-3 shrinks (2 -> 1); both go through DeepSpeed's universal checkpoint.
    [("ddp", 2, 1), ("ddp", 1, 2), ("zero2", 1, 2), ("zero3", 2, 1), ("fsdp", 2, 1), ("fsdp", 1, 2)],
    ids=lambda v: str(v),
)
def test_resume_at_another_world_size_continues_the_uninterrupted_run(
    strategy, saved_procs, new_procs, tmp_path_factory, tmp_path
):
    full, resumed, result = _resume(tmp_path_factory, tmp_path, strategy, saved_procs, new_procs)
    assert [r["step"] for r in resumed] == [3, 4]
    want = {r["step"]: r for r in full}
    for record in resumed:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)
        assert record["lr"] == pytest.approx(want[record["step"]]["lr"], rel=1e-6)
        assert record["tokens"] == want[record["step"]]["tokens"]  # the same samples: the data position is right
    if strategy.startswith("zero"):
        assert "DeepSpeed universal checkpoint" in result.stderr
        # The temporary universal view is gone; only real checkpoints remain.
        assert not list((tmp_path / "resumed").glob(f"{checkpoint_layout.TMP_PREFIX}*"))
    saved = checkpoint_layout.complete_checkpoints(tmp_path / "resumed")
    assert [p.name for p in saved] == ["checkpoint-2", "checkpoint-4"]


def test_trainer_path_refuses_another_world_size_before_training(tmp_path):
    out = tmp_path / "run"
    base = ["--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "2", "--loop", "trainer"]
    run_ok([sys.executable, TRAIN_PY, *base, "--output_dir", str(out)])
    result = run(launcher_command("torchrun", nproc=2) + base + ["--max_steps", "4", "--output_dir", str(out),
                                                                 "--resume_from_checkpoint", "auto"])
    assert result.returncode != 0
    assert (
        f"train.py: error: --resume_from_checkpoint={out / 'checkpoint-2'}: saved by 1 processes, resumed with 2; "
        "the Trainer path resumes only at the same world size" in result.stderr
    )
    assert "hf-scale export" in result.stderr
    assert not training_traceback_frames(result.stderr)  # one line from train.py (torchrun adds its own report)
    assert not (out / "metrics.jsonl").read_text().count('"step": 3')  # refused before any training step


def test_resume_with_another_strategy_is_refused_with_how_to_convert(tmp_path_factory, tmp_path):
    full = trained(tmp_path_factory, "ddp", 1)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    result = run(launcher_command("torchrun", nproc=1) + COMMON + strategy_args(tmp_path_factory, "zero2", 1)
                 + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert result.returncode != 0 and not training_traceback_frames(result.stderr)
    assert "saved with full states (DDP / one process), resumed with DeepSpeed ZeRO-2" in result.stderr
    assert f"hf-scale export {out / 'checkpoint-2'} EXPORT_DIR" in result.stderr
    assert not (out / "metrics.jsonl").exists()
