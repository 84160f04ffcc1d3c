"""Checkpoints that appear complete or not at all, and the stop request that triggers one.

Layout: `OUTPUT_DIR/checkpoint-STEP/`. The manual loop writes the state with accelerate's `save_state`
(DeepSpeed's and FSDP's own sharded formats underneath; FSDP2 sharded by hf_scale on CPU goes through
torch's distributed checkpoint) into `OUTPUT_DIR/.tmp-checkpoint-STEP`, adds `hf_scale_state.json`
(step, epoch, position in the epoch, world size, strategy), the model config and tokenizer, flushes
every file, writes the manifest `hf_scale_complete.json` last and renames the directory into place. The
Trainer path keeps the Trainer's own checkpoint format and gets the same manifest once the Trainer has
written everything. A directory without the manifest is incomplete: never resumed from, removed at the
next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

from hf_scale.errors import UserError

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
MANIFEST = "hf_scale_complete.json"
STATE = "hf_scale_state.json"
EXIT_PREEMPTED = 75
"""train.py's exit code after saving a checkpoint on SIGTERM/SIGUSR1 (EX_TEMPFAIL: run again to resume);
the generated SLURM script requeues the job on it."""

_STEP = re.compile(rf"^{PREFIX}(\d+)$")


def step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    """The manifest exists and every file it lists has the recorded size."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and is_complete(p)]
    return sorted(found, key=step_of)


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete interrupted saves (temporary dirs, checkpoint dirs without a valid manifest). Main process."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        interrupted = path.name.startswith(TMP_PREFIX)
        invalid = step_of(path) is not None and not is_complete(path)
        if path.is_dir() and (interrupted or invalid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def resolve_resume(value: str | None, output_dir: str) -> Path | None:
    """`--resume_from_checkpoint`: None, `auto` (newest complete one in output_dir, or a fresh start) or a
    path, which must be a complete checkpoint."""
    if not value:
        return None
    if value == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(value)
    if not path.is_dir():
        raise UserError(f"--resume_from_checkpoint={value}: no such directory")
    if not is_complete(path):
        raise UserError(
            f"--resume_from_checkpoint={value}: incomplete or corrupt checkpoint (no valid {MANIFEST}); "
            f"use --resume_from_checkpoint auto to take the newest complete one in --output_dir"
        )
    return path


def write_state(path: Path, *, step: int, loop: str, world_size: int, expected, args, **position) -> None:
    """`hf_scale_state.json`: what a resume (and `hf-scale export`) needs to know about the run that saved.

    `expected` is the run's `guard.Expected`; `position` the manual loop's place in the data (epoch, samples
    consumed in it), which the Trainer keeps in its own `trainer_state.json`.
    """
    state = {
        "step": step,
        **position,
        "world_size": world_size,
        "strategy": expected.strategy,
        "zero_stage": expected.zero_stage,
        "micro_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "loop": loop,
    }
    (path / STATE).write_text(json.dumps(state, indent=2) + "\n")


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [path, *[d for d in path.rglob("*") if d.is_dir()]]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_manifest(path: Path, step: int) -> None:
    """Flush everything under `path`, then record it. The manifest is written last, itself atomically."""
    _fsync_tree(path)
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path / MANIFEST)


def publish(tmp_dir: Path, step: int) -> Path:
    """Manifest, then rename `.tmp-checkpoint-STEP` to `checkpoint-STEP` (same filesystem: atomic)."""
    write_manifest(tmp_dir, step)
    final = tmp_dir.parent / f"{PREFIX}{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp_dir, final)
    fd = os.open(tmp_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def rotate(output_dir: str | Path, keep: int | None) -> None:
    """`--save_total_limit`: keep the newest `keep` complete checkpoints."""
    if not keep or keep < 1:
        return
    for old in complete_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class StopRequest:
    """SIGTERM / SIGUSR1 (the scheduler's warning before a kill) set a flag; the loops check it after each
    optimizer step, agree across ranks, save a checkpoint and exit with EXIT_PREEMPTED."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agreed(self, accelerator) -> bool:
        """True on every rank when any rank received the signal (a collective: all ranks call it)."""
        import torch

        flag = torch.tensor(1.0 if self.requested else 0.0, device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
