"""Checkpoints that appear complete or not at all, are verified before a resume, and the stop request that
triggers one.

The layout (names, manifest, what a directory is) belongs to `layout.py`; this module writes,
seals, publishes, rotates and verifies. Both loops write a checkpoint into a temporary directory of
hf_scale's own (`OUTPUT_DIR/.tmp-checkpoint-STEP`; the Trainer writes its own format into
`.tmp-checkpoint-STEP/checkpoint-STEP`), add `hf_scale_state.json` (step, epoch, position in the epoch,
world size, strategy; the manual loop also the model config and tokenizer), flush every file and record
its size and checksum in the manifest `hf_scale_complete.json`, written last, then rename the directory
into place as `OUTPUT_DIR/checkpoint-STEP`. The checksums are computed and verified by all ranks in
parallel (`integrity.py`).

What startup removes: only hf_scale's own temporary directories (`.tmp-checkpoint-*`: an interrupted save
of either loop, a leftover DeepSpeed universal-checkpoint conversion), under the output_dir lock
(`output_lock.py`), so never those of another live run. A `checkpoint-N` without a valid manifest (another
tool's, an older hf_scale's, a damaged one) is never deleted: `--resume_from_checkpoint auto` skips it
and says so, an explicit `--resume_from_checkpoint` refuses it naming the file, and a save of the same
step moves it aside to `checkpoint-N.kept-K`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from hf_scale.errors import UserError
from hf_scale.exit_codes import EXIT_PREEMPTED  # noqa: F401 (checkpoint.EXIT_PREEMPTED: train.py's exit code)
from hf_scale.train.checkpoint import integrity
from hf_scale.train.checkpoint.layout import (
    MANIFEST,
    STATE,
    TMP_PREFIX,
    checkpoint_dir,
    checkpoint_folders,
    complete_checkpoints,
    is_complete,
    manifest_text,
    read_manifest,
    size_problem,
    staging_dir,
    step_of,  # noqa: F401 - still imported from here by tests/generators/test_launch_signals.py
)

_ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
# Small state files every resume loads; a garbage one must stop the resume, not be skipped (accelerate
# ignores an unloadable RNG file) or surface as a traceback.
_STATE_FILES = re.compile(r"^(random_states_\d+\.pkl|rng_state(_\d+)?\.pth|scheduler(_\d+)?\.(bin|pt)|"
                          r"sampler(_\d+)?\.bin|scaler\.pt)$")
_RNG_KEYS = {"random_states_": {"random_state", "numpy_random_seed", "torch_manual_seed"},
             "rng_state": {"python", "numpy", "cpu"}}


def remove_interrupted(output_dir: str | Path) -> list[Path]:
    """Delete hf_scale's own temporary directories (interrupted saves, a universal-checkpoint conversion).

    Main process, while it holds the output_dir lock: no live run can still be writing them. Nothing else
    is ever removed at startup.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir() and not p.is_symlink()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def verify(path: Path, state) -> str | None:
    """The first reason `path` cannot be resumed from, or None. Collective (`state`: PartialState/Accelerator).

    Manifest and sizes (main process), then every recorded checksum (each rank hashes a share), then the
    small state files and `hf_scale_state.json` must load (main process).
    """
    found, entries = None, None
    if state.is_main_process:
        entries, found = read_manifest(path)
        found = found or size_problem(path, entries)
    found, entries = integrity.broadcast(state, (found, entries))
    if found:
        return found
    recorded = {name: entry for name, entry in entries.items() if integrity.HASH_NAME in entry}
    actual = integrity.digests(path, {name: entry["size"] for name, entry in recorded.items()}, state)
    for name in sorted(recorded):
        if actual[name] != recorded[name][integrity.HASH_NAME]:
            return f"{name} is corrupt (its {integrity.HASH_NAME} checksum differs from the one in {MANIFEST})"
    return integrity.broadcast(state, _unloadable(path) if state.is_main_process else None)


def _unloadable(path: Path) -> str | None:
    """The first small state file of `path` that does not load (or lacks what a resume reads), or None."""
    from accelerate.utils import load  # torch.load with the numpy types RNG states hold, weights_only

    for file in sorted(p for p in path.iterdir() if p.is_file()):
        if file.suffix == ".json":
            try:
                json.loads(file.read_text())
            except (ValueError, UnicodeDecodeError) as error:
                return f"{file.name} is not valid JSON ({_first_line(error)})"
        elif _STATE_FILES.match(file.name):
            try:
                loaded = load(file, map_location="cpu")
            except Exception as error:  # noqa: BLE001 - any failure to unpickle is the same fact: garbage
                return f"{file.name} cannot be loaded ({type(error).__name__}: {_first_line(error)})"
            keys = next((k for prefix, k in _RNG_KEYS.items() if file.name.startswith(prefix)), set())
            if not isinstance(loaded, dict) or not keys <= set(loaded):
                return f"{file.name} does not hold the states a resume restores"
    if (path / STATE).is_file():
        try:
            read_state(path)
        except UserError as error:
            return str(error).removeprefix(f"{path}: ")
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def resolve_resume(value: str | None, output_dir: str, state) -> Path | None:
    """`--resume_from_checkpoint`: None, `auto` (the newest checkpoint of output_dir that verifies, or a
    fresh start) or a path, which must verify. Collective; nothing is ever changed in a refused checkpoint."""
    if not value:
        return None
    if value == "auto":
        return _newest_resumable(Path(output_dir), state)
    path = Path(value)
    if not path.is_dir():
        raise UserError(f"--resume_from_checkpoint={value}: no such directory")
    found = verify(path, state)
    if found:
        raise UserError(
            f"--resume_from_checkpoint={value}: {found}; it was left as it is. --resume_from_checkpoint auto "
            "takes the newest intact checkpoint of --output_dir"
        )
    return path


def _newest_resumable(root: Path, state) -> Path | None:
    candidates = None
    if state.is_main_process:  # listed once: every rank then verifies the same directories
        candidates = checkpoint_folders(root)[::-1]
    for path in integrity.broadcast(state, candidates):
        found = verify(path, state)
        if found is None:
            return path
        if state.is_main_process:
            print(f"hf_scale: skipping {path}: {found}; left as it is", file=sys.stderr, flush=True)
    return None


_STATE_FIELDS = {"step": int, "world_size": int, "strategy": str}
_POSITION_FIELDS = {"epoch": int, "samples_consumed_in_epoch": int}


def read_state(path: Path) -> dict:
    """`hf_scale_state.json` of checkpoint `path`, checked; a one-line UserError when it is not usable."""
    file = path / STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no {STATE}; not a checkpoint written by hf_scale") from None
    except (ValueError, UnicodeDecodeError, OSError) as error:
        raise UserError(f"{path}: {STATE} cannot be read ({_first_line(error)})") from None
    fields = dict(_STATE_FIELDS)
    if isinstance(state, dict) and state.get("loop", "accelerate") == "accelerate":
        fields.update(_POSITION_FIELDS)
    bad = [name for name, kind in fields.items()
           if not isinstance(state, dict) or type(state.get(name)) is not kind
           or (kind is int and state[name] < 0)]
    if bad:
        raise UserError(f"{path}: {STATE} lacks a valid {', '.join(bad)}")
    return state


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
        sizes = {str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*"))
                 if f.is_file() and f.name not in (MANIFEST, MANIFEST + ".tmp")}
    sizes = integrity.broadcast(state, sizes)
    digests = integrity.digests(directory, sizes, state, fsync=True)
    if state.is_main_process:
        for sub in [directory, *[d for d in directory.rglob("*") if d.is_dir()]]:
            _fsync_dir(sub)
        files = {name: {"size": size, integrity.HASH_NAME: digests[name]} for name, size in sizes.items()}
        tmp = directory / (MANIFEST + ".tmp")
        tmp.write_text(manifest_text(step, files))
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, directory / MANIFEST)


def write_manifest(path: Path, step: int) -> None:
    """`seal` by this process alone, outside any process group (tools and tests that build a checkpoint)."""
    seal(path, step, _ONE_PROCESS)


def publish(written: Path, output_dir: str | Path, step: int) -> Path:
    """Main process: rename the sealed `written` to `OUTPUT_DIR/checkpoint-STEP` (same filesystem: atomic).

    `written` is `.tmp-checkpoint-STEP` or, for the Trainer, `.tmp-checkpoint-STEP/checkpoint-STEP` (its
    empty parent is removed). A directory already at the final name is replaced when it is a complete
    hf_scale checkpoint (this run's own step, saved again after a resume) and otherwise moved aside intact.
    """
    root = Path(output_dir)
    final = checkpoint_dir(root, step)
    replaced = None
    if final.exists() and is_complete(final):
        replaced = staging_dir(root, f"replaced-{step}")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    elif final.exists() or final.is_symlink():
        kept = next(final.with_name(f"{final.name}.kept-{i}") for i in range(1, 10**6)
                    if not final.with_name(f"{final.name}.kept-{i}").exists())
        os.replace(final, kept)
        print(f"hf_scale: {final} was not a complete hf_scale checkpoint; moved it to {kept} (nothing deleted)",
              file=sys.stderr, flush=True)
    os.replace(written, final)
    if written.parent != root:  # the Trainer's .tmp-checkpoint-STEP/, hf_scale's own
        shutil.rmtree(written.parent, ignore_errors=True)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def rotate(output_dir: str | Path, keep: int | None, protect: str | Path | None = None) -> None:
    """`--save_total_limit`: keep the newest `keep` complete checkpoints (and `protect`, the Trainer's best).
    Only complete hf_scale checkpoints are ever rotated away."""
    if not keep or keep < 1:
        return
    protected = Path(protect).resolve() if protect else None
    for old in complete_checkpoints(output_dir)[:-keep]:
        if old.resolve() != protected:
            shutil.rmtree(old, ignore_errors=True)


def intact_note(output_dir: str | Path) -> str:
    """Which checkpoint a user can go back to, for the messages of a failed save or a diverged run."""
    found = complete_checkpoints(output_dir)
    if found:
        return f"the newest intact checkpoint is {found[-1]} (resume with --resume_from_checkpoint auto)"
    return f"there is no intact checkpoint in {output_dir}"


def write_failure(error: BaseException) -> str | None:
    """`error` described in one line if it is a failure to write a file (full disk, quota, file size limit,
    read-only or failing filesystem), else None. torch.save and safetensors report these in their own types."""
    import torch

    if isinstance(error, (torch.distributed.DistError, MemoryError, torch.OutOfMemoryError)):
        return None
    io_failure = isinstance(error, OSError) or type(error).__name__ == "SafetensorError" or (
        isinstance(error, RuntimeError) and any(k in str(error) for k in ("inline_container", "PytorchStreamWriter")))
    return f"{type(error).__name__}: {_first_line(error)}" if io_failure else None


@contextlib.contextmanager
def write_errors_reported(what: str, output_dir: str | Path):
    """A write failure in the body becomes one line naming the newest intact checkpoint (exit 2 in main).

    Only the rank that failed knows: it exits, and the launcher (torchrun, accelerate, deepspeed) stops the
    others, which may be waiting in a collective of the save.
    """
    try:
        yield
    except Exception as error:
        failure = write_failure(error)
        if failure is None:
            raise
        free = ""
        with contextlib.suppress(OSError):
            free = f"; {shutil.disk_usage(output_dir).free / 2**30:.1f} GiB free on its filesystem"
        raise UserError(f"saving {what} failed ({failure}); {intact_note(output_dir)}{free}") from None


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
                        f"{_first_line(error)}); resume from another checkpoint or start afresh") from None


class StopRequest:
    """SIGTERM / SIGUSR1 (the scheduler's warning before a kill) set a flag; the loops check it after each
    optimizer step, agree across ranks, save a checkpoint and exit with EXIT_PREEMPTED."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        # Only the main thread can take signals. Ray Train runs the training function in a worker thread
        # (hf_scale.ray_train): there Ray itself stops and restarts the workers, and no signal reaches them.
        if threading.current_thread() is not threading.main_thread():
            return
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
