"""What a resume trains (hf_scale/train/checkpoint/resume.py): nothing when the checkpoint is the run's last step,
and this run's own learning-rate schedule from the resumed step on, in both loops. One-process runs inside this
process."""

from __future__ import annotations

import shutil

import datasets
import pytest
from train_helpers import read_metrics, run_in_process, tree

from hf_scale.contract import checkpoint_layout

LOOPS = ["accelerate", "trainer"]


@pytest.fixture(autouse=True, scope="module")
def datasets_cache_in_tmp(tmp_path_factory):
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets_cache"))
    yield
    datasets.config.HF_DATASETS_CACHE = saved


def _lines(stderr: str, start: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-4000:]
    return [line for line in stderr.splitlines() if line.startswith(start)]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_finished_run_resumed_says_so_trains_nothing_and_a_shorter_one_is_refused(loop, tmp_path, capfd):
    out = tmp_path / "out"
    assert run_in_process(["--max_steps", "2", "--save_steps", "1", "--loop", loop, "--output_dir", str(out)]) == 0
    before = tree(out)
    capfd.readouterr()
    assert run_in_process(["--max_steps", "2", "--save_steps", "1", "--loop", loop, "--output_dir", str(out),
                           "--resume_from_checkpoint", "auto"]) == 0
    (line,) = _lines(capfd.readouterr().err, f"hf_scale: {out / 'checkpoint-2'} is the last step")
    assert line == (f"hf_scale: {out / 'checkpoint-2'} is the last step (2) of this run (--max_steps=2): the run is "
                    f"finished, nothing was trained or written; its final save is in {out} (verified, "
                    "hf_scale_verify.json)")
    assert tree(out) == before  # no step 3, no checkpoint-3, no second final save

    # Epochs: the run's length counted as both loops count it (256 rows of the sample data / batch 8 = 32 steps).
    shutil.rmtree(out)
    epoch_run = ["--num_train_epochs", "0.0625", "--save_steps", "1", "--loop", loop, "--output_dir", str(out)]
    assert run_in_process(epoch_run) == 0
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)][-1] == "checkpoint-2"
    capfd.readouterr()
    assert run_in_process([*epoch_run, "--resume_from_checkpoint", "auto"]) == 0
    assert _lines(capfd.readouterr().err, f"hf_scale: {out / 'checkpoint-2'} is the last step (2) of this run "
                                          "(--num_train_epochs=0.0625 (2 steps))")

    before = tree(out)
    assert run_in_process(["--max_steps", "1", "--loop", loop, "--output_dir", str(out),
                           "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 2
    (line,) = _lines(capfd.readouterr().err, "train.py: error:")
    assert line == (f"train.py: error: --max_steps=1: --resume_from_checkpoint={out / 'checkpoint-2'} is already at "
                    "step 2, past this run's 1 steps; resume with a run of more than 2 steps, or start afresh in "
                    "another --output_dir")
    assert tree(out) == before


# The resumed run changes the length, the peak rate, the warmup and the kind of schedule at once.
FIRST = ["--max_steps", "4", "--save_steps", "2", "--learning_rate", "1e-3", "--warmup_ratio", "0"]
SECOND = ["--max_steps", "7", "--save_steps", "2", "--learning_rate", "3e-4", "--warmup_steps", "3",
          "--lr_scheduler_type", "cosine"]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_resume_with_another_schedule_trains_every_step_at_the_new_schedules_rate(loop, tmp_path, capfd):
    reference, out = tmp_path / "fresh", tmp_path / "out"
    assert run_in_process([*SECOND, "--loop", loop, "--output_dir", str(reference)]) == 0
    want = {record["step"]: record["lr"] for record in read_metrics(reference)}
    assert run_in_process([*FIRST, "--loop", loop, "--output_dir", str(out)]) == 0
    old = {record["step"]: record["lr"] for record in read_metrics(out)}
    assert old[2] != want[2]  # the two schedules differ at the resumed step (so the test can tell them apart)
    shutil.rmtree(out / "checkpoint-4")  # resume from step 2: mid-warmup of the new schedule
    capfd.readouterr()
    assert run_in_process([*SECOND, "--loop", loop, "--output_dir", str(out),
                           "--resume_from_checkpoint", "auto"]) == 0
    (line,) = _lines(capfd.readouterr().err, "hf_scale: resumed on this run's learning-rate schedule")
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 8))
    got = {r["step"]: r["lr"] for r in records[2:]}
    assert got == {step: want[step] for step in range(3, 8)}  # exact: the fresh run's rate at every resumed step
    assert line == (f"hf_scale: resumed on this run's learning-rate schedule: the next step trains at {want[3]:.6g} "
                    f"(the checkpoint's run was at {old[3]:.6g})")
