"""Preemption through the generated launch scripts: a stop signal sent to the script's own PID (what
`kill`, a scheduler's SIGTERM or `kill -USR1` does) reaches the training processes, train.py saves a
complete checkpoint, and the script exits 75 so that the SLURM script requeues the job.

One real 2-process training run per script kind (accelerate launch, torchrun, the deepspeed launcher),
SIGTERM and SIGUSR1 both covered, configs written by `hf-scale generate`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import TRAIN_PY, child_env, free_port

from hf_scale.cli import main
from hf_scale.train import checkpoint

pytestmark = pytest.mark.multiprocess

CPU_2PROC = ["topology.processes_per_machine=2", "deepspeed.torch_adam=true", "precision=no",
             "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2"]
TRAIN_ARGS = ["--max_steps", "500", "--save_steps", "1000", "--learning_rate", "1e-3", "--seed", "3",
              "--warmup_ratio", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]

CASES = [
    # (id, preset, script kind, signal, loop)
    ("accelerate-ddp-SIGTERM", "ddp", "accelerate", signal.SIGTERM, "accelerate"),
    ("torchrun-zero2-SIGUSR1", "zero2", "torchrun", signal.SIGUSR1, "trainer"),
    ("deepspeed-zero3-SIGTERM", "zero3", "deepspeed", signal.SIGTERM, "accelerate"),
]


def _wait_for_first_step(out: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"exit {proc.returncode} before the first step:\n{proc.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, "no optimizer step in time"
        time.sleep(0.1)


@pytest.mark.parametrize(("preset", "kind", "sig", "loop"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_signal_to_the_script_checkpoints_and_exits_75(preset, kind, sig, loop, tmp_path):
    root = tmp_path / "generated"
    sets = [arg for item in CPU_2PROC for arg in ("--set", item)]
    assert main(["generate", "--preset", preset, *sets, "--name", "run", "--output-dir", str(root)]) == 0
    out = tmp_path / "out"
    port = str(free_port())
    env = child_env()
    env.update(
        TRAIN_SCRIPT=TRAIN_PY,
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",  # this interpreter's accelerate/torchrun/deepspeed
        MAIN_PROCESS_PORT=port,
        MASTER_PORT=port,
        TMPDIR=str(tmp_path),
    )
    script = root / "launch" / f"run.{kind}.sh"
    proc = subprocess.Popen(
        ["bash", str(script), *TRAIN_ARGS, "--loop", loop, "--output_dir", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _wait_for_first_step(out, proc)
        proc.send_signal(sig)  # the script's PID only: the script must pass it on
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == checkpoint.EXIT_PREEMPTED, stderr[-4000:]
    assert "hf_scale: stopped by SIGUSR1" in stderr  # the script passes both signals on as SIGUSR1
    saved = checkpoint.complete_checkpoints(out)
    assert len(saved) == 1, stderr[-4000:]
    assert 1 <= checkpoint.step_of(saved[0]) < 500
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    assert not list(tmp_path.glob("hf-scale.*"))  # the script's private status directory is gone
