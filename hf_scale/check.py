"""`hf-scale check`: find the inconsistencies between an accelerate YAML, a DeepSpeed JSON and the training
arguments *before* a job starts.

The command reads existing files (hand-written ones from other projects too), never rewrites them, and
reports every problem it finds as a :class:`Finding`. Each check is one small function registered with
:func:`_check`; :func:`run_checks` runs them in order. Wherever a library already knows the answer the
check asks it: accelerate's config loader and ``accelerate launch`` parser, DeepSpeed's config parser,
transformers' ``HfArgumentParser``. The heavy libraries are imported lazily so that the other
sub-commands of ``hf-scale`` start fast.

Exit codes: 0 clean (warnings alone are printed but do not fail), 1 at least one finding of severity
``error``, 2 unreadable or invalid input (one-line message).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import enum
import functools
import inspect
import json
import logging
import math
import re
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf_scale.errors import UserError
from hf_scale.inputs import load_json, load_yaml, read_text

RUNNERS = ("trainer", "accelerate", "deepspeed")
"""What resolves DeepSpeed's "auto" values: the HF Trainer (hf_scale's train.py resolves "auto" with the
Trainer's resolver for both of its loops), a hand-written Accelerator loop, or raw
``deepspeed.initialize`` (resolves nothing)."""

ERROR, WARNING = "error", "warning"
TRAINING_ARGS = "training args"
"""The ``file`` of findings about the training arguments given after ``--``."""

_MISSING = object()


@dataclass(frozen=True)
class Finding:
    """One problem: where it is, what disagrees, how to fix it."""

    severity: str
    """``error`` (the job fails or silently does something else) or ``warning`` (risky, may be intended)."""
    code: str
    """Stable identifier, e.g. ``grad-accum-mismatch``; listed in ``hf-scale check --help``."""
    file: str
    """The file the problem is in (as given on the command line), or ``training args``."""
    key: str
    """Dotted key path inside ``file`` (a flag for training args)."""
    problem: str
    fix: str
    values: dict[str, Any] = field(default_factory=dict)
    """``file:key`` -> value for every value involved (the disagreeing ones)."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.key}"


@dataclass(frozen=True)
class CheckInputs:
    """Everything the checks look at, already read and parsed (the checks do no I/O)."""

    runner: str
    accelerate_file: str
    accelerate: dict[str, Any]
    """The accelerate YAML as a plain mapping."""
    accelerate_loader_error: str | None = None
    """The message of accelerate's own loader when it rejects the YAML."""
    deepspeed_file: str | None = None
    deepspeed: dict[str, Any] | None = None
    """The DeepSpeed JSON that is checked, if any."""
    deepspeed_refs: tuple[tuple[str, str, str], ...] = ()
    """Every place naming a DeepSpeed JSON: (``file:key``, path as written, resolved path)."""
    deepspeed_path_note: str | None = None
    """How the YAML's relative ``deepspeed_config_file`` resolves: ``yaml_dir_only`` / ``cwd_only`` /
    ``layout_only`` / None (see :func:`_resolve_yaml_reference`)."""
    training: dict[str, Any] | None = None
    """Parsed ``TrainingArguments`` fields (defaults included) when training args were given."""
    training_argv: tuple[str, ...] = ()
    gpus_per_machine: int | None = None
    """``--gpus-per-machine N``: GPUs per machine on the target cluster; None = not assumed (no GPU findings)."""
    launch_env: dict[str, str] | None = None
    """The environment `accelerate launch` would give the training processes for this YAML (computed by
    accelerate's own launch code, nothing started); None when it could not be computed."""
    launch_error: str | None = None
    """Why accelerate's launch code refuses the YAML (a value it cannot use), if it does."""
    inline_deepspeed: dict[str, Any] | None = None
    """For a DeepSpeed YAML without ``deepspeed_config_file``: the DeepSpeed config accelerate's
    DeepSpeedPlugin builds from it, exactly as train.py builds it (hf_scale.train.inline_deepspeed)."""


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _get(mapping: Any, dotted: str, default: Any = _MISSING) -> Any:
    node = mapping
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A misspelling is close to the key it means (difflib ratio >= 0.8: `overlap_com`, `zero3_init_flg`,
# `gradient_acumulation_steps`); below that a suggestion names an unrelated key (`_comment` -> `comet`).
_SUGGESTION_CUTOFF = 0.8


def is_comment_key(key: Any) -> bool:
    """`_comment`, `_read_the_docs`, `comment`, `__notes`: keys people add to explain a JSON file."""
    return isinstance(key, str) and (key.startswith("_") or "comment" in key.lower())


def _closest(name: str, known: Any) -> str | None:
    if is_comment_key(name):
        return None
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=_SUGGESTION_CUTOFF)
    return matches[0] if matches else None


def _ignored_key_severity(name: str, known: Any) -> str:
    """A key the library ignores silently: an error when it is a misspelling of a key it reads (the setting
    written does not happen), a warning for a foreign key (e.g. another tool's `monitor_config`)."""
    return ERROR if _closest(name, known) else WARNING


def _in(file: str) -> str:
    """The start of a fix text: which file to edit."""
    return f"In {Path(file).name}, "


def _rename_fix(name: str, known: Any, what: str, file: str) -> str:
    suggestion = _closest(name, known)
    if suggestion:
        return f"{_in(file)}rename `{name}` to `{suggestion}` (the closest {what})."
    return f"{_in(file)}remove `{name}`; it is not a {what}."


def _auto_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix[:-1]


def _flag_given(argv: tuple[str, ...], name: str) -> bool:
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(arg.split("=", 1)[0] in spellings for arg in argv)


def _world_size(inp: CheckInputs) -> int | None:
    """accelerate's ``num_processes`` is the total over all machines; ``-1`` (its default) means unknown."""
    num = inp.accelerate.get("num_processes")
    if _is_int(num) and num > 0:
        return num
    return 1 if inp.accelerate.get("distributed_type") == "NO" else None


def _is_deepspeed_yaml(inp: CheckInputs) -> bool:
    return inp.accelerate.get("distributed_type") == "DEEPSPEED"


# accelerate's DeepSpeedPlugin.__post_init__ (`plugin_to_config_mapping`, accelerate/utils/dataclasses.py):
# the YAML's `deepspeed_config` keys and the DeepSpeed JSON paths they set.
YAML_TO_DS_PATH = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}

# accelerate's DeepSpeedPlugin._deepspeed_config_checks (accelerate/utils/dataclasses.py) raises at launch
# when the YAML sets one of these next to `deepspeed_config_file` (it derives them from a hard-coded list
# of ACCELERATE_* variable names inside the method, so there is nothing to import);
# tests/test_check.py proves the list against the real DeepSpeedPlugin.
DS_FILE_CONFLICTING_YAML_KEYS = (*YAML_TO_DS_PATH, "mixed_precision")


@dataclass(frozen=True)
class _DsView:
    """The DeepSpeed settings the job will run with: the JSON when there is one, else what accelerate
    builds from the YAML's ``deepspeed_config`` (DeepSpeedPlugin's no-config-file branch)."""

    config: dict[str, Any]
    file: str
    from_yaml: bool

    def where(self, path: str) -> tuple[str, str]:
        if not self.from_yaml:
            return self.file, path
        yaml_key = {v: k for k, v in YAML_TO_DS_PATH.items()}.get(path)
        return self.file, f"deepspeed_config.{yaml_key}" if yaml_key else "deepspeed_config"


def _ds_view(inp: CheckInputs) -> _DsView | None:
    if inp.deepspeed is not None:
        return _DsView(inp.deepspeed, inp.deepspeed_file or "", from_yaml=False)
    if not _is_deepspeed_yaml(inp):
        return None
    if inp.inline_deepspeed is not None:
        return _DsView(inp.inline_deepspeed, inp.accelerate_file, from_yaml=True)
    # accelerate's launch code could not read the YAML (reported as such): map its keys by hand.
    section = inp.accelerate.get("deepspeed_config")
    section = section if isinstance(section, dict) else {}  # not a mapping: `accelerate-value-invalid`
    config: dict[str, Any] = {"zero_optimization": {"stage": 2}}  # accelerate's default ZeRO stage
    for yaml_key, path in YAML_TO_DS_PATH.items():
        if yaml_key in section:
            node = config
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = section[yaml_key]
    return _DsView(config, inp.accelerate_file, from_yaml=True)


@dataclass(frozen=True)
class _Source:
    file: str
    key: str
    value: Any

    @property
    def where(self) -> str:
        return f"{self.file}:{self.key}"

    @property
    def label(self) -> str:
        """Short form for problem texts: the file's name and the key (just the flag for training args)."""
        return self.key if self.file == TRAINING_ARGS else f"{Path(self.file).name}:{self.key}"


def _training_source(inp: CheckInputs, name: str) -> _Source | None:
    if inp.training is None:
        return None
    given = _flag_given(inp.training_argv, name)
    return _Source(TRAINING_ARGS, f"--{name}" + ("" if given else " (default)"), inp.training[name])


def _disagreement(
    code: str, what: str, sources: list[_Source], fix: str, severity: str = ERROR, note: str = ""
) -> Iterator[Finding]:
    """One finding (an error unless told) when the known values of the same setting differ."""
    if len({repr(s.value) for s in sources}) > 1:
        listing = ", ".join(f"{s.label}={s.value!r}" for s in sources)
        yield Finding(
            severity,
            code,
            sources[0].file,
            sources[0].key,
            f"{what} disagrees: {listing}.{note}",
            fix,
            {s.where: s.value for s in sources},
        )


def _agree_fix(sources: list[_Source], hint: str = "") -> str:
    """"Make a.yaml:key, b.json:key and --flag equal" — every place that holds one of the values."""
    places = [s.key.split(" ")[0] if s.file == TRAINING_ARGS else s.label for s in sources]
    listing = ", ".join(places[:-1]) + f" and {places[-1]}" if len(places) > 1 else places[0]
    return f"Make {listing} equal{hint}."


def _only_a_default_flag_differs(inp: CheckInputs, sources: list[_Source], flags: tuple[str, ...]) -> bool:
    """The values written in an inline DeepSpeed YAML agree, and only a training flag left at its default
    differs: train.py then takes the YAML's value (hf_scale.train.inline_deepspeed), the HF Trainer stops."""
    written = [s for s in sources if s.file != TRAINING_ARGS]
    defaults = [s for s in sources if s.file == TRAINING_ARGS]
    return (
        _is_deepspeed_yaml(inp)
        and inp.deepspeed is None
        and bool(written and defaults)
        and len({repr(s.value) for s in written}) == 1
        and not any(_flag_given(inp.training_argv, flag) for flag in flags)
    )


_DEFAULT_FLAG_NOTE = (
    " train.py takes the YAML's value; a plain HF Trainer script stops at start on this mismatch."
)


# --------------------------------------------------------------------------------------------------
# Knowledge read from the libraries' own code
# --------------------------------------------------------------------------------------------------


@functools.cache
def _launch_option_groups() -> dict[str, frozenset[str]]:
    """`accelerate launch` options by argument group. accelerate copies every key of a YAML section onto the
    launch arguments (``_validate_launch_command``), so the options of the matching group are the keys
    that have an effect; anything else is copied silently and ignored."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    return {group.title: frozenset(a.dest for a in group._group_actions) for group in parser._action_groups}


@functools.cache
def known_section_keys(section: str) -> frozenset[str]:
    """Keys accelerate acts on under the YAML's ``deepspeed_config`` / ``fsdp_config``."""
    if section == "deepspeed_config":
        return _launch_option_groups()["DeepSpeed Arguments"]
    from accelerate.utils.launch import prepare_multi_gpu_env

    # prepare_multi_gpu_env also reads some fsdp_* attributes that have no launch option
    # (e.g. fsdp_ignored_modules): collect every fsdp_* name it mentions.
    read = set(re.findall(r"\b(fsdp_[a-z0-9_]+)", inspect.getsource(prepare_multi_gpu_env)))
    return _launch_option_groups()["FSDP Arguments"] | read


def _accelerate_config_fields(raw: dict[str, Any]) -> frozenset[str]:
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    cls = SageMakerConfig if raw.get("compute_environment") == "AMAZON_SAGEMAKER" else ClusterConfig
    # `fp16` and `dynamo_backend` are legacy keys that BaseConfig.process_config converts.
    return frozenset(cls.__dataclass_fields__) | {"fp16", "dynamo_backend"}


# Which "auto" values each runner fills in. Hand-listed because the libraries fill them inline (no
# importable list); tests/test_check.py checks every entry against the libraries' source.
# Resolved by accelerate's DeepSpeedPlugin.__post_init__ for both the Trainer and an Accelerator loop.
_PLUGIN_RESOLVED = frozenset(YAML_TO_DS_PATH.values())
# transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process / _finalize.
TRAINER_RESOLVED = _PLUGIN_RESOLVED | {
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "gradient_clipping",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.total_num_steps",
    "scheduler.params.warmup_num_steps",
    "fp16.enabled",
    "bf16.enabled",
    "zero_optimization.reduce_bucket_size",
}
TRAINER_RESOLVED_ZERO3_ONLY = frozenset(
    {"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold"}
)
# accelerate/accelerator.py Accelerator._prepare_deepspeed (batch sizes from the prepared DataLoader, the
# bucket sizes from model.config.hidden_size, optimizer lr/weight_decay from DummyOptim, scheduler values
# from DummyScheduler) and DeepSpeedPlugin.set_mixed_precision (fp16/bf16). Betas, eps and anything else
# left "auto" make _prepare_deepspeed raise "`...` not found in kwargs".
ACCELERATE_RESOLVED = (
    _PLUGIN_RESOLVED
    | TRAINER_RESOLVED_ZERO3_ONLY
    | {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.reduce_bucket_size",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "fp16.enabled",
        "bf16.enabled",
    }
)


def _resolvable(runner: str, path: str, ds: dict[str, Any]) -> bool:
    if runner == "trainer":
        return path in TRAINER_RESOLVED or (
            path in TRAINER_RESOLVED_ZERO3_ONLY and _get(ds, "zero_optimization.stage") == 3
        )
    if runner == "accelerate":
        return path in ACCELERATE_RESOLVED
    return False  # raw deepspeed.initialize resolves nothing


@contextlib.contextmanager
def _deepspeed_off_stdout() -> Iterator[None]:
    """DeepSpeed's logger writes to the ``sys.stdout`` of the moment it is first imported: import it with
    stdout pointing at stderr so that ``--json`` output stays parseable, and keep its warnings quiet
    while it parses the config."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed.runtime.config  # noqa: F401  (the first import creates the logger)

        ds_logger = logging.getLogger("DeepSpeed")
        level = ds_logger.level
        ds_logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            ds_logger.setLevel(level)


class _ReadTracker(dict):
    """A dict that records which keys DeepSpeedConfig reads: a top-level key it never reads has no
    effect. ``__copy__`` returns itself because DeepSpeedConfig copies the dict before reading it."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def __copy__(self) -> _ReadTracker:
        return self

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def _with_sample_values(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy DeepSpeed's parser accepts: "auto" -> a sample value; batch sizes -> 1 (DeepSpeedConfig checks
    them against a world size of 1 outside a job; the real arithmetic is the `train-batch-mismatch` check);
    bf16 off when fp16 is on too (already the `fp16-and-bf16` finding)."""

    def substitute(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: substitute(v, k) for k, v in node.items()}
        if node == "auto":
            return {"betas": [0.9, 0.999], "enabled": False}.get(key, 1)
        return node

    sample = substitute(copy.deepcopy(ds))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in sample:
            sample[key] = 1
    if _get(sample, "fp16.enabled") is True and _get(sample, "bf16.enabled") is True:
        sample["bf16"]["enabled"] = False
    return sample


def _drop(mapping: dict[str, Any], loc: tuple[str, ...]) -> None:
    node = mapping
    for part in loc[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return
    node.pop(loc[-1], None)


def _pydantic_names(model: Any, loc: tuple[Any, ...]) -> set[str]:
    """Field names and aliases of the (nested) pydantic model at ``loc``, for suggestions."""
    from pydantic import BaseModel

    for part in loc:
        field_info = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if field_info is None:
            return set()
        candidates = [field_info.annotation, *typing.get_args(field_info.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return set()
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


# --------------------------------------------------------------------------------------------------
# The checks: one function per concern, run in registration order
# --------------------------------------------------------------------------------------------------

Check = Callable[[CheckInputs], Iterator[Finding]]
CHECKS: list[Check] = []


def _check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


@_check
def check_accelerate_top_level(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-accelerate-key`, `accelerate-config-invalid`: accelerate's loader rejects the YAML."""
    known = _accelerate_config_fields(inp.accelerate)
    unknown = [key for key in inp.accelerate if key not in known]
    for key in unknown:
        yield Finding(
            ERROR,
            "unknown-accelerate-key",
            inp.accelerate_file,
            key,
            "Not an accelerate config key: `accelerate launch` refuses the file.",
            _rename_fix(key, known, "accelerate config key", inp.accelerate_file),
            {f"{inp.accelerate_file}:{key}": inp.accelerate[key]},
        )
    # With unknown keys the loader fails on them first; anything else it reports on its own.
    if inp.accelerate_loader_error and not unknown:
        yield Finding(
            ERROR,
            "accelerate-config-invalid",
            inp.accelerate_file,
            "(file)",
            f"accelerate's config loader rejects the file: {inp.accelerate_loader_error}",
            f"{_in(inp.accelerate_file)}fix the value accelerate names (or regenerate the file with "
            "`accelerate config` or `hf-scale generate`).",
        )


@_check
def check_accelerate_launch(inp: CheckInputs) -> Iterator[Finding]:
    """`accelerate-launch-fails`: `accelerate launch`'s own code (run up to where it would start the
    processes) fails on a value of the YAML, e.g. `num_machines: "2"`; values it converts itself (a quoted
    `machine_rank: "1"`) are accepted as it accepts them."""
    if inp.launch_error is None or inp.accelerate_loader_error is not None:
        return
    if any(problem for _, _, problem in _accelerate_value_problems(inp)):
        return  # `accelerate-value-invalid` names the value accelerate fails on
    yield Finding(
        ERROR,
        "accelerate-launch-fails",
        inp.accelerate_file,
        "(file)",
        f"`accelerate launch` fails on this file: {inp.launch_error}",
        f"{_in(inp.accelerate_file)}write the value accelerate cannot use as a plain number/string of the "
        "type `accelerate config` writes.",
    )


@_check
def check_accelerate_nested_keys(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-accelerate-key`: misspelled/unknown keys under `deepspeed_config` / `fsdp_config`
    (accelerate copies them onto its launch arguments silently, so they have no effect): an error for a
    misspelling of a known key, a warning for another key."""
    for section, prefix in (("deepspeed_config", ""), ("fsdp_config", "fsdp_")):
        values = inp.accelerate.get(section)
        if not isinstance(values, dict):
            continue
        known = known_section_keys(section)
        for key, value in values.items():
            # accelerate prefixes fsdp_config keys with "fsdp_" when they lack it (_validate_launch_command).
            effective = key if key.startswith(prefix) else prefix + key
            # A comment key is copied onto the launch arguments like any other and changes nothing.
            if effective not in known and not is_comment_key(key):
                yield Finding(
                    _ignored_key_severity(effective, known),
                    "unknown-accelerate-key",
                    inp.accelerate_file,
                    f"{section}.{key}",
                    "Not an option accelerate reads: ignored without a warning.",
                    _rename_fix(effective, known, f"`{section}` key", inp.accelerate_file),
                    {f"{inp.accelerate_file}:{section}.{key}": value},
                )


@_check
def check_deepspeed_file_reference(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-config-path`, `deepspeed-config-differs`: the YAML's `deepspeed_config_file` resolves
    only from one directory, or different places name different DeepSpeed JSON files."""
    key = "deepspeed_config.deepspeed_config_file"
    written = _get(inp.accelerate, key, None)
    if inp.deepspeed_path_note == "yaml_dir_only":
        yield Finding(
            ERROR,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` exists next to the YAML but not in the current directory, and `accelerate "
            "launch` resolves it relative to the directory it is started from.",
            f"{_in(inp.accelerate_file)}write `{key}` as an absolute path, or relative to the directory you "
            "launch from.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    elif inp.deepspeed_path_note == "cwd_only":
        yield Finding(
            WARNING,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` resolves only relative to the current directory: "
            "launching from anywhere else fails.",
            f"{_in(inp.accelerate_file)}write `{key}` as an absolute path, or always launch from this "
            "directory.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    elif inp.deepspeed_path_note == "layout_only":
        root = Path(inp.accelerate_file).parent.parent
        name = Path(inp.accelerate_file).stem
        yield Finding(
            WARNING,
            "deepspeed-config-path",
            inp.accelerate_file,
            key,
            f"`{written}` resolves from {root}/ (where the generated launch scripts start `accelerate launch`), "
            "not from the current directory: `accelerate launch` started here fails.",
            f"Start `accelerate launch` from {root}/ (launch/{name}.accelerate.sh there does), or write `{key}` "
            "as an absolute path.",
            {f"{inp.accelerate_file}:{key}": written},
        )
    refs = inp.deepspeed_refs
    for (where_a, written_a, resolved_a), (where_b, written_b, resolved_b) in zip(
        refs, refs[1:], strict=False
    ):
        if resolved_a != resolved_b:
            # --deepspeed-config only picks what this command checks; the other places are read by the job.
            used_by_job = "--deepspeed-config" not in (where_a, where_b)
            file, flag = where_b.rsplit(":", 1)
            yield Finding(
                ERROR if used_by_job else WARNING,
                "deepspeed-config-differs",
                file,
                flag,
                f"Two DeepSpeed configs are named: {where_a}={written_a!r} and {where_b}={written_b!r}"
                + (
                    " (the job reads both)."
                    if used_by_job
                    else " (the job uses the YAML's; this checked the other)."
                ),
                f"Point {where_a} and {where_b} at the same JSON file.",
                {where_a: written_a, where_b: written_b},
            )


@_check
def check_deepspeed_unused(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-config-unused`: a DeepSpeed JSON is given but the launch never enables DeepSpeed."""
    trainer_flag = inp.training is not None and inp.training.get("deepspeed")
    if inp.deepspeed is None or _is_deepspeed_yaml(inp) or trainer_flag or inp.runner == "deepspeed":
        return
    dtype = inp.accelerate.get("distributed_type")
    yield Finding(
        WARNING,
        "deepspeed-config-unused",
        inp.accelerate_file,
        "distributed_type",
        f"distributed_type is {dtype!r}, so `accelerate launch` does not use {inp.deepspeed_file}.",
        f"{_in(inp.accelerate_file)}set `distributed_type: DEEPSPEED` with "
        "`deepspeed_config.deepspeed_config_file`, or pass `--deepspeed FILE` in the training args.",
        {f"{inp.accelerate_file}:distributed_type": dtype},
    )


@_check
def check_duplicated_deepspeed_keys(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-key-duplicated`: the YAML sets DeepSpeed keys next to `deepspeed_config_file`, or inline while the
    training args pass `--deepspeed FILE`: accelerate refuses them ("the following accelerate config
    variables will be ignored") at launch, resp. when TrainingArguments builds its DeepSpeed plugin."""
    section = inp.accelerate.get("deepspeed_config")
    if not _is_deepspeed_yaml(inp) or not isinstance(section, dict):
        return
    flag_json = "deepspeed_config_file" not in section and bool(inp.training and inp.training.get("deepspeed"))
    if "deepspeed_config_file" not in section and not flag_json:
        return
    for key in DS_FILE_CONFLICTING_YAML_KEYS:
        yaml_key = key if key == "mixed_precision" else f"deepspeed_config.{key}"
        value = _get(inp.accelerate, yaml_key)
        # launch adds mixed_precision to the conflicting fields whenever the YAML sets it, even to "no".
        if value is _MISSING or value is None:
            continue
        values = {f"{inp.accelerate_file}:{yaml_key}": value}
        ds_path = YAML_TO_DS_PATH.get(key, "fp16.enabled / bf16.enabled")
        if inp.deepspeed is not None and key in YAML_TO_DS_PATH:
            values[f"{inp.deepspeed_file}:{ds_path}"] = _get(inp.deepspeed, ds_path, None)
        yield Finding(
            ERROR,
            "ds-key-duplicated",
            inp.accelerate_file,
            yaml_key,
            (
                "Set in the YAML while the training args pass --deepspeed: accelerate raises when "
                "TrainingArguments builds its DeepSpeed plugin (with a JSON it takes this setting only from it)."
                if flag_json
                else "Set next to `deepspeed_config_file`: accelerate raises at launch (with a JSON file it "
                "takes this setting only from the JSON)."
            ),
            f"Delete `{yaml_key}` from {Path(inp.accelerate_file).name} and set `{ds_path}` in "
            f"{Path(inp.deepspeed_file or 'the DeepSpeed JSON').name}"
            + (", or drop --deepspeed from the training args." if flag_json else "."),
            values,
        )


@_check
def check_gradient_accumulation(inp: CheckInputs) -> Iterator[Finding]:
    """`grad-accum-mismatch`: gradient accumulation differs between the YAML, the JSON and the training
    args (a warning when only a flag left at its default differs from an inline `deepspeed_config`: train.py
    takes the YAML's value, a plain HF Trainer stops)."""
    sources = [
        _Source(inp.accelerate_file, key, _get(inp.accelerate, key))
        for key in ("deepspeed_config.gradient_accumulation_steps", "gradient_accumulation_steps")
        if _is_int(_get(inp.accelerate, key))
    ]
    if _is_int(_get(inp.deepspeed, "gradient_accumulation_steps")):
        sources.append(
            _Source(
                inp.deepspeed_file or "",
                "gradient_accumulation_steps",
                inp.deepspeed["gradient_accumulation_steps"],
            )
        )
    if (training := _training_source(inp, "gradient_accumulation_steps")) is not None:
        sources.append(training)
    soft = _only_a_default_flag_differs(inp, sources, ("gradient_accumulation_steps",))
    hint = ' ("auto" in the DeepSpeed JSON follows the training args)' if inp.deepspeed is not None else ""
    yield from _disagreement(
        "grad-accum-mismatch",
        "gradient_accumulation_steps",
        sources,
        _agree_fix(sources, hint) if len(sources) > 1 else "",
        WARNING if soft else ERROR,
        _DEFAULT_FLAG_NOTE if soft else "",
    )


@_check
def check_micro_batch(inp: CheckInputs) -> Iterator[Finding]:
    """`micro-batch-mismatch`: the JSON's `train_micro_batch_size_per_gpu` differs from
    `--per_device_train_batch_size` (the Trainer raises)."""
    micro = _get(inp.deepspeed, "train_micro_batch_size_per_gpu")
    training = _training_source(inp, "per_device_train_batch_size")
    if inp.runner != "trainer" or not _is_int(micro) or training is None:
        return
    yield from _disagreement(
        "micro-batch-mismatch",
        "the micro batch size per device",
        [_Source(inp.deepspeed_file or "", "train_micro_batch_size_per_gpu", micro), training],
        f'{_in(inp.deepspeed_file or "")}set `train_micro_batch_size_per_gpu` to "auto" (the Trainer fills '
        "it) or to --per_device_train_batch_size.",
    )


_UNKNOWN = object()
"""A batch value that is "auto" and whose runner-filled value the inputs do not tell."""


def _batch_value(inp: CheckInputs, key: str, flag: str) -> Any:
    """What DeepSpeed will see for one batch key: an int, None (absent: DeepSpeed derives it) or _UNKNOWN."""
    value = _get(inp.deepspeed, key, None)
    if value is None:
        # accelerate's DeepSpeedPlugin (both the Trainer and an Accelerator loop) writes a missing
        # gradient_accumulation_steps as 1.
        return 1 if key == "gradient_accumulation_steps" and inp.runner != "deepspeed" else None
    if value == "auto" and inp.runner == "trainer" and inp.training is not None:
        return inp.training[flag]
    return value if _is_int(value) and value > 0 else _UNKNOWN  # <= 0: `deepspeed-value-invalid`


def _deepspeed_accepts_batch(total: Any, micro: Any, accum: Any, world: int) -> tuple[bool, Any, Any]:
    """Run DeepSpeed's own batch arithmetic (DeepSpeedConfig._configure_train_batch_size: derive the missing
    values, then assert) on the four numbers; returns (accepted, derived micro, derived accumulation). The
    two methods read only these attributes, so no full config is needed."""
    with _deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig

    config = object.__new__(DeepSpeedConfig)
    config.train_batch_size, config.train_micro_batch_size_per_gpu = total, micro
    config.gradient_accumulation_steps, config.world_size = accum, world
    try:
        config._configure_train_batch_size()
    except AssertionError:
        return False, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    return True, micro, accum


def _batch_problem(total: Any, micro: Any, accum: Any, world: int) -> tuple[str, str, str] | None:
    """(code, problem, fix) when DeepSpeed's batch arithmetic fails for these values, else None."""
    if micro is None and total is None:
        ok = False
    elif _UNKNOWN in (micro, accum):
        # "auto" the runner fills: still impossible when train_batch_size is no multiple of the known part.
        other = accum if micro is _UNKNOWN else micro
        if other is None or total % (world * other) == 0:
            return None
        known = world * other
        what = "gradient_accumulation_steps" if micro is _UNKNOWN else "train_micro_batch_size_per_gpu"
        return (
            "train-batch-invalid",
            f"train_batch_size={total} is not a multiple of {what} x world size = {known}: whatever the "
            "runner fills in for the \"auto\" value, DeepSpeed asserts at start.",
            f"set `train_batch_size` to a multiple of {known}, or to \"auto\".",
        )
    else:
        ok, micro_seen, accum_seen = _deepspeed_accepts_batch(total, micro, accum, world)
    if ok:
        return None
    if total is None:
        return (
            "train-batch-invalid",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is set: DeepSpeed asserts at start.",
            'set `train_micro_batch_size_per_gpu` (or "auto" for the Trainer) or `train_batch_size`.',
        )
    if micro is not None and accum is not None:
        product = micro * accum * world
        return (
            "train-batch-mismatch",
            f"train_batch_size={total} but micro batch x accumulation x world size = "
            f"{micro} x {accum} x {world} = {product} (DeepSpeed asserts at start).",
            f'set `train_batch_size` to {product}, or to "auto".',
        )
    derived, given, known = (
        ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", accum or 1)
        if micro is None
        else ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", micro)
    )
    return (
        "train-batch-invalid",
        f"train_batch_size={total} over world size {world} x {given} {known}: DeepSpeed derives "
        f"{derived} = {total} / {world * known} = {total / (world * known):g}, "
        + ("0" if total < world * known else "not a whole number")
        + " (it floors it and asserts at start).",
        f"set `train_batch_size` to a multiple of {world * known} "
        f"(e.g. {world * known * max(1, total // (world * known))}), or set `{derived}`.",
    )


@_check
def check_train_batch_size(inp: CheckInputs) -> Iterator[Finding]:
    """`train-batch-mismatch`, `train-batch-invalid`: DeepSpeed's batch arithmetic fails: `train_batch_size`
    != micro batch x accumulation x world size, or the value DeepSpeed derives is 0 or not a whole number
    (e.g. `train_batch_size` smaller than the world size), or no batch size is set at all. The world size is
    the YAML's `num_processes`, the total over all machines."""
    world = _world_size(inp)
    if inp.deepspeed is None or world is None or _get(inp.deepspeed, "train_batch_size", None) == "auto":
        return  # "auto": the runner computes it from the other two
    total = _batch_value(inp, "train_batch_size", "")
    micro = _batch_value(inp, "train_micro_batch_size_per_gpu", "per_device_train_batch_size")
    accum = _batch_value(inp, "gradient_accumulation_steps", "gradient_accumulation_steps")
    if total is _UNKNOWN or (micro is _UNKNOWN and accum is _UNKNOWN) or (total is None and micro is not None):
        return  # unknown, or DeepSpeed computes train_batch_size from the micro batch
    problem = _batch_problem(total, micro, accum, world)
    if problem is None:
        return
    code, text, fix = problem
    file = inp.deepspeed_file or ""
    values = {f"{file}:train_batch_size": total, f"{inp.accelerate_file}:num_processes": world}
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)):
        if value is not _UNKNOWN:
            values[key] = value
    yield Finding(ERROR, code, file, "train_batch_size", text, _in(file) + fix, values)


def _precision_sources(inp: CheckInputs) -> tuple[list[_Source], dict[str, _Source]]:
    """(what the YAML / training args ask for, DeepSpeed's explicit ``enabled`` flags by dtype)."""
    wanted = []
    mixed = inp.accelerate.get("mixed_precision")
    if isinstance(mixed, str):
        wanted.append(_Source(inp.accelerate_file, "mixed_precision", mixed))
    if inp.training is not None:
        flags = [name for name in ("bf16", "fp16") if inp.training[name]]
        given = "--" + "/--".join(flags) if flags else "--bf16/--fp16 (not given)"
        wanted.append(_Source(TRAINING_ARGS, given, flags[0] if len(flags) == 1 else "no"))
    explicit = {}
    for dtype, block in (("fp16", "fp16"), ("bf16", "bf16"), ("bf16", "bfloat16")):
        enabled = _get(inp.deepspeed, f"{block}.enabled", None)
        if isinstance(enabled, bool):
            explicit[dtype] = _Source(inp.deepspeed_file or "", f"{block}.enabled", enabled)
    return wanted, explicit


@_check
def check_precision(inp: CheckInputs) -> Iterator[Finding]:
    """`precision-mismatch`: accelerate `mixed_precision`, DeepSpeed's fp16/bf16 blocks and `--bf16/--fp16`
    ask for different precisions (a warning when only unset flags differ from an inline `deepspeed_config`
    YAML, as for grad-accum-mismatch)."""
    wanted, explicit = _precision_sources(inp)
    soft = _only_a_default_flag_differs(inp, wanted, ("bf16", "fp16"))
    yield from _disagreement(
        "precision-mismatch",
        "mixed precision",
        wanted,
        _agree_fix(wanted, " (one precision: no, fp16 or bf16)") if len(wanted) > 1 else "",
        WARNING if soft else ERROR,
        _DEFAULT_FLAG_NOTE if soft else "",
    )
    for source in wanted:
        # accelerate runs fp8 on top of DeepSpeed's bf16 (DeepSpeedPlugin.set_mixed_precision).
        asked = "bf16" if source.value == "fp8" else source.value
        for dtype, ds in explicit.items():
            if ds.value != (asked == dtype):
                yield Finding(
                    ERROR,
                    "precision-mismatch",
                    ds.file,
                    ds.key,
                    f"{ds.label}={ds.value} but {source.label}={source.value!r}.",
                    f'{_in(ds.file)}set `{ds.key}` to "auto" (it then follows {source.label}), or make the two '
                    "agree.",
                    {ds.where: ds.value, source.where: source.value},
                )


@_check
def check_fp16_and_bf16(inp: CheckInputs) -> Iterator[Finding]:
    """`fp16-and-bf16`: fp16 and bf16 are both enabled (DeepSpeed JSON or training args)."""
    _, explicit = _precision_sources(inp)
    if all(dtype in explicit and explicit[dtype].value for dtype in ("fp16", "bf16")):
        yield Finding(
            ERROR,
            "fp16-and-bf16",
            explicit["fp16"].file,
            "fp16.enabled",
            "fp16 and bf16 are both enabled; DeepSpeed refuses this.",
            f"{_in(explicit['fp16'].file)}enable only one of `fp16.enabled` and `{explicit['bf16'].key}` "
            "(bf16 on Ampere+).",
            {s.where: s.value for s in explicit.values()},
        )
    if inp.training is not None and inp.training["fp16"] and inp.training["bf16"]:
        yield Finding(
            ERROR,
            "fp16-and-bf16",
            TRAINING_ARGS,
            "--fp16/--bf16",
            "Both --fp16 and --bf16 are given; TrainingArguments refuses this.",
            "Pass only one of --fp16 and --bf16 in the training args.",
            {f"{TRAINING_ARGS}:--fp16": True, f"{TRAINING_ARGS}:--bf16": True},
        )


@_check
def check_auto_values(inp: CheckInputs) -> Iterator[Finding]:
    """`auto-unresolvable`: "auto" values the chosen runner cannot fill in (one finding per key)."""
    if inp.deepspeed is None:
        return
    for path in _auto_paths(inp.deepspeed):
        if not _resolvable(inp.runner, path, inp.deepspeed):
            reason = {
                "trainer": "the HF Trainer does not fill it"
                + (" below ZeRO-3" if path in TRAINER_RESOLVED_ZERO3_ONLY else ""),
                "accelerate": "a hand-written Accelerator loop does not fill it (accelerate fills only batch "
                "sizes, gradient_clipping, bucket sizes, DummyOptim lr/weight_decay, "
                "DummyScheduler values and fp16/bf16)",
                "deepspeed": 'raw deepspeed.initialize resolves no "auto" value',
            }[inp.runner]
            yield Finding(
                ERROR,
                "auto-unresolvable",
                inp.deepspeed_file or "",
                path,
                f'"auto", but {reason}.',
                f"{_in(inp.deepspeed_file or '')}write a concrete value for `{path}` (`hf-scale generate` "
                "writes a resolved JSON for this runner).",
                {f"{inp.deepspeed_file}:{path}": "auto"},
            )


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PARSE_ERRORS = (AssertionError, ValueError, TypeError, KeyError, AttributeError)


@functools.cache
def _deepspeed_models() -> dict[str, Any]:
    """DeepSpeed's pydantic config classes by name (a ValidationError names its model in ``title``)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    found, todo = {}, [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def _section_errors(sample: dict[str, Any], key: str) -> tuple[list[dict[str, Any]], Any, str | None]:
    """Parse one top-level section on its own with DeepSpeedConfig, so that an invalid key elsewhere cannot
    hide it: (pydantic error items, the model that raised, or another parse error's message)."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    alone = {k: sample[k] for k in _BATCH_KEYS if k in sample} or {"train_batch_size": 1}
    alone[key] = sample[key]
    try:
        DeepSpeedConfig(alone)
    except pydantic.ValidationError as error:
        return error.errors(), _deepspeed_models().get(error.title), None
    except (DeepSpeedConfigError, *_PARSE_ERRORS) as error:
        return [], None, " ".join(str(error).split())
    return [], None, None


@_check
def check_deepspeed_overrides_flags(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-overrides-flags` (warning; an error when a replaced flag is given explicitly): the JSON's
    `optimizer` block replaces `--optim`/`--optim_args`, its `scheduler` block `--lr_scheduler_type`/
    `--lr_scheduler_kwargs` (e.g. WarmupLR: constant after a logarithmic warmup, where the Trainer's default
    decays linearly). train.py warns the same way, and refuses to start on an explicit flag."""
    if inp.deepspeed is None or inp.runner != "trainer":
        return
    from hf_scale import deepspeed_overrides

    file = inp.deepspeed_file or ""
    for override in deepspeed_overrides.find_overrides(inp.deepspeed, inp.training_argv):
        flags = " / ".join(f"--{flag}" for flag in (override.given or override.flags[:1]))
        key = override.path if override.ds_type is not None else override.block
        yield Finding(
            ERROR if override.given else WARNING,
            "ds-overrides-flags",
            file,
            key,
            deepspeed_overrides.describe(override, inp.training or {}) + ".",
            (
                f"{_in(file)}remove the `{override.block}` block (`{key}`) to get {flags}, or drop {flags} "
                "from the training args."
                if override.given
                else f"{_in(file)}keep `{key}` to run DeepSpeed's {override.block}, or remove the "
                f"`{override.block}` block to let {flags} decide."
            ),
            {f"{file}:{key}": override.ds_type, **{f"{TRAINING_ARGS}:--{f}": (inp.training or {}).get(f)
                                                 for f in override.given}},
        )


# Trainer comparisons already reported by their own checks (batch sizes, accumulation, precision).
_COMPARED_ELSEWHERE = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "fp16.enabled",
    "bf16.enabled",
)
_MISMATCH_LINE = re.compile(r"- ds (?P<key>\S+)=(?P<ds>.*) vs hf (?P<hf>\S+)=(?P<flag>.*)")


@_check
def check_trainer_compared_values(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-trainer-mismatch`: a concrete value of the JSON that the HF Trainer compares with a training flag
    differs from it (`gradient_clipping` vs `--max_grad_norm`, the optimizer's lr/betas/eps/weight_decay,
    the scheduler's `warmup_max_lr` vs `--learning_rate`), defaults included: the Trainer stops at start
    ("mismatch"). Found with transformers' own HfTrainerDeepSpeedConfig."""
    if inp.deepspeed is None or inp.runner != "trainer" or inp.training is None:
        return
    import types

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    args = types.SimpleNamespace(**inp.training, world_size=_world_size(inp) or 1)
    try:
        resolver = HfTrainerDeepSpeedConfig(copy.deepcopy(inp.deepspeed))
        resolver.trainer_config_process(args)
    except _PARSE_ERRORS:
        return  # the schema checks report what it cannot read
    finally:
        unset_hf_deepspeed_config()  # the resolver registers itself globally
    file = inp.deepspeed_file or ""
    for line in resolver.mismatches:
        match = _MISMATCH_LINE.fullmatch(line)
        if match is None or match["key"] in _COMPARED_ELSEWHERE:
            continue
        flags = "/".join(f"--{name}" for name in re.split(r"[+|]", match["hf"]))
        yield Finding(
            ERROR,
            "ds-trainer-mismatch",
            file,
            match["key"],
            f"{match['key']}={match['ds']} but {flags}={match['flag']}"
            + (" (default)" if not any(_flag_given(inp.training_argv, f[2:]) for f in flags.split("/")) else "")
            + ": the HF Trainer (and train.py) stop at start on this mismatch.",
            f'{_in(file)}set `{match["key"]}` to "auto" (it then follows {flags}), or pass the same value '
            f"as {flags} in the training args.",
            {f"{file}:{match['key']}": _get(inp.deepspeed, match["key"], None),
             f"{TRAINING_ARGS}:{flags}": match["flag"]},
        )


@_check
def check_deepspeed_schema(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-deepspeed-key`, `deepspeed-config-invalid`: DeepSpeed's own parser (after "auto" -> sample
    values) rejects a key or a value, or never reads a top-level key (ignored silently: an error for a
    misspelling of a key it reads, a warning for another key). Every section is parsed on its own, so every
    invalid key is reported, not only the first; comment keys at the top level (`_comment`,
    `_read_the_docs`) are fine."""
    if inp.deepspeed is None:
        return
    import pydantic

    file = inp.deepspeed_file or ""
    sample = _with_sample_values(inp.deepspeed)
    with _deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

        for key in [k for k in sample if k not in _BATCH_KEYS]:
            items, model, message = _section_errors(sample, key)
            for item in items:
                yield _schema_finding(file, inp.deepspeed, key, item, model)
            if message is not None:
                yield Finding(
                    ERROR,
                    "deepspeed-config-invalid",
                    file,
                    key,
                    f"DeepSpeed refuses `{key}`: {message}",
                    f"{_in(file)}fix `{key}` as DeepSpeed says.",
                    {f"{file}:{key}": inp.deepspeed.get(key)},
                )
            if items or message is not None:
                del sample[key]  # reported: parse the rest without it
        tracked = _ReadTracker(sample)
        try:
            DeepSpeedConfig(tracked)
        except (DeepSpeedConfigError, pydantic.ValidationError, *_PARSE_ERRORS) as error:
            yield Finding(
                ERROR,
                "deepspeed-config-invalid",
                file,
                "(file)",
                f"DeepSpeed refuses the config: {' '.join(str(error).split())}",
                f"{_in(file)}fix the value DeepSpeed names.",
            )
            return
    for key in inp.deepspeed:
        if key in sample and key not in tracked.read and not is_comment_key(key):
            yield Finding(
                _ignored_key_severity(key, tracked.read),
                "unknown-deepspeed-key",
                file,
                key,
                "DeepSpeed never reads this top-level key: ignored without a warning.",
                _rename_fix(key, tracked.read, "DeepSpeed config key", file),
                {f"{file}:{key}": inp.deepspeed[key]},
            )


def _schema_finding(file: str, ds: dict[str, Any], key: str, item: dict[str, Any], model: Any) -> Finding:
    """A pydantic error raised by ``model`` while parsing the top-level section ``key``."""
    relative = tuple(str(part) for part in item["loc"])  # relative to `model`
    loc = relative if relative and relative[0] == key else (key, *relative)
    path = ".".join(loc)
    value = _get(ds, path, None)
    if item["type"] == "extra_forbidden":
        names = _pydantic_names(model, relative[:-1]) if model is not None else set()
        problem = "Not a key of this DeepSpeed section: DeepSpeed refuses the config."
        if is_comment_key(loc[-1]):
            problem = "DeepSpeed's sections refuse any key they do not define, comments included."
        return Finding(
            ERROR,
            "unknown-deepspeed-key",
            file,
            path,
            problem,
            _rename_fix(loc[-1], names, f"key of `{'.'.join(loc[:-1])}`", file),
            {f"{file}:{path}": value},
        )
    return Finding(
        ERROR,
        "deepspeed-config-invalid",
        file,
        path,
        f"DeepSpeed refuses `{path}`={value!r}: {item['msg']}.",
        f"{_in(file)}set `{path}` to a value DeepSpeed accepts.",
        {f"{file}:{path}": value},
    )


@_check
def check_use_cpu_processes(inp: CheckInputs) -> Iterator[Finding]:
    """`cpu-single-process`: `use_cpu: true` with more than one process starts ONE process (accelerate's
    simple launcher; several CPU processes need mpirun); `--use_cpu`/`--cpu` in the training args with
    several processes trains on CPU in each of them."""
    world = _world_size(inp)
    if world is None or world <= 1:
        return
    if inp.accelerate.get("use_cpu") is True and not _get(
        inp.accelerate, "mpirun_config.mpirun_hostfile", None
    ):
        yield Finding(
            ERROR,
            "cpu-single-process",
            inp.accelerate_file,
            "use_cpu",
            f"use_cpu is true with num_processes={world}: `accelerate launch` then starts a single process.",
            f"{_in(inp.accelerate_file)}set `use_cpu: false` for GPUs, or `num_processes: 1`; several CPU "
            "processes need `mpirun_config.mpirun_hostfile` (or torchrun with a gloo backend).",
            {f"{inp.accelerate_file}:use_cpu": True, f"{inp.accelerate_file}:num_processes": world},
        )
    if inp.training is not None and inp.training["use_cpu"]:
        flag = "--use_cpu"
    elif _flag_given(inp.training_argv, "cpu"):  # train.py-style flag, unknown to TrainingArguments
        flag = "--cpu"
    else:
        return
    yield Finding(
        WARNING,
        "cpu-single-process",
        TRAINING_ARGS,
        flag,
        f"{flag} with num_processes={world}: each launched process trains on the CPU, not on a GPU.",
        f"Drop {flag} from the training args to use the GPUs, or set num_processes: 1 in "
        f"{Path(inp.accelerate_file).name}.",
        {f"{TRAINING_ARGS}:{flag}": True, f"{inp.accelerate_file}:num_processes": world},
    )


@_check
def check_use_cpu_ignores_plugin(inp: CheckInputs) -> Iterator[Finding]:
    """`use-cpu-ignores-plugin`: `use_cpu: true` with FSDP or DeepSpeed: accelerate uses its simple
    launcher and silently trains without them (FSDP falls back to DDP)."""
    dtype = inp.accelerate.get("distributed_type")
    if inp.accelerate.get("use_cpu") is True and dtype in ("FSDP", "DEEPSPEED"):
        yield Finding(
            ERROR,
            "use-cpu-ignores-plugin",
            inp.accelerate_file,
            "use_cpu",
            f"use_cpu is true with distributed_type {dtype}: accelerate then ignores the {dtype} settings "
            "without an error.",
            f"{_in(inp.accelerate_file)}set `use_cpu: false` ({dtype} through accelerate needs GPUs).",
            {f"{inp.accelerate_file}:use_cpu": True, f"{inp.accelerate_file}:distributed_type": dtype},
        )


@_check
def check_fsdp_without_gpu(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp-no-gpu` (warning): FSDP on target machines without GPUs (`--gpus-per-machine 0`). Without it the check
    assumes nothing about the target's GPUs (the machine running the check is often a login node)."""
    if inp.accelerate.get("distributed_type") == "FSDP" and inp.gpus_per_machine == 0:
        yield Finding(
            WARNING,
            "fsdp-no-gpu",
            inp.accelerate_file,
            "distributed_type",
            "FSDP through accelerate needs GPUs and the target machines have none (--gpus-per-machine 0): it would run "
            "without sharding or gradient sync.",
            f"{_in(inp.accelerate_file)}choose `distributed_type: MULTI_CPU` for CPU machines, or check the "
            "target's GPUs (--gpus-per-machine N).",
            {f"{inp.accelerate_file}:distributed_type": "FSDP", "--gpus-per-machine": 0},
        )


_GPU_TYPES = ("MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM")


@_check
def check_processes_per_gpu(inp: CheckInputs) -> Iterator[Finding]:
    """`processes-exceed-gpus`: more processes per machine than `--gpus-per-machine N` GPUs per target machine (each
    process takes one GPU; the extra ones fail to start or share a GPU). Only with `--gpus-per-machine`."""
    gpus, acc = inp.gpus_per_machine, inp.accelerate
    processes, machines = acc.get("num_processes"), acc.get("num_machines", 1)
    if gpus is None or acc.get("distributed_type") not in _GPU_TYPES or acc.get("use_cpu") is True:
        return
    if not (_is_int(processes) and processes > 0 and _is_int(machines) and machines > 0):
        return
    if (gpus == 0 and acc.get("distributed_type") == "FSDP") or processes // machines <= gpus:
        return  # FSDP without GPUs: `fsdp-no-gpu`
    yield Finding(
        ERROR,
        "processes-exceed-gpus",
        inp.accelerate_file,
        "num_processes",
        f"num_processes={processes} over num_machines={machines} is {processes // machines} processes per "
        f"machine, but the target machines have {gpus} GPU(s) each (--gpus-per-machine {gpus}).",
        f"{_in(inp.accelerate_file)}set `num_processes` to {gpus} x num_machines = {gpus * machines} "
        "(it is the total over all machines).",
        {f"{inp.accelerate_file}:num_processes": processes, f"{inp.accelerate_file}:num_machines": machines,
         "--gpus-per-machine": gpus},
    )


@_check
def check_offload_optimizer(inp: CheckInputs) -> Iterator[Finding]:
    """`offload-optimizer-swap`: optimizer offload without a DeepSpeed `optimizer` block while
    `zero_force_ds_cpu_optimizer` is not false (accelerate/HF swap in DeepSpeedCPUAdam, keeping only lr and
    weight_decay; raw DeepSpeed raises)."""
    view = _ds_view(inp)
    if view is None:
        return
    path = "zero_optimization.offload_optimizer.device"
    device = _get(view.config, path, "none")
    if device not in ("cpu", "nvme") or "optimizer" in view.config:
        return
    if view.config.get("zero_force_ds_cpu_optimizer", True) is False:
        return
    file, key = view.where(path)
    raw = inp.runner == "deepspeed"
    yield Finding(
        ERROR if raw else WARNING,
        "offload-optimizer-swap",
        file,
        key,
        f"The optimizer is offloaded to {device} without an `optimizer` block: "
        + (
            "deepspeed.initialize raises for a client optimizer."
            if raw
            else "your optimizer is replaced by DeepSpeedCPUAdam (only lr and weight_decay are kept)."
        ),
        (
            f"{_in(file)}set `{key}: none`, or move the DeepSpeed settings into a JSON file "
            '(`deepspeed_config_file`) with an `optimizer` block or `"zero_force_ds_cpu_optimizer": false` '
            "(an inline deepspeed_config cannot set them)."
            if view.from_yaml
            else f'{_in(file)}add an `optimizer` block, or set `"zero_force_ds_cpu_optimizer": false` '
            f"(`{key}` stays)."
        ),
        {f"{file}:{key}": device},
    )


@_check
def check_nvme_path(inp: CheckInputs) -> Iterator[Finding]:
    """`nvme-without-path`: offload to nvme without `nvme_path`."""
    view = _ds_view(inp)
    if view is None:
        return
    for what in ("offload_optimizer", "offload_param"):
        device_path = f"zero_optimization.{what}.device"
        nvme = _get(view.config, f"zero_optimization.{what}.nvme_path", None)
        if _get(view.config, device_path, None) == "nvme" and nvme in (None, "", "none"):
            file, key = view.where(device_path)
            yield Finding(
                ERROR,
                "nvme-without-path",
                file,
                key,
                f"{what} goes to nvme but no nvme_path is set.",
                f"{_in(file)}set `"
                + (f"deepspeed_config.{what}_nvme_path" if view.from_yaml else f"zero_optimization.{what}.nvme_path")
                + f"` to a local NVMe mount (or `{key}` to cpu).",
                {f"{file}:{key}": "nvme"},
            )


@_check
def check_zero3_save(inp: CheckInputs) -> Iterator[Finding]:
    """`zero3-no-16bit-save` (warning): ZeRO-3 without 16-bit weights gathered on save, in any spelling
    DeepSpeed reads (`stage3_gather_16bit_weights_on_model_save`, `gather_16bit_weights_on_model_save`, the
    deprecated fp16 name; asked from DeepSpeed's own ZeRO model): the saved model is only the sharded
    checkpoint (needs zero_to_fp32.py)."""
    view = _ds_view(inp)
    zero = _get(view.config, "zero_optimization", None) if view is not None else None
    if not isinstance(zero, dict) or zero.get("stage") != 3 or _gathers_16bit_on_save(zero):
        return
    # Name the spelling the file uses (DeepSpeed reads all of them), else the canonical one.
    spelling = next((name for name in _GATHER_SPELLINGS if name in zero), _GATHER_SPELLINGS[0])
    value = zero.get(spelling)
    file, key = view.where("zero_optimization." + spelling)
    # "auto" is filled from the YAML's zero3_save_16bit_model, which defaults to false.
    yield Finding(
        WARNING,
        "zero3-no-16bit-save",
        file,
        key,
        f'ZeRO-3 with this at {value!r} (missing and "auto" mean false): save_model() writes no usable '
        "weights, only the sharded checkpoint (convert it with zero_to_fp32.py).",
        f"{_in(file)}set `{key}` to true.",
        {f"{file}:{key}": value},
    )


# DeepSpeedZeroConfig's field, its alias and the deprecated fp16 name (deepspeed/runtime/zero/config.py).
_GATHER_SPELLINGS = (
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)


def _gathers_16bit_on_save(zero: dict[str, Any]) -> bool:
    """What DeepSpeed's own ZeRO model resolves `gather_16bit_weights_on_model_save` to, from any of its
    spellings ("auto" is dropped by DeepSpeed: false); when the section does not parse (reported by the
    schema check), any spelling set to true counts."""
    import pydantic

    with _deepspeed_off_stdout():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        try:
            return bool(DeepSpeedZeroConfig(**zero).gather_16bit_weights_on_model_save)
        except (pydantic.ValidationError, *_PARSE_ERRORS):
            return any(zero.get(name) is True for name in _GATHER_SPELLINGS)


@_check
def check_multinode(inp: CheckInputs) -> Iterator[Finding]:
    """`multinode-no-main-ip`, `processes-not-multiple-of-machines`, `machine-rank-out-of-range`: the
    multi-node topology (`machine_rank` read as `accelerate launch` reads it: int() of the value)."""
    file, acc = inp.accelerate_file, inp.accelerate
    machines = acc.get("num_machines", 1)
    if not _is_int(machines) or machines <= 1:
        return
    if not acc.get("main_process_ip"):
        yield Finding(
            ERROR,
            "multinode-no-main-ip",
            file,
            "main_process_ip",
            f"num_machines={machines} but main_process_ip is not set: the machines cannot find each other.",
            f"{_in(file)}set `main_process_ip` to the address of machine 0 (and main_process_port).",
            {f"{file}:num_machines": machines, f"{file}:main_process_ip": acc.get("main_process_ip")},
        )
    processes = acc.get("num_processes")
    if _is_int(processes) and processes > 0 and processes % machines:
        yield Finding(
            ERROR,
            "processes-not-multiple-of-machines",
            file,
            "num_processes",
            f"num_processes={processes} is not a multiple of num_machines={machines} "
            "(accelerate's num_processes is the TOTAL over all machines).",
            f"{_in(file)}set `num_processes` to processes-per-machine x {machines}, "
            f"e.g. {machines * max(1, processes // machines)}.",
            {f"{file}:num_processes": processes, f"{file}:num_machines": machines},
        )
    written = acc.get("machine_rank", 0)
    rank = _launch_int(written)
    if rank is None and inp.launch_error is not None:
        return  # accelerate cannot read it at all: `accelerate-launch-fails` says so
    if rank is None or not 0 <= rank < machines:
        yield Finding(
            ERROR,
            "machine-rank-out-of-range",
            file,
            "machine_rank",
            f"machine_rank={written!r} is outside 0..{machines - 1}.",
            f"{_in(file)}set `machine_rank` to 0 on the main machine and 1..{machines - 1} on the others.",
            {f"{file}:machine_rank": written, f"{file}:num_machines": machines},
        )


# Names and networks reserved for documentation and tests, which never reach a real machine: RFC 2606/6761
# top-level domains and example domains, RFC 5737/3849 documentation networks.
_RESERVED_TLDS = ("invalid", "example", "test", "localhost")
_RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
_DOCUMENTATION_NETWORKS = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")


def address_problem(value: Any) -> tuple[str, str] | None:
    """(severity, why) when ``value`` cannot be machine 0's address in a multi-node launch: an error when it
    is no IP address nor DNS name at all, a warning for a placeholder that reaches no other machine."""
    import ipaddress

    from hf_scale.config import host_problem

    if not isinstance(value, str):
        return ERROR, f"is a {type(value).__name__}, not an address (YAML reads an unquoted 1234 as a number)"
    if "$" in value or "{" in value:
        return ERROR, "is not an address: accelerate does not expand variables in its YAML"
    if (problem := host_problem(value)) is not None:
        return ERROR, problem
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified or address.is_loopback:
            return WARNING, "is this machine itself: the other machines would connect to themselves"
        if any(address in ipaddress.ip_network(net) for net in _DOCUMENTATION_NETWORKS):
            return WARNING, "is a documentation address (RFC 5737/3849), a placeholder for the real one"
        return None
    name = value.rstrip(".").lower()
    if name.rsplit(".", 1)[-1] in _RESERVED_TLDS or name.endswith(_RESERVED_DOMAINS):
        return WARNING, "is a reserved placeholder name (RFC 2606/6761) that never reaches machine 0"
    return None


@_check
def check_main_process_ip(inp: CheckInputs) -> Iterator[Finding]:
    """`main-ip-invalid`, `main-ip-placeholder` (warning): `main_process_ip` is no address at all (`'1234'`,
    `${MASTER_ADDR}`, an unquoted number), or, in a multi-node YAML, a placeholder (`main-node.invalid` as
    written by `hf-scale generate`, `*.example`, documentation networks, localhost) a launch must override."""
    file, acc = inp.accelerate_file, inp.accelerate
    machines, value = acc.get("num_machines", 1), acc.get("main_process_ip")
    if value in (None, ""):
        return
    problem = address_problem(value)
    multi_node = _is_int(machines) and machines > 1
    if problem is None or (problem[0] == WARNING and not multi_node):
        return
    severity, why = problem
    yield Finding(
        severity,
        "main-ip-invalid" if severity == ERROR else "main-ip-placeholder",
        file,
        "main_process_ip",
        f"main_process_ip={value!r} {why}; "
        + (
            "`accelerate launch` cannot use it."
            if severity == ERROR
            else f"with num_machines={machines} the launch hangs or fails unless `--main_process_ip` overrides it."
        ),
        f"{_in(file)}set `main_process_ip` to the IP address or DNS name of machine 0, or pass "
        "`--main_process_ip` to `accelerate launch` (hf_scale's launch scripts: MAIN_PROCESS_IP).",
        {f"{file}:main_process_ip": value, f"{file}:num_machines": machines},
    )


def _launch_int(value: Any) -> int | None:
    """`machine_rank` as `accelerate launch` reads it: it calls int() on it (prepare_multi_gpu_env,
    prepare_deepspeed_cmd_env), so a quoted "1" is 1; None when int() fails."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# Types and ranges of the values accelerate and DeepSpeed read: a value of the wrong kind is copied through
# without a complaint and fails (or silently means something else) only at launch.


def _value_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the type annotation ``hint`` of accelerate's ClusterConfig (None if it
    does). Booleans are not numbers; numbers must be finite; None means "accelerate's default"."""
    if value is None:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        problems = [_value_problem(value, arg) for arg in typing.get_args(hint) if arg is not type(None)]
        return None if None in problems else problems[0]
    if typing.get_origin(hint) is list:
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else "must be a list"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return None  # accelerate's own loader checks its enums (`accelerate-config-invalid`)
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if _is_int(value) else "must be an integer"
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else "must be a finite number"
    if hint is str:
        # YAML reads a bare no/yes/on/off as a boolean.
        return None if isinstance(value, str) else "must be a string (quote it)"
    if hint is dict:
        return None if isinstance(value, dict) else "must be a mapping of keys"
    return None


def _range_problem(value: Any, low: float | None, high: float | None) -> str | None:
    if low is not None and value < low:
        return f"must be >= {low}"
    if high is not None and value > high:
        return f"must be <= {high}"
    return None


# What `accelerate launch` needs of these numbers (torchrun gets num_processes // num_machines processes
# per node; a port is 1-65535); ZeRO stages and offload devices are DeepSpeed's ZeroStageEnum and
# OffloadDeviceEnum (tests/test_check.py proves them against DeepSpeed).
ACCELERATE_RANGES = {
    "num_processes": (1, None),
    "num_machines": (1, None),
    "main_process_port": (1, 65535),
    "num_cpu_threads_per_process": (1, None),
    "max_restarts": (0, None),
    "deepspeed_config.zero_stage": (0, 3),
    "deepspeed_config.gradient_accumulation_steps": (1, None),
    "deepspeed_config.gradient_clipping": (0, None),
    "fsdp_config.fsdp_min_num_params": (0, None),
}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)


# Keys judged by their own checks, the way `accelerate launch` reads them: machine_rank is int()ed by accelerate
# (a quoted "1" is fine; `check_multinode`), main_process_ip has `check_main_process_ip`.
_OWN_CHECKS = ("machine_rank", "main_process_ip")


def _accelerate_value_problems(inp: CheckInputs) -> Iterator[tuple[str, Any, str]]:
    """(dotted key, value, problem) for every top-level and `deepspeed_config`/`fsdp_config` value."""
    from accelerate.commands.config.config_args import ClusterConfig

    hints = typing.get_type_hints(ClusterConfig)
    options = {a.dest: a for group in ("DeepSpeed Arguments", "FSDP Arguments", "Resource Selection Arguments",
                                       "Distributed GPUs") for a in _launch_actions(group)}
    # `accelerate config` itself writes this bool as "no"/"yes" (a TPU-only setting): not a finding.
    hints["downcast_bf16"] = bool | str
    for key, value in inp.accelerate.items():
        if key in _OWN_CHECKS:
            continue
        problem = _value_problem(value, hints[key]) if key in hints else None
        yield key, value, problem or _option_problem(key, value, options.get(key))
    for section, prefix in (("deepspeed_config", ""), ("fsdp_config", "fsdp_")):
        values = inp.accelerate.get(section)
        for key, value in values.items() if isinstance(values, dict) else ():
            effective = key if key.startswith(prefix) else prefix + key
            yield f"{section}.{key}", value, _option_problem(f"{section}.{effective}", value, options.get(effective))


def _option_problem(key: str, value: Any, action: Any) -> str | None:
    """``value`` read as the `accelerate launch` option ``action`` (its type and choices) and its range."""
    if value is None or action is None:
        return None
    if action.type is int or action.type is float:
        problem = _value_problem(value, action.type)
        if problem:
            return problem
    elif isinstance(value, dict | list):
        return "must be a single value, not a list or mapping"
    if action.choices and str(value) not in action.choices:
        return f"must be one of {', '.join(map(str, action.choices))}"
    if key.endswith(("offload_optimizer_device", "offload_param_device")) and value not in OFFLOAD_DEVICES:
        return f"must be one of {', '.join(OFFLOAD_DEVICES)}"
    if key == "main_process_ip":
        from hf_scale.config import host_problem

        return host_problem(str(value))
    bounds = ACCELERATE_RANGES.get(key)
    return _range_problem(value, *bounds) if bounds and isinstance(value, int | float) else None


def _launch_actions(group: str) -> list[Any]:
    from accelerate.commands.launch import launch_command_parser

    groups = {g.title: g for g in launch_command_parser()._action_groups}
    return list(groups[group]._group_actions)


@_check
def check_accelerate_values(inp: CheckInputs) -> Iterator[Finding]:
    """`accelerate-value-invalid`: a value of the wrong type or out of range, e.g. `num_processes: two` or
    `0`, `deepspeed_config: hello`, `zero_stage: 5`, a bare `no` where a string belongs (accelerate copies
    it through and fails at launch)."""
    for key, value, problem in _accelerate_value_problems(inp):
        if problem:
            yield Finding(
                ERROR,
                "accelerate-value-invalid",
                inp.accelerate_file,
                key,
                f"`{key}`={value!r} {problem}: `accelerate launch` fails on it or misreads it.",
                f"{_in(inp.accelerate_file)}write `{key}` as a value of the right type and range "
                "(`accelerate config` or `hf-scale generate` writes valid files).",
                {f"{inp.accelerate_file}:{key}": value},
            )


# DeepSpeed JSON numbers: (integer?, lowest, highest). "auto" is judged by `auto-unresolvable`.
DEEPSPEED_RANGES = {
    "train_batch_size": (True, 1, None),
    "train_micro_batch_size_per_gpu": (True, 1, None),
    "gradient_accumulation_steps": (True, 1, None),
    "gradient_clipping": (False, 0, None),
    "steps_per_print": (True, 1, None),
    "optimizer.params.lr": (False, 0, None),
    "optimizer.params.eps": (False, 0, None),
    "optimizer.params.weight_decay": (False, 0, None),
    "fp16.loss_scale": (False, 0, None),
    "fp16.initial_scale_power": (True, 0, 64),
    "fp16.loss_scale_window": (True, 1, None),
    "fp16.hysteresis": (True, 1, None),
    "fp16.min_loss_scale": (False, 0, None),
    "zero_optimization.stage": (True, 0, 3),
}
DEEPSPEED_FLAGS = ("fp16.enabled", "bf16.enabled")
DEEPSPEED_SECTIONS = ("optimizer", "optimizer.params", "scheduler", "scheduler.params", "zero_optimization",
                      "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "fp16", "bf16")
DEEPSPEED_NAMES = ("optimizer.type", "scheduler.type")


def _deepspeed_value_problem(path: str, value: Any) -> str | None:
    if path in DEEPSPEED_SECTIONS:
        return None if isinstance(value, dict) else "must be a mapping of keys"
    if path in DEEPSPEED_NAMES:
        return None if isinstance(value, str) else "must be a name (a string)"
    if path in DEEPSPEED_FLAGS:
        return None if isinstance(value, bool) else "must be true, false or \"auto\""
    if path == "optimizer.params.betas":
        numbers = isinstance(value, list) and len(value) == 2
        numbers = numbers and all(isinstance(b, int | float) and not isinstance(b, bool) for b in value)
        return None if numbers and all(0 <= b < 1 for b in value) else "must be two numbers in [0, 1)"
    integer, low, high = DEEPSPEED_RANGES[path]
    problem = _value_problem(value, int if integer else float)
    return problem or _range_problem(value, low, high)


@_check
def check_deepspeed_values(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-value-invalid`: a batch size, clipping, optimizer or fp16 value of the wrong type or out of
    range in the DeepSpeed JSON, e.g. a negative micro batch (the sample values DeepSpeed's parser sees
    elsewhere would hide it)."""
    if inp.deepspeed is None:
        return
    for path in (*DEEPSPEED_SECTIONS, *DEEPSPEED_NAMES, *DEEPSPEED_RANGES, *DEEPSPEED_FLAGS, "optimizer.params.betas"):
        value = _get(inp.deepspeed, path, None)
        if value is None or (value == "auto" and path not in DEEPSPEED_SECTIONS):
            continue
        problem = _deepspeed_value_problem(path, value)
        if problem:
            yield Finding(
                ERROR,
                "deepspeed-value-invalid",
                inp.deepspeed_file or "",
                path,
                f"`{path}`={value!r} {problem}: DeepSpeed fails on it at start, or trains with it.",
                f'{_in(inp.deepspeed_file or "")}set `{path}` to a valid value, or "auto" where the runner '
                "fills it.",
                {f"{inp.deepspeed_file}:{path}": value},
            )


def run_checks(inp: CheckInputs) -> list[Finding]:
    """Every registered check, in order."""
    return [finding for check in CHECKS for finding in check(inp)]


# --------------------------------------------------------------------------------------------------
# Reading the inputs (the only I/O besides printing)
# --------------------------------------------------------------------------------------------------


def _read_mapping(path: Path, what: str, parse: Callable[[str, str], Any]) -> dict[str, Any]:
    # Strict reading: no FIFO/directory/non-UTF-8, no duplicate keys, no alias bombs, no NaN in JSON.
    data = parse(read_text(path, what), f"{what} {path}")
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise UserError(f"{what} {path}: expected a mapping of keys at the top level, got {got}")
    return data


def _parse_training_args(argv: list[str]) -> dict[str, Any]:
    """Parse with the Trainer's own parser, without constructing TrainingArguments (its __post_init__
    touches devices); flags of train.py itself (``--loop``, ``--hf_scale_config``, model/data flags) are
    tolerated. ``--loop accelerate`` changes nothing here: train.py resolves "auto" like the Trainer."""
    from transformers import HfArgumentParser, TrainingArguments

    class _Parser(HfArgumentParser):
        def error(self, message: str):  # argparse would print usage and exit
            raise UserError(f"training args: {message}")

    namespace, _unknown = _Parser(TrainingArguments).parse_known_args(argv)
    return vars(namespace)


GENERATED_YAML_DIR = "accelerate_configs"
"""`hf-scale generate` writes DIR/accelerate_configs/NAME.yaml naming `ds_configs/NAME.json` relative to DIR, and
its launch scripts run `accelerate launch` from DIR."""


def _resolve_yaml_reference(written: str, yaml_dir: Path, cwd: Path) -> tuple[Path, str | None]:
    """The JSON a relative ``deepspeed_config_file`` names, and a note when a launch could miss it.

    accelerate resolves it relative to the directory `accelerate launch` is started from (what it reads from
    here, when it exists here); a hand-written YAML usually means its own directory; hf-scale's layout means
    the directory holding ``accelerate_configs/``, where its launch scripts start. Notes: ``yaml_dir_only``
    (a launch from here fails), ``cwd_only`` (only a launch from here works), ``layout_only`` (the generated
    scripts work, a launch started here does not); None when the launch from here and the intended one agree."""
    path = Path(written).expanduser()
    if path.is_absolute():
        return path, None
    beside_yaml, from_cwd = yaml_dir / path, cwd / path
    layout_root = yaml_dir.parent if yaml_dir.name == GENERATED_YAML_DIR else None
    from_layout = layout_root / path if layout_root is not None else None
    # exists(), not is_file(): a directory or FIFO there is reported as what it is when it is read.
    if from_cwd.exists():
        intended = beside_yaml.exists() or (from_layout is not None and from_layout.resolve() == from_cwd.resolve())
        return from_cwd, None if intended else "cwd_only"
    if from_layout is not None and from_layout.exists():
        return from_layout, "layout_only"
    if beside_yaml.exists():
        return beside_yaml, "yaml_dir_only"
    searched = f"the YAML's directory ({yaml_dir}) nor the current directory ({cwd})"
    if layout_root is not None:
        searched = f"{layout_root} (where generated launch scripts start), " + searched
    raise UserError(f"deepspeed_config.deepspeed_config_file={written!r}: file not found relative to {searched}")


def _accelerate_launch_env(yaml_path: Path, raw: dict[str, Any]) -> tuple[dict[str, str] | None, str | None]:
    """The environment `accelerate launch --config_file YAML train.py` gives the training processes,
    computed by accelerate's own launch code up to where it would start them (nothing is started), so that
    values are read exactly as accelerate reads them (it int()s a quoted `machine_rank`, not `num_machines`).
    (None, message) when that code refuses the file; (None, None) when it fails for a reason of the machine
    running the check (a port in use here, no FP8 here), which says nothing about the target."""
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    argv = ["--config_file", str(yaml_path)]
    if raw.get("num_processes") in (None, -1):
        argv += ["--num_processes", "1"]  # a template that leaves it to the launch command (SLURM)
    logger = logging.getLogger("accelerate")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = launch_command_parser().parse_args([*argv, "train.py"])
            args, defaults, mp_from_config = _validate_launch_command(parsed)
            if args.use_deepspeed and not args.cpu:  # accelerate.commands.launch.launch_command's dispatch
                fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]
                args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                return launch_utils.prepare_deepspeed_cmd_env(args)[1], None
            if not args.cpu and (args.use_fsdp or args.use_megatron_lm or args.multi_gpu):
                return launch_utils.prepare_multi_gpu_env(args), None
            if args.tpu or raw.get("compute_environment") == "AMAZON_SAGEMAKER":
                return None, None
            return launch_utils.prepare_simple_launcher_cmd_env(args)[1], None
    except (ConnectionError, RuntimeError):  # a port in use here, FP8 not installed here
        return None, None
    except Exception as error:  # noqa: BLE001 -- any refusal of accelerate's code is a finding, never a traceback
        return None, " ".join(f"{type(error).__name__}: {error}".split())
    finally:
        logger.setLevel(level)


def _inline_deepspeed(env: dict[str, str] | None, yaml_file: str) -> dict[str, Any] | None:
    """The DeepSpeed config train.py builds for a YAML with inline `deepspeed_config` (the same function)."""
    from hf_scale.train import inline_deepspeed

    if env is None or not inline_deepspeed.is_inline(env):
        return None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "zero3_init_flag is only applicable for ZeRO Stage 3"
        try:
            inline = inline_deepspeed.plugin_for(env, yaml_file)
        except UserError:
            return None  # a value accelerate's plugin cannot read: the value checks report it
        return copy.deepcopy(inline_deepspeed.deepspeed_config(inline, inline.mixed_precision))


def _display(path: Path, cwd: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(cwd.resolve()))
    return str(path)


def load_inputs(
    accelerate_config: str,
    deepspeed_config: str | None = None,
    training_args: list[str] | tuple[str, ...] = (),
    runner: str = "trainer",
    cwd: Path | None = None,
    gpus_per_machine: int | None = None,
) -> CheckInputs:
    """Read and parse every input; :class:`UserError` when one is unreadable or invalid."""
    if runner not in RUNNERS:
        raise UserError(f"--runner {runner!r} is not one of: {', '.join(RUNNERS)}")
    cwd = cwd or Path.cwd()
    yaml_path = Path(accelerate_config)
    accelerate = _read_mapping(yaml_path, "--accelerate-config", load_yaml)

    from accelerate.commands.config.config_args import load_config_from_file

    loader_error = None
    try:
        load_config_from_file(str(yaml_path))
    except (ValueError, TypeError, KeyError) as error:
        loader_error = " ".join(str(error).split())
    launch_env, launch_error = None, None
    if loader_error is None:
        launch_env, launch_error = _accelerate_launch_env(yaml_path, accelerate)

    training = _parse_training_args(list(training_args)) if training_args else None

    refs: list[tuple[str, str, str]] = []  # (file:key, as written, resolved)
    chosen: Path | None = None
    path_note = None
    if deepspeed_config is not None:
        chosen = Path(deepspeed_config)
        refs.append(("--deepspeed-config", deepspeed_config, str(chosen.resolve())))
    written = _get(accelerate, "deepspeed_config.deepspeed_config_file", None)
    if isinstance(written, str) and written:
        resolved, path_note = _resolve_yaml_reference(written, yaml_path.resolve().parent, cwd)
        refs.append(
            (f"{accelerate_config}:deepspeed_config.deepspeed_config_file", written, str(resolved.resolve()))
        )
        chosen = chosen or resolved
    if training and training.get("deepspeed"):
        flag_path = Path(training["deepspeed"])
        if not flag_path.is_absolute():
            flag_path = cwd / flag_path
        refs.append((f"{TRAINING_ARGS}:--deepspeed", training["deepspeed"], str(flag_path.resolve())))
        chosen = chosen or flag_path

    deepspeed = _read_mapping(chosen, "DeepSpeed config", load_json) if chosen is not None else None
    return CheckInputs(
        runner=runner,
        accelerate_file=accelerate_config,
        accelerate=accelerate,
        accelerate_loader_error=loader_error,
        deepspeed_file=_display(chosen, cwd) if chosen is not None else None,
        deepspeed=deepspeed,
        deepspeed_refs=tuple(refs),
        deepspeed_path_note=path_note,
        training=training,
        training_argv=tuple(training_args),
        gpus_per_machine=gpus_per_machine,
        launch_env=launch_env,
        launch_error=launch_error,
        inline_deepspeed=_inline_deepspeed(launch_env, accelerate_config),
    )


# --------------------------------------------------------------------------------------------------
# Output and CLI
# --------------------------------------------------------------------------------------------------


def summarize(inp: CheckInputs, findings: list[Finding]) -> dict[str, Any]:
    errors = sum(f.severity == ERROR for f in findings)
    files = [inp.accelerate_file] + ([inp.deepspeed_file] if inp.deepspeed_file else [])
    if inp.training is not None:
        files.append(TRAINING_ARGS)
    return {
        "errors": errors,
        "warnings": len(findings) - errors,
        "checked": files,
        "runner": inp.runner,
        "exit_code": 1 if errors else 0,
    }


def summary_line(summary: dict[str, Any]) -> str:
    counts = f"{summary['errors']} error(s), {summary['warnings']} warning(s)"
    verdict = "problems found" if summary["errors"] else ("ok with warnings" if summary["warnings"] else "ok")
    return f"{verdict}: {counts} in {', '.join(summary['checked'])} (runner: {summary['runner']})"


def _wrap_at_separators(text: str, width: int) -> list[str]:
    """Wrap a file:dotted.key after ``/``, ``:`` or ``.`` instead of in the middle of a name."""
    lines = [""]
    for token in re.split(r"(?<=[:./])", text):
        if lines[-1] and len(lines[-1]) + len(token) > width:
            lines.append("")
        lines[-1] += token
    return [piece[i : i + width] for piece in lines for i in range(0, len(piece), width)]


def format_table(findings: list[Finding], width: int) -> str:
    """Columns severity | code | where | problem | fix; long cells wrap inside their column."""
    headers = ("SEVERITY", "CODE", "WHERE (FILE:KEY)", "PROBLEM", "FIX")
    rows = [(f.severity, f.code, f.where, f.problem, f.fix) for f in findings]
    fixed = [max([len(headers[i])] + [len(r[i]) for r in rows]) for i in (0, 1)]
    where = min(36, max([len(headers[2])] + [len(r[2]) for r in rows]))
    rest = max(40, width - sum(fixed) - where - 8)
    widths = [*fixed, where, rest // 2, rest - rest // 2]
    lines = []
    for row in [headers, *rows]:
        cells = [
            _wrap_at_separators(text, w) if column == 2 else textwrap.wrap(text, w, break_on_hyphens=False)
            for column, (text, w) in enumerate(zip(row, widths, strict=True))
        ]
        for n in range(max(map(len, cells))):
            parts = [
                (cell[n] if n < len(cell) else "").ljust(w) for cell, w in zip(cells, widths, strict=True)
            ]
            lines.append("  ".join(parts).rstrip())
        if row is headers:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_doc(fn: Check) -> tuple[str, str]:
    """(heading, description) of a check: its docstring reads "`code`, `code` (warning): what it finds"."""
    heading, text = " ".join((fn.__doc__ or "").split()).split(": ", 1)
    return heading.replace("`", ""), text


def check_codes(fn: Check) -> list[str]:
    """The finding codes a check emits (named in its docstring's heading)."""
    return re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)+", check_doc(fn)[0])


def _epilog() -> str:
    lines = []
    for fn in CHECKS:
        heading, text = check_doc(fn)
        lines.append("  " + heading)
        lines += textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      ")
    checks = "\n".join(lines)
    return f"""\
runners (which "auto" values in the DeepSpeed JSON get filled in):
  trainer      HF Trainer (default; also hf_scale's train.py with --loop accelerate)
  accelerate   a hand-written Accelerator loop: fills batch sizes, gradient_clipping,
               bucket sizes, DummyOptim lr/weight_decay, DummyScheduler values, fp16/bf16
  deepspeed    raw deepspeed.initialize: fills nothing

finding codes:
{checks}

exit codes: 0 no errors (warnings are printed but do not fail), 1 errors found,
            2 unreadable/invalid input

The DeepSpeed JSON is --deepspeed-config, else the YAML's deepspeed_config.deepspeed_config_file
(relative to the YAML's directory, then the current one), else --deepspeed in the training args.
A YAML with its DeepSpeed settings inline (no deepspeed_config_file) is checked as the config
accelerate's DeepSpeedPlugin builds from it, which is also what train.py trains with.
Training args after `--` are parsed like the Trainer does (unknown flags are ignored).
GPU findings need --gpus-per-machine N (GPUs per machine on the target); this machine's GPUs are never used.

example:
  hf-scale check --accelerate-config accelerate_configs/zero3.yaml \\
      -- --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --bf16
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        description="Read an existing accelerate YAML (and its DeepSpeed JSON and the training args) and "
        "report every inconsistency before a job starts: a table (or --json) of findings, each with a "
        "severity, a code, the file:key, the disagreeing values and the fix.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--accelerate-config", metavar="A.yaml", help="accelerate config file (required)")
    parser.add_argument(
        "--deepspeed-config",
        metavar="D.json",
        help="DeepSpeed JSON (default: the one the YAML or --deepspeed in the training args names)",
    )
    parser.add_argument(
        "--runner",
        default="trainer",
        metavar="|".join(RUNNERS),
        help='what resolves "auto" in the DeepSpeed JSON (default: trainer)',
    )
    parser.add_argument(
        "--gpus-per-machine",
        "--gpus",
        dest="gpus_per_machine",
        type=int,
        metavar="N",
        help="GPUs per machine on the target cluster; enables the GPU findings (default: no assumption "
        "about GPUs; the machine running the check is never looked at)",
    )
    parser.add_argument("--json", action="store_true", help="print {findings: [...], summary: {...}} as JSON")
    parser.add_argument(
        "training_args",
        nargs="*",
        metavar="-- TRAINING-ARGS",
        help="the training script's arguments (TrainingArguments flags), after `--`",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.accelerate_config:
        raise UserError("check: --accelerate-config A.yaml is required")
    if args.gpus_per_machine is not None and args.gpus_per_machine < 0:
        raise UserError(
            f"--gpus-per-machine {args.gpus_per_machine}: must be >= 0 (GPUs per machine on the target)"
        )
    inputs = load_inputs(
        args.accelerate_config,
        args.deepspeed_config,
        args.training_args,
        args.runner,
        gpus_per_machine=args.gpus_per_machine,
    )
    findings = run_checks(inputs)
    summary = summarize(inputs, findings)
    if args.json:
        payload = {"findings": [{**asdict(f), "where": f.where} for f in findings], "summary": summary}
        print(json.dumps(payload, indent=2, default=str))
    else:
        if findings:
            print(format_table(findings, shutil.get_terminal_size((150, 24)).columns))
            print()
        print(summary_line(summary))
    return summary["exit_code"]
