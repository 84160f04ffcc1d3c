"""Checkpoints: bit-identical resume, atomic saves under kill -9, stop on SIGTERM/SIGUSR1, dead ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_helpers import (
    REPO,
    TRAIN_PY,
    child_env,
    generate_config,
    launcher_command,
    read_metrics,
    run_ok,
    training_traceback_frames,
)

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.exit_codes import EXIT_PREEMPTED

pytestmark = pytest.mark.multiprocess

STEPS = 6
ARGS = ["--max_steps", str(STEPS), "--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--save_steps", "2"]
CPU_2PROC = ["topology.processes_per_machine=2", "deepspeed.torch_adam=true", "precision=no",
             "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def ds_configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    generate_config(root, "zero3", preset="zero3", sets=CPU_2PROC)
    return root / "ds_configs"


# ZeRO-2 is left out: its checkpoints go through the same DeepSpeed engine save/load as ZeRO-3's (which also
# gathers partitioned parameters), and tests/train/checkpoint/test_reshard.py resumes a ZeRO-2 checkpoint at
# another world size and compares it with the uninterrupted run.
CASES = [
    ("single-trainer", "python", None, "trainer"),
    ("ddp-loop", "torchrun", None, "accelerate"),
    ("ddp-trainer", "torchrun", None, "trainer"),
    ("zero3-loop", "torchrun", "zero3", "accelerate"),
    ("zero3-trainer", "torchrun", "zero3", "trainer"),
]


@pytest.mark.parametrize(("launcher", "ds", "loop"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resume_mid_epoch_is_bit_identical(launcher, ds, loop, ds_configs, tmp_path):
    extra = ARGS + ["--loop", loop] + (["--deepspeed", str(ds_configs / f"{ds}.json")] if ds else [])
    full = tmp_path / "full"
    run_ok(launcher_command(launcher) + extra + ["--output_dir", str(full)])
    saved = checkpoint_layout.complete_checkpoints(full)
    assert [p.name for p in saved] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    # A second run that starts from the step-2 checkpoint (8 of 256 samples: mid-epoch), in a directory whose
    # metrics.jsonl holds what a crashed run wrote: steps 1-2, then 3-6 after its last checkpoint.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    for name in ("metrics.jsonl", checkpoint_layout.MARKER):  # the crashed run's: hf_scale wrote that directory
        shutil.copy(full / name, resumed / name)
    run_ok(launcher_command(launcher) + extra + ["--output_dir", str(resumed), "--resume_from_checkpoint", "auto"])
    want = {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(full)}
    records = read_metrics(resumed)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # each step once: appended, not truncated
    assert records[:2] == read_metrics(full)[:2]  # the history before the resume, kept as it was
    got = {r["step"]: (r["loss"], r["lr"]) for r in records[2:]}
    assert got == {step: want[step] for step in got}  # exact float equality: bit-identical


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training did not reach the step in time"
        time.sleep(0.05)


# SIGTERM here; SIGUSR1 (SLURM's --signal) goes through the same handler and is sent through a generated launch
# script in tests/generators/test_launch_signals.py and to one rank in the test below.
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_signal_saves_a_checkpoint_exits_75_and_resumes_exactly(sig, tmp_path):
    long_args = [a if a != str(STEPS) else "40" for a in ARGS[:2]] + ARGS[2:] + ["--save_steps", "1000"]
    reference = tmp_path / "reference"
    run_ok([sys.executable, TRAIN_PY, *long_args, "--loop", "accelerate", "--output_dir", str(reference)])

    out = tmp_path / "run"
    command = [sys.executable, TRAIN_PY, *long_args, "--loop", "accelerate", "--output_dir", str(out)]
    proc = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out, 3, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert f"stopped by {sig.name}" in stderr
    saved = checkpoint_layout.complete_checkpoints(out)
    assert len(saved) == 1
    stopped_at = checkpoint_layout.step_of(saved[0])
    assert not (out / "model.safetensors").exists()  # no final model from an unfinished run

    run_ok(command + ["--resume_from_checkpoint", "auto"])
    want = {r["step"]: r["loss"] for r in read_metrics(reference)}
    got = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 41))  # each step once
    assert all(got[s] == want[s] for s in range(stopped_at + 1, 41))


def test_signal_to_one_rank_stops_all_ranks_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    command = launcher_command("torchrun") + ARGS[:1] + ["200"] + ARGS[2:] + [
        "--save_steps", "1000", "--loop", "accelerate", "--output_dir", str(out)]
    proc = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(out, 2, proc)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[-1].send_signal(signal.SIGUSR1)  # only one rank hears it
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "exitcode: 75" in stderr or proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    saved = checkpoint_layout.complete_checkpoints(out)
    assert len(saved) == 1
    assert json.loads((saved[0] / checkpoint_layout.STATE).read_text())["world_size"] == 2


@pytest.mark.parametrize(("loop", "first", "again"), [("accelerate", signal.SIGTERM, signal.SIGTERM),
                                                   ("trainer", signal.SIGUSR1, signal.SIGTERM)])
def test_a_repeated_stop_signal_does_not_change_the_exit_code(loop, first, again, tmp_path):
    """A scheduler may signal again before the process is gone: every ~0.1 s from the first signal until exit, so
    the repeats land in the step, the save, the shutdown and the interpreter's finalization alike."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, TRAIN_PY, "--max_steps", "300", "--save_steps", "1000", "--loop", loop,
                             "--output_dir", str(out)], env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(out, 1, proc)
        proc.send_signal(first)
        repeats = 0
        while proc.poll() is None:
            proc.send_signal(again)
            repeats += 1
            time.sleep(0.1)
        stderr = proc.communicate()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert repeats >= 3 and f"stopped by {first.name}" in stderr  # the first signal says why it stopped
    (saved,) = checkpoint_layout.complete_checkpoints(out)
    assert checkpoint_verification.verify(saved, checkpoint_verification.ONE_PROCESS) is None


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_resumable(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, TRAIN_PY, "--max_steps", "400", "--save_steps", "1", "--save_total_limit", "2",
               "--per_device_train_batch_size", "2", "--loop", "accelerate", "--output_dir", str(out)]
    killed_mid_save = False
    for _ in range(5):  # the kill must land while a save is being written; retry if it did not
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(command, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_steps(out, 3, proc)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed_mid_save:
                if any(p.name.startswith(checkpoint_layout.TMP_PREFIX) for p in out.iterdir()):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed_mid_save = True
        finally:
            proc.kill()
            proc.wait()
        if killed_mid_save and any(p.name.startswith(checkpoint_layout.TMP_PREFIX) for p in out.iterdir()):
            break
        killed_mid_save = False
    assert killed_mid_save, "could not kill the process in the middle of a save"
    complete = checkpoint_layout.complete_checkpoints(out)
    assert complete, "the previous checkpoint must survive"
    newest = checkpoint_layout.step_of(complete[-1])

    result = run_ok(command[:2] + ["--max_steps", str(newest + 1)] + command[4:] + ["--resume_from_checkpoint", "auto"])
    assert "removed interrupted save" in result.stderr  # and the dead run's lock did not block this one
    assert f"resuming from {complete[-1]}" in result.stderr
    assert not any(p.name.startswith(checkpoint_layout.TMP_PREFIX) for p in out.iterdir())
    assert read_metrics(out)[-1]["step"] == newest + 1


def test_a_dead_rank_makes_the_others_exit_instead_of_hanging(tmp_path):
    """... with one line from the survivor naming the dead rank and its log (torchrun --log-dir --tee keeps one
    file per rank), not gloo's traceback; the run still fails (torchrun reports the survivor's exit code 1)."""
    out = tmp_path / "run"
    command = launcher_command("torchrun")
    command[-1:-1] = ["--log-dir", str(tmp_path / "logs"), "--tee", "3"]  # before train.py: torchrun's flags
    command += ["--max_steps", "100000", "--save_steps", "100000", "--ddp_timeout", "60", "--loop", "accelerate",
                "--output_dir", str(out)]
    start = time.monotonic()
    proc = subprocess.Popen(command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(out, 2, proc)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
        rank1 = next(p for p in workers if p.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - start < 240
    assert "rank: 1" in stderr or "local_rank: 1" in stderr, stderr[-3000:]
    assert training_traceback_frames(stderr) == [], stderr[-3000:]
    line = next(line for line in stderr.splitlines() if "train.py: error:" in line)
    log = next((tmp_path / "logs").glob("*/attempt_0/1/stderr.log"))
    assert "rank 0: rank 1 died during the run, so this rank's collective failed (gloo: Connection" in line, line
    assert f"rank 1 was pid {rank1.pid} on " in line and line.endswith(f"its log: {log}"), line
    assert sum("train.py: error:" in line for line in stderr.splitlines()) == 1, stderr[-3000:]
    # The survivor's exit code: 1 (a failed run, as before), or -15 when torchrun's agent, which saw rank 1 die,
    # terminated it first: a race between the agent's monitor and the survivor's own exit, after its one line.
    assert "exitcode  : 1 (pid" in stderr or "exitcode  : -15 (pid" in stderr, stderr[-3000:]


def test_save_total_limit_keeps_the_newest(tmp_path):
    run_ok([sys.executable, TRAIN_PY, "--max_steps", "5", "--save_steps", "1", "--save_total_limit", "2",
            "--loop", "accelerate", "--output_dir", str(tmp_path)], cwd=REPO)
    assert [p.name for p in checkpoint_layout.complete_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-5"]
