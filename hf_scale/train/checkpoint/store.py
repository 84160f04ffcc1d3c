"""Checkpoints that appear complete or not at all, are verified before a resume, and the stop request that
triggers one.

The layout (names, manifest, what a directory is) belongs to hf_scale.contract.checkpoint_layout, whether a checkpoint
verifies to hf_scale.contract.checkpoint_verification (`hf-scale export` asks it too); this module writes, seals,
publishes, rotates and resolves a resume. Both loops write a checkpoint into a temporary directory of
hf_scale's own (`OUTPUT_DIR/.tmp-checkpoint-STEP/checkpoint-STEP`, the container marked as hf_scale's), add
`hf_scale_state.json` (step, epoch, position in the epoch, world size, strategy; the manual loop also the model
config and tokenizer), flush every file and record its size and checksum in the manifest
`hf_scale_complete.json`, written last, then rename the directory into place as `OUTPUT_DIR/checkpoint-STEP`.
The checksums are computed and verified by all ranks in parallel (`checkpoint_integrity.py`).

What startup removes: only hf_scale's own temporary directories (`.tmp-checkpoint-*` holding its marker: an
interrupted save of either loop, a leftover DeepSpeed universal-checkpoint conversion; or empty: killed before
its marker was written), under the output_dir
lock (`output_lock.py`), so never those of another live run (a user's directory of that name is refused by
ownership.py). A `checkpoint-N` whose content does not verify (another tool's, an older hf_scale's
size-only manifest, a damaged one) is never deleted or replaced: `--resume_from_checkpoint auto` skips it and
says so, an explicit `--resume_from_checkpoint` refuses it naming the file, a save of the same step moves it
aside to `checkpoint-N.kept-K`, and `--save_total_limit` leaves it in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Collection
from pathlib import Path

from hf_scale.contract import checkpoint_integrity
from hf_scale.contract.checkpoint_layout import (
    MANIFEST,
    MARKER,
    STATE,
    TMP_PREFIX,
    checkpoint_dir,
    checkpoint_files,
    complete_checkpoints,
    is_removable_temporary,
    manifest_text,
    staging_dir,
)
from hf_scale.contract.checkpoint_verification import ONE_PROCESS, first_line, newest_verified, verify
from hf_scale.errors import UserError


def make_staging(output_dir: str | Path, label: int | str) -> Path:
    """Main process: a new `OUTPUT_DIR/.tmp-checkpoint-LABEL` holding hf_scale's marker, so that an interrupted
    one is known as hf_scale's and removed at the next start (a user's directory of that name never is)."""
    path = staging_dir(output_dir, label)
    if is_removable_temporary(path):
        shutil.rmtree(path)
    path.mkdir(parents=True)  # a user's directory of that name: refused at startup, never written into
    (path / MARKER).write_text("a temporary directory of hf_scale's, removed at the start of the next run\n")
    return path


def temporary_dirs(output_dir: str | Path) -> list[Path]:
    """Every `.tmp-checkpoint-*` entry of `output_dir`, hf_scale's or not."""
    root = Path(output_dir)
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)) if root.is_dir() else []


def remove_interrupted(output_dir: str | Path, *, foreign_too: bool = False) -> list[Path]:
    """Delete hf_scale's own temporary directories (interrupted saves, a universal-checkpoint conversion); with
    `foreign_too` (--overwrite_output_dir) also the user's directories of those names.

    Main process, while it holds the output_dir lock: no live run can still be writing them. Nothing else
    is ever removed at startup.
    """
    removed = [p for p in temporary_dirs(output_dir)
               if is_removable_temporary(p) or (foreign_too and p.is_dir() and not p.is_symlink())]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def check_resume_path(value: str | None) -> None:
    """An explicit `--resume_from_checkpoint PATH` must be a directory (UserError, one line): decidable from the flag
    alone, before a process group (train.py's prepare stage) or a cluster (the Ray driver) starts."""
    if value and value != "auto" and not Path(value).is_dir():
        raise UserError(f"--resume_from_checkpoint={value}: no such directory")


def resolve_resume(value: str | None, output_dir: str, state) -> Path | None:
    """`--resume_from_checkpoint`: None, `auto` (the newest checkpoint of output_dir that verifies, or a
    fresh start) or a path, which must verify. Collective; nothing is ever changed in a refused checkpoint."""
    if not value:
        return None
    if value == "auto":
        return _newest_resumable(Path(output_dir), state)
    check_resume_path(value)
    path = Path(value)
    found = verify(path, state)
    if found:
        raise UserError(
            f"--resume_from_checkpoint={value}: {found}; it was left as it is. --resume_from_checkpoint auto "
            "takes the newest intact checkpoint of --output_dir"
        )
    return path


def _newest_resumable(root: Path, state) -> Path | None:
    found, skipped = newest_verified(root, state)
    if state.is_main_process:
        for path, problem in skipped:
            print(f"hf_scale: skipping {path}: {problem}; left as it is", file=sys.stderr, flush=True)
    return found


def write_state(path: Path, *, step: int, spec, **position) -> None:
    """`hf_scale_state.json`: what a resume (and `hf-scale export`) needs to know about the run that saved.

    Every fact of the run comes from its one `RunSpec` (hf_scale.train.setup.run_spec); `position` is the manual loop's
    place in the data (epoch, samples consumed in it), which the Trainer keeps in its own `trainer_state.json`.
    """
    state = {
        "step": step,
        **position,
        "world_size": spec.world_size,
        "strategy": spec.strategy,
        "zero_stage": spec.zero_stage,
        "micro_batch_size": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "global_batch_size": spec.global_batch_size,
        "precision": spec.precision,
        "seed": spec.seed,
        "data_seed": spec.data_seed,
        "loop": spec.loop,
        # ep is no mesh factor (it splits dp_shard x tp), but a resume must know how the experts were split.
        "parallelism": {**spec.layout.sizes(), "ep": spec.layout.ep},
        "quantization": spec.quantization,
    }
    (path / STATE).write_text(json.dumps(state, indent=2) + "\n")


def write_model_files(path: Path, model, tokenizer) -> None:
    """What `hf-scale export` rebuilds a Hub directory from beside the shards: the model's config (and
    generation config), the tokenizer and, for LoRA, the adapter config. `model` is the unwrapped model."""
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if getattr(model, "peft_config", None):
        model.peft_config[model.active_adapter].save_pretrained(path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(directory: Path, step: int, state) -> None:
    """Flush every file under `directory` and record its size and checksum in the manifest, written last and
    atomically. Collective: each rank flushes and hashes a share of the files; the main process writes."""
    sizes = None
    if state.is_main_process:
        sizes = {name: (directory / name).stat().st_size for name in checkpoint_files(directory)}
    sizes = checkpoint_integrity.broadcast(state, sizes)
    digests = checkpoint_integrity.digests(directory, sizes, state, fsync=True)
    if state.is_main_process:
        for sub in [directory, *[d for d in directory.rglob("*") if d.is_dir()]]:
            _fsync_dir(sub)
        files = {name: {"size": size, checkpoint_integrity.HASH_NAME: digests[name]} for name, size in sizes.items()}
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(manifest_text(step, files))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, directory / MANIFEST)


def write_manifest(path: Path, step: int) -> None:
    """`seal` by this process alone, outside any process group (tools and tests that build a checkpoint)."""
    seal(path, step, ONE_PROCESS)


class Publisher:
    """Puts one run's sealed checkpoints in place and rotates old ones away (`--save_total_limit`). Collective
    calls. Only what verifies (every checksum; or what this run wrote or resumed from itself) is ever replaced
    or deleted: a damaged checkpoint, another tool's, one with a size-only manifest is moved aside when its step
    is saved again, and left in place by the rotation."""

    def __init__(self, output_dir: str | Path, state):
        self.root = Path(output_dir)
        self.state = state
        self.verified: set[Path] = set()
        """Checkpoints whose content this run verified or wrote itself (resolved paths; the same on every rank)."""
        self.kept: set[Path] = set()
        """Checkpoints the rotation found damaged and left in place (said once)."""

    def _problem(self, path: Path) -> str | None:
        """Why `path` is not a checkpoint of verified content, or None. Collective."""
        if path.resolve() in self.verified:
            return None
        present = checkpoint_integrity.broadcast(self.state, path.is_dir() and not path.is_symlink()
                                      if self.state.is_main_process else None)
        found = verify(path, self.state) if present else "not a directory"
        if found is None:
            self.verified.add(path.resolve())
        return found

    def publish(self, written: Path, step: int) -> Path:
        """Rename the sealed `written` (`.tmp-checkpoint-STEP/checkpoint-STEP`) to `OUTPUT_DIR/checkpoint-STEP`
        (same filesystem: atomic) and remove its container. A directory already at the final name is replaced
        when its content verifies (this run's own step saved again after a resume) and otherwise moved aside
        intact."""
        final = checkpoint_dir(self.root, step)
        exists = checkpoint_integrity.broadcast(self.state, (final.exists() or final.is_symlink())
                                     if self.state.is_main_process else None)
        problem = self._problem(final) if exists else None
        if self.state.is_main_process:
            _publish(written, self.root, final, step, problem)
        self.verified.add(final.resolve())  # sealed from the digests of the bytes this run wrote
        return final

    def rotate(self, keep: int | None, protect: str | Path | None = None) -> None:
        """`--save_total_limit`: keep the newest `keep` complete checkpoints (and `protect`, the Trainer's best);
        an older one is deleted only when its content verifies."""
        if keep and keep >= 1:
            self._remove_older(keep, protect)

    def keep_only_best(self, best: str | Path) -> None:
        """The Trainer's end of training under `--save_total_limit 1 --load_best_model_at_end`: every checkpoint
        but the best goes (transformers' `_finalize_training`), the newest too; again only what verifies, so a
        foreign `checkpoint-N`, a damaged one and a `.kept-K` stay."""
        self._remove_older(0, best)

    def _remove_older(self, keep: int, protect: str | Path | None) -> None:
        old = None
        if self.state.is_main_process:
            protected = Path(protect).resolve() if protect else None
            complete = complete_checkpoints(self.root)
            old = [p for p in complete[:len(complete) - keep] if p.resolve() != protected]
        old = checkpoint_integrity.broadcast(self.state, old)
        for path in old:
            if path.resolve() in self.kept:
                continue
            found = self._problem(path)  # the same on every rank
            if found is not None:
                self.kept.add(path.resolve())
            if self.state.is_main_process and found is None:
                shutil.rmtree(path, ignore_errors=True)
            elif self.state.is_main_process:
                print(f"hf_scale: {path} is left in place beyond --save_total_limit: {found}", file=sys.stderr,
                      flush=True)


def _publish(written: Path, root: Path, final: Path, step: int, problem: str | None) -> None:
    """Main process: `publish`'s renames. `problem`: why the directory at `final` does not verify (None when it
    does, or when there is none)."""
    replaced = None
    if final.exists() or final.is_symlink():
        if problem is None:
            replaced = make_staging(root, f"replaced-{step}")
            os.replace(final, replaced / final.name)
        else:
            kept = next(final.with_name(f"{final.name}.kept-{i}") for i in range(1, 10**6)
                        if not final.with_name(f"{final.name}.kept-{i}").exists())
            os.replace(final, kept)
            print(f"hf_scale: {final} is not a checkpoint of verified content ({problem}); moved it to {kept} "
                  "(nothing deleted)", file=sys.stderr, flush=True)
    os.replace(written, final)
    if written.parent != root:  # hf_scale's own .tmp-checkpoint-STEP/
        shutil.rmtree(written.parent, ignore_errors=True)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def intact_note(output_dir: str | Path, trusted: Collection[Path] = frozenset()) -> str:
    """Which checkpoint a user can go back to, for the messages of a failed save or a diverged run: the newest
    whose content verifies (`newest_verified`; `trusted`, the run's Publisher's `verified`, is not read again)."""
    found, _ = newest_verified(output_dir, trusted=trusted)
    if found:
        return f"the newest intact checkpoint is {found} (resume with --resume_from_checkpoint auto)"
    return f"there is no intact checkpoint (of verified content) in {output_dir}"


def write_failure(error: BaseException) -> str | None:
    """`error` described in one line if it is a failure to write a file (full disk, quota, file size limit,
    read-only or failing filesystem), else None. torch.save and safetensors report these in their own types."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        # A sharded (torch.distributed.checkpoint) save gathers every rank's failure and raises them all on every
        # rank, as a BaseException: the lowest failing rank's write failure, so every rank says the same line.
        for rank, (failed, _) in sorted(error.failures.items()):
            if (line := write_failure(failed)) is not None:
                return f"rank {rank}: {line}"
        return None
    if isinstance(error, (torch.distributed.DistError, MemoryError, torch.OutOfMemoryError)):
        return None
    io_failure = isinstance(error, OSError) or type(error).__name__ == "SafetensorError" or (
        isinstance(error, RuntimeError) and any(k in str(error) for k in ("inline_container", "PytorchStreamWriter")))
    return f"{type(error).__name__}: {first_line(error)}" if io_failure else None


@contextlib.contextmanager
def write_errors_reported(what: str, output_dir: str | Path, trusted: Collection[Path] = frozenset()):
    """A write failure in the body becomes one line naming the newest intact checkpoint (exit 2 in main;
    `trusted`: as for `intact_note`).

    Only the rank that failed knows: it exits, and the launcher (torchrun, accelerate, deepspeed) stops the
    others, which may be waiting in a collective of the save.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as error:
        failure = write_failure(error)
        if failure is None:
            raise
        free = ""
        with contextlib.suppress(OSError):
            free = f"; {shutil.disk_usage(output_dir).free / 2**30:.1f} GiB free on its filesystem"
        raise UserError(f"saving {what} failed ({failure}); {intact_note(output_dir, trusted)}{free}") from None


@contextlib.contextmanager
def load_errors_reported(path: Path):
    """A checkpoint that verified but does not load (the engine rejects a state, a sealed garbage file) is one
    line naming it, not a traceback. Collective errors and running out of memory are not the checkpoint's."""
    import torch

    try:
        yield
    except UserError:
        raise
    except Exception as error:
        if isinstance(error, (torch.distributed.DistError, MemoryError, torch.OutOfMemoryError)):
            raise
        raise UserError(f"--resume_from_checkpoint={path}: loading it failed ({type(error).__name__}: "
                        f"{first_line(error)}); resume from another checkpoint or start afresh") from None


class StopRequest:
    """SIGTERM / SIGUSR1 (the scheduler's warning before a kill) set a flag; the loops check it after each
    optimizer step, agree across ranks, save a checkpoint and exit with EXIT_PREEMPTED."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        # Only the main thread can take signals. Ray Train runs the training function in a worker thread
        # (hf_scale.commands.ray_train): there Ray itself stops and restarts the workers, and no signal reaches them.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name  # the first one says why it stopped

    def request(self, reason: str) -> None:
        """A stop this process decided itself (launcher_watch: its launcher died), taken as a signal would be."""
        self.signal_name = self.signal_name or reason

    def settle(self) -> None:
        """The checkpoint is saved and the process is ending: a repeated stop signal must change nothing (exit 75).
        Ignored, not handled: while the interpreter finalizes it puts every Python handler back to the default
        action, and a second SIGTERM a second after the first would then kill the process (-15, not 75)."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agreed(self, accelerator) -> bool:
        """True on every rank when any rank received the signal (a collective: all ranks call it)."""
        import torch

        flag = torch.tensor(1.0 if self.requested else 0.0, device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
