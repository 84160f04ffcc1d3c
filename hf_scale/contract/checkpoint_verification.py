"""Whether a checkpoint can be resumed from (and exported): its manifest, every file's checksum, its small state
files and `hf_scale_state.json`. One rule for train.py's resume (hf_scale.train.checkpoint.store), its final
checkpoint's proof and `hf-scale export`, which reads it without the runtime. The checksums are
checkpoint_integrity's, the layout checkpoint_layout's."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from pathlib import Path
from types import SimpleNamespace

from hf_scale.contract import checkpoint_integrity
from hf_scale.contract.checkpoint_layout import MANIFEST, STATE, checkpoint_folders, files_problem, read_manifest
from hf_scale.errors import UserError

ONE_PROCESS = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True)
"""The `state` of a process that verifies alone (no process group): `hf-scale export`, a test."""
# Small state files every resume loads; a garbage one must stop the resume, not be skipped (accelerate
# ignores an unloadable RNG file) or surface as a traceback.
_STATE_FILES = re.compile(r"^(random_states_\d+\.pkl|rng_state(_\d+)?\.pth|scheduler(_\d+)?\.(bin|pt)|"
                          r"sampler(_\d+)?\.bin|scaler\.pt)$")
_RNG_KEYS = {"random_states_": {"random_state", "numpy_random_seed", "torch_manual_seed"},
             "rng_state": {"python", "numpy", "cpu"}}



def verify(path: Path, state=ONE_PROCESS) -> str | None:
    """The first reason `path` cannot be resumed from, or None: None means verified content. Collective
    (`state`: PartialState/Accelerator; by this process alone by default).

    Manifest and sizes (main process), then every file's checksum (each rank hashes a share; a manifest without
    checksums does not verify), then the small state files and `hf_scale_state.json` must load (main process).
    """
    found, entries = None, None
    if state.is_main_process:
        entries, found = read_manifest(path)
        found = found or files_problem(path, entries)
    found, entries = checkpoint_integrity.broadcast(state, (found, entries))
    if found:
        return found
    unsummed = sorted(name for name, entry in entries.items() if checkpoint_integrity.HASH_NAME not in entry)
    if unsummed:  # an older hf_scale's manifest, or one edited to that form: sizes prove nothing about content
        return (f"{MANIFEST} records no {checkpoint_integrity.HASH_NAME} checksum for {unsummed[0]} "
                "(a size-only manifest); its content cannot be verified")
    actual = checkpoint_integrity.digests(path, {name: entry["size"] for name, entry in entries.items()}, state)
    for name in sorted(entries):
        if actual[name] != entries[name][checkpoint_integrity.HASH_NAME]:
            return (f"{name} is corrupt (its {checkpoint_integrity.HASH_NAME} checksum differs from the one in "
                    f"{MANIFEST})")
    return checkpoint_integrity.broadcast(state, _unloadable(path) if state.is_main_process else None)


def _unloadable(path: Path) -> str | None:
    """The first small state file of `path` that does not load (or lacks what a resume reads), or None."""
    from accelerate.utils import load  # torch.load with the numpy types RNG states hold, weights_only

    for file in sorted(p for p in path.iterdir() if p.is_file()):
        if file.suffix == ".json":
            try:
                json.loads(file.read_text())
            except (ValueError, UnicodeDecodeError) as error:
                return f"{file.name} is not valid JSON ({first_line(error)})"
        elif _STATE_FILES.match(file.name):
            try:
                loaded = load(file, map_location="cpu")
            except Exception as error:  # noqa: BLE001 - any failure to unpickle is the same fact: garbage
                return f"{file.name} cannot be loaded ({type(error).__name__}: {first_line(error)})"
            keys = next((k for prefix, k in _RNG_KEYS.items() if file.name.startswith(prefix)), set())
            if not isinstance(loaded, dict) or not keys <= set(loaded):
                return f"{file.name} does not hold the states a resume restores"
    if (path / STATE).is_file():
        try:
            read_state(path)
        except UserError as error:
            return str(error).removeprefix(f"{path}: ")
    return None


def first_line(error: BaseException) -> str:
    """The first line of an error's message, at most 200 characters: what a one-line refusal quotes."""
    return (str(error).strip().splitlines() or [""])[0][:200]



def newest_verified(output_dir: str | Path, state=ONE_PROCESS, *, trusted: Collection[Path] = frozenset()
                    ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest `checkpoint-STEP` of `output_dir` whose content verifies (`verify`), and the newer ones skipped
    with why: what `--resume_from_checkpoint auto` resumes, a failure message names and `hf-scale export
    OUTPUT_DIR` exports. `trusted`: checkpoints this run wrote or verified itself (a Publisher's `verified`), not
    read again. Collective with a process group's `state`; by this process alone by default.

    Cost: every file of each checkpoint tried is read (a 70B checkpoint is ~1 TB: with one process, the disk's
    read bandwidth sets the time; a run's ranks share it); the newest is usually the one taken."""
    candidates = None
    if state.is_main_process:  # listed once: every rank then verifies the same directories
        candidates = checkpoint_folders(output_dir)[::-1]
    skipped = []
    for path in checkpoint_integrity.broadcast(state, candidates):
        found = None if path.resolve() in trusted else verify(path, state)
        if found is None:
            return path, skipped
        skipped.append((path, found))
    return None, skipped


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
        raise UserError(f"{path}: {STATE} cannot be read ({first_line(error)})") from None
    fields = dict(_STATE_FIELDS)
    if isinstance(state, dict) and state.get("loop", "accelerate") == "accelerate":
        fields.update(_POSITION_FIELDS)
    bad = [name for name, kind in fields.items()
           if not isinstance(state, dict) or type(state.get(name)) is not kind
           or (kind is int and state[name] < 0)]
    if bad:
        raise UserError(f"{path}: {STATE} lacks a valid {', '.join(bad)}")
    return state
