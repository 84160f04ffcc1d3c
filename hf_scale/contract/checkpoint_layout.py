"""hf_scale's checkpoint layout on disk: every name, the manifest, and `detect_layout(path)`.

The one place that knows what a directory written by train.py looks like. The loops' savers, the resume
logic (`store.py`, `reshard.py`), `hf-scale export` and the tests ask this module; nothing else spells
a file name of the layout. Reading only: no torch, no process group, nothing written (`store.py`
writes, seals and publishes).

    OUTPUT_DIR/                              a run directory
      checkpoint-STEP/                       one complete checkpoint (renamed into place when sealed)
        hf_scale_complete.json               the manifest: every file's size and checksum, written last
        hf_scale_state.json                  step, position in the data, the run spec (world, batch, precision)
        config.json, tokenizer files         what `hf-scale export` rebuilds a Hub directory from
        model.safetensors, optimizer.*       full states (DDP / one process), or
        pytorch_model/ + latest              DeepSpeed ZeRO partitions under accelerate's tag, or
        global_stepN/ + latest               the Trainer's DeepSpeed tag, or
        fsdp_sharded/.metadata               FSDP2 shards (torch.distributed.checkpoint) on CPU
        pytorch_model_fsdp_0/.metadata       FSDP shards through accelerate's plugin (GPUs), or
        pytorch_model_fsdp.bin               its FULL_STATE_DICT
        trainer_state.json                   the Trainer's checkpoints only
      .tmp-checkpoint-STEP/                  a save in progress (removed at the next start if interrupted)
        .written-by-hf_scale                 its marker: only a temporary directory holding it (or empty) is removed
        checkpoint-STEP/                     the checkpoint being written, renamed into place when sealed
      .hf_scale.lock                         held while a run writes the directory (output_lock.py)
      .written-by-hf_scale                   written before a run's first file: what hf_scale wrote, it may replace
      config.json, model.safetensors         the final model, from_pretrained-ready (the exported model's files)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hf_scale.contract.checkpoint_integrity import HASH_NAME  # the checksum recorded per file in the manifest

PREFIX = "checkpoint-"
"""`OUTPUT_DIR/checkpoint-STEP`: the Trainer's own name (transformers' PREFIX_CHECKPOINT_DIR), used by both loops."""
TMP_PREFIX = ".tmp-checkpoint-"
"""hf_scale's temporary directories (a save in progress, a universal-checkpoint conversion); only these are
ever removed at startup."""
LOCK_FILE = ".hf_scale.lock"
"""`OUTPUT_DIR/.hf_scale.lock`: one run writes a directory at a time (output_lock.py holds it)."""
LIVE_FILE = "hf_scale_live.json"
"""OUTPUT_DIR's live values of the run (hf_scale.train.loops.live writes it after the first steps)."""

MARKER = ".written-by-hf_scale"
"""In each directory hf_scale creates and may remove (its `.tmp-checkpoint-*`) and in an OUTPUT_DIR whose files it
may replace (its final model): a directory without it is the user's, never removed, its files never replaced
(ownership.py)."""
TRAINING_STATE_GLOBS = (f"{PREFIX}*", ".tmp-*", "*.lock", MARKER)
"""What of a run directory is training state, never the model, so `--push_to_hub` uploads none of it (the Hub's
`ignore_patterns`): the checkpoints (also one moved aside, `checkpoint-STEP.kept-K`), every temporary of
hf_scale's (`.tmp-checkpoint-*` saves, `hf-scale export`'s `.tmp-export-*`), the lock and the marker."""
MANIFEST = "hf_scale_complete.json"
STATE = "hf_scale_state.json"
DEEPSPEED_TAG = "pytorch_model"
"""accelerate's DeepSpeed checkpoint tag (the sub-directory holding the engine's files; accelerate's MODEL_NAME)."""
DEEPSPEED_LATEST = "latest"
"""DeepSpeed's file naming the tag of the newest save (accelerate's `pytorch_model`, the Trainer's `global_stepN`)."""
DCP_DIR = "fsdp_sharded"
"""Where a checkpoint keeps the FSDP2 model and optimizer shards (torch.distributed.checkpoint format), written
by hf_scale itself when it shards on CPU (`fsdp.shard_on_cpu`)."""
ACCELERATE_FSDP_PREFIX = "pytorch_model_fsdp"
"""accelerate's own FSDP model files (`pytorch_model_fsdp_0/` shards, `pytorch_model_fsdp.bin`): FSDP through
accelerate's plugin (GPUs)."""
ACCELERATE_FSDP_SHARDED = f"{ACCELERATE_FSDP_PREFIX}_0"
"""accelerate's SHARDED_STATE_DICT of the first model: a torch.distributed.checkpoint folder of {"model": state}
(accelerate.utils.fsdp_utils.save_fsdp_model, FSDP1 and FSDP2)."""
ACCELERATE_FSDP_FULL = f"{ACCELERATE_FSDP_PREFIX}.bin"
"""accelerate's FULL_STATE_DICT of the first model: the whole state dict, torch.save'd by rank 0."""
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# What detect_layout says a directory is.
CHECKPOINT = "checkpoint"
INCOMPLETE = "incomplete"
RUN_DIR = "run directory"
HF_MODEL = "saved Hugging Face model"
UNKNOWN = "unknown"

# Where a complete checkpoint keeps its model weights.
FULL = "full"
DEEPSPEED = "deepspeed"
FSDP_DCP = "fsdp2-dcp"
ACCELERATE_FSDP = "accelerate-fsdp"
ADAPTER_ONLY = "adapter-only"

_STEP = re.compile(rf"^{PREFIX}(\d+)$")


# --- names -------------------------------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step}"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / checkpoint_name(step)


def staging_dir(output_dir: str | Path, label: int | str) -> Path:
    """`OUTPUT_DIR/.tmp-checkpoint-LABEL`: a save of step LABEL in progress, or another temporary of hf_scale's
    (`universal-STEP`, `replaced-STEP`)."""
    return Path(output_dir) / f"{TMP_PREFIX}{label}"


def is_ours(directory: Path) -> bool:
    """`directory` holds hf_scale's MARKER (and is no link to somewhere else)."""
    return not directory.is_symlink() and (directory / MARKER).is_file()


def is_removable_temporary(directory: Path) -> bool:
    """A `.tmp-checkpoint-*` startup may remove: hf_scale's (its MARKER), or an empty directory. A save killed
    between creating its directory and writing the marker leaves the empty one, and removing it loses nothing."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    return is_ours(directory) or next(directory.iterdir(), None) is None


def step_of(path: Path) -> int | None:
    """STEP of a `checkpoint-STEP` directory name, else None."""
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


# --- the manifest ------------------------------------------------------------------------------------------


def manifest_text(step: int, files: dict[str, dict]) -> str:
    """The manifest's content: {"step", "files": {relative name: {"size", HASH_NAME}}}."""
    return json.dumps({"step": step, "files": files}, indent=1) + "\n"


def read_manifest(path: Path) -> tuple[dict[str, dict] | None, str | None]:
    """({file: {"size"[, HASH_NAME]}}, None) for checkpoint `path`, or (None, what is wrong, in one line)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, f"no {MANIFEST} (an interrupted save, or not written by hf_scale)"
    try:
        data = json.loads(manifest.read_text())
    except (ValueError, UnicodeDecodeError):
        return None, f"{MANIFEST} is unreadable (not a manifest written by hf_scale)"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None, f"{MANIFEST} is unreadable (not a manifest written by hf_scale: no 'files' mapping)"
    entries = {name: _entry(value) for name, value in files.items()}
    bad = next((name for name, entry in entries.items() if entry is None or not _inside(name)), None)
    if bad is not None:
        return None, f"{MANIFEST} is unreadable (not a manifest written by hf_scale: bad entry {bad[:100]!r})"
    return entries, None


def _entry(value) -> dict | None:
    """A manifest's record of one file, or None when it is not one. Manifests written before checksums
    existed record sizes only."""
    if type(value) is int:
        return {"size": value}
    if isinstance(value, dict) and type(value.get("size")) is int and isinstance(value.get(HASH_NAME), str):
        return {"size": value["size"], HASH_NAME: value[HASH_NAME]}
    return None


def _inside(name: str) -> bool:
    parts = PurePosixPath(name)
    return bool(name) and not parts.is_absolute() and ".." not in parts.parts


def files_problem(path: Path, entries: dict[str, dict]) -> str | None:
    """The first file the manifest lists that is missing or has another size, or the first file of the checkpoint
    it does not list, or None. `seal` lists every file, so one left out was added or edited out afterwards: its
    content is vouched for by nothing (a damaged weights file would load unchecked), and the checkpoint is not
    intact."""
    for name, entry in sorted(entries.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing (listed in {MANIFEST})"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, {MANIFEST} records {entry['size']}"
    unlisted = next((name for name in checkpoint_files(path) if name not in entries), None)
    if unlisted is not None:
        return f"{unlisted} is not listed in {MANIFEST}: nothing vouches for its content"
    return None


def checkpoint_files(path: Path) -> list[str]:
    """Every file under checkpoint `path` (relative POSIX names, sorted) but its manifest: what `seal` records."""
    return sorted(f.relative_to(path).as_posix() for f in path.rglob("*")
                  if f.is_file() and f.name not in (MANIFEST, MANIFEST + ".tmp"))


def problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (manifest, file sizes, no file left out of it; cheap), or None."""
    entries, found = read_manifest(path)
    return found or files_problem(path, entries)


def is_complete(path: Path) -> bool:
    """The manifest exists, every file it lists has the recorded size and it lists every file."""
    return problem(path) is None


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-STEP` directory of `output_dir` (complete or not), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of `output_dir`, oldest first."""
    return [p for p in checkpoint_folders(output_dir) if is_complete(p)]


# --- what a directory is -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """What `detect_layout` found at `path`.

    kind: CHECKPOINT (complete), INCOMPLETE (`problem` says what is missing; `newest` is the newest complete
    sibling), RUN_DIR (an OUTPUT_DIR: `checkpoints` all its checkpoint-STEP folders, `newest` the newest
    complete one or None; `final_model` when the run's final model is saved in it too), HF_MODEL, UNKNOWN.
    weights (checkpoints): FULL, DEEPSPEED (with `deepspeed_tag`), FSDP_DCP, ACCELERATE_FSDP, ADAPTER_ONLY
    or None; loop: "accelerate", "trainer" or None when it cannot be told.
    """

    kind: str
    path: Path
    weights: str | None = None
    deepspeed_tag: str | None = None
    loop: str | None = None
    problem: str | None = None
    newest: Path | None = None
    checkpoints: tuple[Path, ...] = ()
    final_model: bool = False

    def describe(self) -> str:
        """One line for messages: what `path` is."""
        if self.kind == CHECKPOINT:
            tag = f" (tag {self.deepspeed_tag})" if self.deepspeed_tag else ""
            loop = f" of the {self.loop} loop" if self.loop else ""
            return f"a complete checkpoint{loop}, weights: {self.weights or 'none found'}{tag}"
        if self.kind == INCOMPLETE:
            return f"an incomplete checkpoint: {self.problem}"
        if self.kind == RUN_DIR:
            newest = self.newest.name if self.newest else "none"
            return f"a run directory with {len(self.checkpoints)} checkpoint(s), newest complete: {newest}"
        return "a saved Hugging Face model" if self.kind == HF_MODEL else f"not an hf_scale directory ({self.problem})"


def detect_layout(path: str | Path) -> Layout:
    """What `path` is, from the files train.py writes (cheap: manifest and sizes, no checksums).

    A directory named checkpoint-STEP or holding a manifest is a checkpoint (complete or not); one holding
    checkpoint-STEP folders is a run directory; one with config.json and safetensors a saved model.
    OSError from reading (permissions, a failing disk) is the caller's to report.
    """
    path = Path(path)
    if not path.is_dir():
        return Layout(UNKNOWN, path, problem="not a directory" if path.exists() else "no such directory")
    if step_of(path) is not None or (path / MANIFEST).exists():
        return _checkpoint_layout(path)
    folders = checkpoint_folders(path)
    final_model = _is_saved_model(path)
    if folders:
        complete = [p for p in folders if is_complete(p)]
        return Layout(RUN_DIR, path, checkpoints=tuple(folders), newest=complete[-1] if complete else None,
                      final_model=final_model)
    if final_model:
        return Layout(HF_MODEL, path)
    return Layout(UNKNOWN, path, problem=f"no {MANIFEST}, no {PREFIX}STEP folders, no saved model")


def _checkpoint_layout(path: Path) -> Layout:
    weights, tag = _weights(path)
    found = problem(path)
    if found:
        siblings = complete_checkpoints(path.parent) if step_of(path) is not None else []
        return Layout(INCOMPLETE, path, weights=weights, deepspeed_tag=tag, loop=_loop(path), problem=found,
                      newest=siblings[-1] if siblings else None)
    return Layout(CHECKPOINT, path, weights=weights, deepspeed_tag=tag, loop=_loop(path))


def _weights(path: Path) -> tuple[str | None, str | None]:
    """Where the model weights of checkpoint `path` are: (kind, DeepSpeed tag)."""
    if (path / DCP_DIR / ".metadata").is_file():
        return FSDP_DCP, None
    if (path / DEEPSPEED_LATEST).is_file():
        with open(path / DEEPSPEED_LATEST, "rb") as handle:  # a tag name: a few bytes
            tag = handle.read(4096).decode("utf-8", errors="replace").strip()
        return DEEPSPEED, tag or None
    if (path / MODEL_WEIGHTS).is_file():
        return FULL, None
    if any(p.name.startswith(ACCELERATE_FSDP_PREFIX) for p in path.iterdir()):
        return ACCELERATE_FSDP, None
    if (path / ADAPTER_WEIGHTS).is_file():
        return ADAPTER_ONLY, None
    return None, None


def _loop(path: Path) -> str | None:
    """The loop that wrote checkpoint `path`: recorded in its state file, else told by the Trainer's own file."""
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        state = None
    if isinstance(state, dict) and state.get("loop") in ("accelerate", "trainer"):
        return state["loop"]
    if (path / TRAINER_STATE).is_file():
        return "trainer"
    return "accelerate" if isinstance(state, dict) else None


def _is_saved_model(path: Path) -> bool:
    return (path / MODEL_CONFIG).is_file() and any(path.glob("*.safetensors"))
