"""Preemption through the generated launch scripts: a stop signal sent to the script's own PID (what
`kill`, a scheduler's SIGTERM or `kill -USR1` does) reaches the training processes, train.py saves a
complete checkpoint, and the script exits 75 so that the SLURM script requeues the job.

One real 2-process training run per script kind (accelerate launch, torchrun, the deepspeed launcher),
SIGTERM and SIGUSR1 both covered, configs written by `hf-scale generate`. The same runs prove that the
config reaches the run through the script alone: started from another directory, with no batch, clipping,
optimizer, precision or checkpointing flag, each run's hf_scale_live.json (read from the live objects) holds
the config's non-default values; torchrun's DeepSpeed JSON is "resolved" (its optimizer block carries the
same lr/betas/eps/weight decay as the flags --hf_scale_config fills, so transformers finds no mismatch).
The scripts run with a PATH that has no procps (no pgrep, no ps), as in the CUDA PyTorch base images: the
stop request still reaches the training processes (the scripts read the process tree from /proc).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from train_helpers import assert_live_values, child_env, free_port, path_without

from hf_scale.commands.cli import main
from hf_scale.contract import checkpoint_layout
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.train.checkpoint import store

pytestmark = pytest.mark.multiprocess

# Every value differs from the presets' and train.py's defaults (a value that never arrives cannot hide).
CPU_2PROC = ["topology.processes_per_machine=2", "deepspeed.torch_adam=true", "precision=no",
             "batch.micro_batch_size=1", "batch.gradient_accumulation_steps=3", "gradient_clipping=0.7",
             "optimizer.lr=3e-4", "optimizer.betas=[0.85,0.97]", "optimizer.eps=1e-7", "optimizer.weight_decay=0.05",
             "activation_checkpointing=true"]
PROCPS = re.compile(r"^(?:pgrep|pkill|ps|pidof)$")
"""What the pytorch/pytorch runtime images lack (no procps): the launch scripts must not need it."""
TRAIN_ARGS = ["--max_steps", "500", "--save_steps", "1000", "--seed", "3", "--warmup_ratio", "0"]

CASES = [
    # (id, preset, script kind, signal, loop, DeepSpeed JSON mode)
    ("accelerate-ddp-SIGTERM", "ddp", "accelerate", signal.SIGTERM, "accelerate", "auto"),
    ("torchrun-zero2-SIGUSR1", "zero2", "torchrun", signal.SIGUSR1, "trainer", "resolved"),
    ("deepspeed-zero3-SIGTERM", "zero3", "deepspeed", signal.SIGTERM, "accelerate", "auto"),
]


def _wait_for_first_step(out: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"exit {proc.returncode} before the first step:\n{proc.communicate()[1][-4000:]}"
        assert time.monotonic() < deadline, "no optimizer step in time"
        time.sleep(0.1)


@pytest.mark.parametrize(("preset", "kind", "sig", "loop", "mode"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_signal_to_the_script_checkpoints_and_exits_75(preset, kind, sig, loop, mode, tmp_path):
    root = tmp_path / "generated"
    sets = [arg for item in CPU_2PROC for arg in ("--set", item)]
    assert main(["generate", "--preset", preset, *sets, "--name", "run", "--deepspeed-mode", mode,
                 "--output-dir", str(root)]) == 0
    elsewhere = tmp_path / "elsewhere"  # not where the generated files are: the script finds them itself
    elsewhere.mkdir()
    port = str(free_port())
    env = child_env()
    env.pop("TRAIN_SCRIPT", None)  # the script's default: python -m hf_scale.train
    env.update(
        # this interpreter's accelerate/torchrun/deepspeed first, and no procps
        PATH=path_without(tmp_path / "bin", PROCPS),
        MAIN_PROCESS_PORT=port,
        MASTER_PORT=port,
        TMPDIR=str(tmp_path),
    )
    assert not [tool for tool in ("pgrep", "ps") if shutil.which(tool, path=env["PATH"])]
    script = root / "launch" / f"run.{kind}.sh"
    proc = subprocess.Popen(
        ["bash", str(script), *TRAIN_ARGS, "--loop", loop, "--output_dir", "out"],
        cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    out = elsewhere / "out"  # a relative argument means what it means where the script was started
    try:
        _wait_for_first_step(out, proc)
        proc.send_signal(sig)  # the script's PID only: the script must pass it on
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-4000:]
    assert "hf_scale: stopped by SIGUSR1" in stderr  # the script passes both signals on as SIGUSR1
    saved = store.complete_checkpoints(out)
    assert len(saved) == 1, stderr[-4000:]
    assert 1 <= checkpoint_layout.step_of(saved[0]) < 500
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    assert not list(tmp_path.glob("hf-scale.*"))  # the script's private status directory is gone
    live = assert_live_values(out, root / "hf_scale_configs" / "run.yaml")
    assert live["loop"] == loop and live["batch"]["gradient_accumulation_steps"] == 3
