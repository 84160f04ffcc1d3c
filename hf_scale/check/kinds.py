"""`hf-scale check FILE...`: which kind of file each one is, told by its content (names and extensions vary:
`zero3.yaml` may be accelerate's or hf_scale's, `ds.json` may be named anything).

- an accelerate config: a mapping with `distributed_type` or `compute_environment` (what `accelerate config`
  writes first; accelerate's loader needs them);
- a DeepSpeed config: a mapping with a top-level key DeepSpeed's own parser reads (asked from DeepSpeedConfig);
- an hf_scale config: a mapping whose keys are all DistributedConfig fields, one of them not a DeepSpeed key;
- a job manifest (`--manifest`): a kind of the clusters registry (hf_scale.clusters.MANIFEST_KINDS, read by
  hf_scale.check.cluster.manifest_kind).

A train.py recipe (a mapping whose keys are all train.py flags, as `hf-scale generate --recipe` writes) is none of
these, though `bf16` and `gradient_accumulation_steps` are DeepSpeed keys too: it is told apart, and refused in one
line that says how check reads it (as training args, after `--`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_scale.clusters import manifest_kinds_text
from hf_scale.errors import UserError
from hf_scale.files.reading import load_json, load_yaml_documents, read_text

ACCELERATE, DEEPSPEED, HF_SCALE, MANIFEST = "accelerate config", "DeepSpeed config", "hf_scale config", "job manifest"
RECIPE = "train.py recipe"
"""Recognized only to be refused with the way to check it (training args)."""
ACCELERATE_MARKS = ("distributed_type", "compute_environment")

WHAT_EACH_LOOKS_LIKE = (
    f"an {ACCELERATE} (YAML with {' or '.join(ACCELERATE_MARKS)}), a {DEEPSPEED} (JSON with zero_optimization, "
    f"train_batch_size, train_micro_batch_size_per_gpu, fp16/bf16, optimizer, ...) or an {HF_SCALE} (YAML with "
    f"strategy, precision, topology, batch, deepspeed, fsdp, ...), or a job manifest ({manifest_kinds_text()})"
)


@functools.cache
def deepspeed_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed's config parser reads, recorded while it parses a minimal config."""
    from hf_scale.knowledge.library_tables import ReadTracker, deepspeed_off_stdout

    with deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig

        # The optional blocks are read only when present (DeepSpeed tests `key in param_dict.keys()` first).
        tracked = ReadTracker({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {}},
                               "scheduler": {"type": "WarmupLR", "params": {}}, "autotuning": {"enabled": False},
                               "flops_profiler": {}, "activation_checkpointing": {}, "aio": {}})
        DeepSpeedConfig(tracked)
    return frozenset(key for key in tracked.read if isinstance(key, str))


@functools.cache
def train_flag_names() -> frozenset[str]:
    """The keys a train.py recipe may hold: every flag's name (argparse's dest) in train.py's parser, read from the
    snapshot its --help is rendered from (hf_scale.contract.help_snapshot, kept equal to the live parser by its
    test; building the live parser would load transformers), and the recipe's `env:` mapping."""
    import json

    from hf_scale.contract.help_snapshot import HELP_FLAGS, SNAPSHOT
    from hf_scale.contract.recipe import CONFIG_FLAG, ENV_KEY

    actions = json.loads(SNAPSHOT.read_text())["actions"]
    names = {a["dest"] for a in actions if isinstance(a, dict) and not set(a["option_strings"]) & set(HELP_FLAGS)}
    return frozenset(names - {CONFIG_FLAG.lstrip("-")} | {ENV_KEY})


def _is_recipe(keys: set[str]) -> bool:
    """All keys train.py flags, one of them no DeepSpeed key (a DeepSpeed JSON of only `bf16` and
    `gradient_accumulation_steps` stays DeepSpeed's)."""
    return keys <= train_flag_names() and bool(keys - deepspeed_top_level_keys())


def _hf_scale_fields() -> frozenset[str]:
    from hf_scale.config.distributed_config import DistributedConfig

    return frozenset(DistributedConfig.model_fields)


def _is_manifest(data: dict) -> bool:
    from hf_scale.check.cluster import manifest_kind

    try:
        manifest_kind(data)
    except UserError:
        return False
    return True


def kind_of(data: Any) -> str | None:
    """The kind of a parsed file, or None when it is none of them."""
    if not isinstance(data, dict) or not data:
        return None
    keys = {key for key in data if isinstance(key, str)}
    deepspeed = deepspeed_top_level_keys()
    if keys & set(ACCELERATE_MARKS):
        return ACCELERATE
    if _is_manifest(data):
        return MANIFEST
    # Both read `optimizer` and `gradient_clipping`: a key only hf_scale has (strategy, topology, ...) decides.
    if keys <= _hf_scale_fields() and keys - deepspeed:
        return HF_SCALE
    if _is_recipe(keys):
        return RECIPE
    if keys & deepspeed:
        return DEEPSPEED
    return None


def file_kind(path: str) -> str:
    """Read ``path`` (JSON when it ends in .json, else YAML: JSON is YAML too) and tell its kind; a file of no kind
    is one line naming what each kind looks like."""
    text = read_text(Path(path), "check:",
                     expected="an accelerate config, a DeepSpeed config, an hf_scale config or a cluster manifest")
    if path.endswith(".json"):
        data = load_json(text, f"check: {path}")
    else:
        documents = load_yaml_documents(text, f"check: {path}")
        if len(documents) > 1:  # a stream: a TrainingRuntime and its TrainJob, a SkyPilot job group
            if any(kind_of(document) == MANIFEST for document in documents):
                return MANIFEST
            raise UserError(f"check: {path} holds {len(documents)} YAML documents, none a file check reads: give "
                            f"{WHAT_EACH_LOOKS_LIKE}")
        data = documents[0] if documents else None
    kind = kind_of(data)
    recipe = other_recipe(data) if kind != RECIPE else None  # train.py's own recipes name model_name_or_path too
    if recipe:
        raise UserError(f"check: {path} is {recipe}, not a file check reads (check does not read training recipes "
                        f"of other projects){_named_deepspeed(data)}")
    if kind is None:
        raise UserError(f"check: {path} is not a file check reads: give {WHAT_EACH_LOOKS_LIKE}")
    if kind == RECIPE:
        raise UserError(f"check: {path} is a {RECIPE} (every key is a train.py flag; hf-scale generate --recipe writes "
                        "one), not a config: check it as train.py reads it, among the training args after the "
                        f"configs: hf-scale check CONFIG... -- {path}")
    return kind


OTHER_RECIPES = {
    "model_name_or_path": "a LLaMA-Factory training recipe (model_name_or_path:, stage:, ...)",
    "base_model": "an axolotl training recipe (base_model:, datasets:, ...)",
}
"""The key that marks another project's training recipe: a YAML of its trainer's arguments, which may share a few
names with DeepSpeed's keys (`bf16`, `gradient_accumulation_steps`) but is none of check's files."""


def other_recipe(data: Any) -> str | None:
    """What another project's training recipe is (:data:`OTHER_RECIPES`), or None."""
    if not isinstance(data, dict) or set(data) & set(ACCELERATE_MARKS):
        return None
    return next((what for key, what in OTHER_RECIPES.items() if key in data), None)


def _named_deepspeed(data: dict) -> str:
    """The DeepSpeed config a recipe names (`deepspeed:`): what check can read of it."""
    named = data.get("deepspeed")
    return f"; check the DeepSpeed config it names: hf-scale check {named}" if isinstance(named, str) else ""


@dataclass(frozen=True)
class Files:
    """The files of one `hf-scale check`, by kind."""

    accelerate: str | None = None
    deepspeed: str | None = None
    hf_scale: str | None = None
    manifests: tuple[str, ...] = ()
    """Job manifests (`--manifest`): several allowed."""


def sort_files(paths: Sequence[str], accelerate: str | None, deepspeed: str | None) -> Files:
    """The positional files by kind, with the ``--accelerate-config`` / ``--deepspeed-config`` flags; a kind given
    twice is one line."""
    given: dict[str, list[tuple[str, str]]] = {ACCELERATE: [], DEEPSPEED: [], HF_SCALE: [], MANIFEST: []}
    for flag, value, kind in (("--accelerate-config", accelerate, ACCELERATE),
                              ("--deepspeed-config", deepspeed, DEEPSPEED)):
        if value is not None:
            given[kind].append((f"{flag} {value}", value))
    for path in paths:
        given[file_kind(path)].append((path, path))
    for kind, named in given.items():
        if len(named) > 1 and kind != MANIFEST:
            listing = ", ".join(label for label, _ in named)
            raise UserError(f"check: {len(named)} {kind}s given ({listing}); check one job at a time: one {kind} "
                            "at most")
    first = {kind: named[0][1] if named else None for kind, named in given.items()}
    return Files(first[ACCELERATE], first[DEEPSPEED], first[HF_SCALE], tuple(path for path, _ in given[MANIFEST]))
