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
    """How the YAML's relative ``deepspeed_config_file`` resolves: ``yaml_dir_only`` / ``cwd_only`` / None."""
    training: dict[str, Any] | None = None
    """Parsed ``TrainingArguments`` fields (defaults included) when training args were given."""
    training_argv: tuple[str, ...] = ()
    gpu_count: int = 0


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


def _closest(name: str, known: Any) -> str | None:
    matches = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _rename_fix(name: str, known: Any, what: str) -> str:
    suggestion = _closest(name, known)
    if suggestion:
        return f"Rename `{name}` to `{suggestion}` (the closest {what})."
    return f"Remove `{name}`; it is not a {what}."


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


def _disagreement(code: str, what: str, sources: list[_Source], fix: str) -> Iterator[Finding]:
    """One error when the known values of the same setting differ."""
    if len({repr(s.value) for s in sources}) > 1:
        listing = ", ".join(f"{s.label}={s.value!r}" for s in sources)
        yield Finding(
            ERROR,
            code,
            sources[0].file,
            sources[0].key,
            f"{what} disagrees: {listing}.",
            fix,
            {s.where: s.value for s in sources},
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
        annotation = model.model_fields[part].annotation
        candidates = [annotation, *typing.get_args(annotation)]
        model = next(c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel))
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
            _rename_fix(key, known, "accelerate config key"),
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
            "Fix the value accelerate names (regenerate with `accelerate config` or `hf-scale generate`).",
        )


@_check
def check_accelerate_nested_keys(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-accelerate-key`: misspelled/unknown keys under `deepspeed_config` / `fsdp_config`
    (accelerate copies them onto its launch arguments silently, so they have no effect)."""
    for section, prefix in (("deepspeed_config", ""), ("fsdp_config", "fsdp_")):
        values = inp.accelerate.get(section)
        if not isinstance(values, dict):
            continue
        known = known_section_keys(section)
        for key, value in values.items():
            # accelerate prefixes fsdp_config keys with "fsdp_" when they lack it (_validate_launch_command).
            effective = key if key.startswith(prefix) else prefix + key
            if effective not in known:
                yield Finding(
                    ERROR,
                    "unknown-accelerate-key",
                    inp.accelerate_file,
                    f"{section}.{key}",
                    "Not an option accelerate reads: ignored without a warning.",
                    _rename_fix(effective, known, f"`{section}` key"),
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
            "Write an absolute path, or a path relative to the directory you launch from.",
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
            "Write an absolute path, or always launch from this directory.",
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
                "Point both at the same JSON file.",
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
        "Set `distributed_type: DEEPSPEED` with `deepspeed_config.deepspeed_config_file`, or pass "
        "`--deepspeed FILE` in the training args.",
        {f"{inp.accelerate_file}:distributed_type": dtype},
    )


@_check
def check_duplicated_deepspeed_keys(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-key-duplicated`: the YAML sets keys next to `deepspeed_config_file` that accelerate refuses at
    launch ("the following accelerate config variables will be ignored")."""
    section = inp.accelerate.get("deepspeed_config")
    if not _is_deepspeed_yaml(inp) or not isinstance(section, dict) or "deepspeed_config_file" not in section:
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
            "Set next to `deepspeed_config_file`: accelerate raises at launch (with a JSON file it "
            "takes this setting only from the JSON).",
            f"Delete `{yaml_key}` from the YAML and set `{ds_path}` in the DeepSpeed JSON.",
            values,
        )


@_check
def check_gradient_accumulation(inp: CheckInputs) -> Iterator[Finding]:
    """`grad-accum-mismatch`: gradient accumulation differs between the YAML, the JSON and the training
    args."""
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
    yield from _disagreement(
        "grad-accum-mismatch",
        "gradient_accumulation_steps",
        sources,
        'Keep one value: set it in the training args and "auto" in the DeepSpeed JSON '
        "(drop it from the YAML).",
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
        'Set `train_micro_batch_size_per_gpu` to "auto" (the Trainer fills it) or to the same number.',
    )


@_check
def check_train_batch_size(inp: CheckInputs) -> Iterator[Finding]:
    """`train-batch-mismatch`: `train_batch_size` != micro batch x accumulation x world size (world size is
    the YAML's `num_processes`, the total over all machines)."""
    total = _get(inp.deepspeed, "train_batch_size")
    world = _world_size(inp)
    if not _is_int(total) or world is None:
        return
    training = inp.training if inp.runner == "trainer" else None
    micro = _get(inp.deepspeed, "train_micro_batch_size_per_gpu")
    if not _is_int(micro) and training is not None:
        micro = training["per_device_train_batch_size"]
    accum = _get(inp.deepspeed, "gradient_accumulation_steps")
    if not _is_int(accum):
        accum = (
            training["gradient_accumulation_steps"]
            if training is not None
            else _get(inp.accelerate, "deepspeed_config.gradient_accumulation_steps", None)
        )
    values = {f"{inp.deepspeed_file}:train_batch_size": total, f"{inp.accelerate_file}:num_processes": world}
    if _is_int(micro) and _is_int(accum):
        if total != micro * accum * world:
            yield Finding(
                ERROR,
                "train-batch-mismatch",
                inp.deepspeed_file or "",
                "train_batch_size",
                f"train_batch_size={total} but micro batch x accumulation x world size = "
                f"{micro} x {accum} x {world} = {micro * accum * world} (DeepSpeed asserts at start).",
                f'Set train_batch_size to {micro * accum * world}, or to "auto".',
                {**values, "micro_batch": micro, "gradient_accumulation_steps": accum},
            )
    elif _is_int(accum) and total % (accum * world):
        yield Finding(
            ERROR,
            "train-batch-mismatch",
            inp.deepspeed_file or "",
            "train_batch_size",
            f"train_batch_size={total} is not divisible by accumulation x world size = {accum} x {world}, "
            "so DeepSpeed cannot derive a micro batch size.",
            f"Use a multiple of {accum * world}.",
            {**values, "gradient_accumulation_steps": accum},
        )


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
    ask for different precisions."""
    wanted, explicit = _precision_sources(inp)
    fix = (
        'Pick one precision; in the DeepSpeed JSON set `"enabled": "auto"` so it follows the other settings.'
    )
    yield from _disagreement("precision-mismatch", "mixed precision", wanted, fix)
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
                    fix,
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
            "Enable one of them (bf16 on Ampere+).",
            {s.where: s.value for s in explicit.values()},
        )
    if inp.training is not None and inp.training["fp16"] and inp.training["bf16"]:
        yield Finding(
            ERROR,
            "fp16-and-bf16",
            TRAINING_ARGS,
            "--fp16/--bf16",
            "Both --fp16 and --bf16 are given; TrainingArguments refuses this.",
            "Pass only one of them.",
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
                "Write a concrete value (`hf-scale generate` writes a resolved JSON for this runner).",
                {f"{inp.deepspeed_file}:{path}": "auto"},
            )


@_check
def check_deepspeed_schema(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-deepspeed-key`, `deepspeed-config-invalid`: DeepSpeed's own parser (after "auto" -> sample
    values) rejects a key, or never reads a top-level key (DeepSpeed ignores it silently)."""
    if inp.deepspeed is None:
        return
    import pydantic

    file = inp.deepspeed_file or ""
    sample = _with_sample_values(inp.deepspeed)
    with _deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config

        if isinstance(sample.get("zero_optimization"), dict):
            try:
                get_zero_config(sample)
            except pydantic.ValidationError as error:
                for item in error.errors():
                    loc = tuple(str(part) for part in item["loc"])
                    yield _zero_finding(file, inp.deepspeed, loc, item, DeepSpeedZeroConfig)
                    # Drop the bad key so that DeepSpeedConfig below can still report everything else.
                    _drop(sample["zero_optimization"], loc)
        tracked = _ReadTracker(sample)
        try:
            DeepSpeedConfig(tracked)
        except (
            DeepSpeedConfigError,
            pydantic.ValidationError,
            AssertionError,
            ValueError,
            TypeError,
            KeyError,
            AttributeError,  # e.g. an `optimizer` that is not a mapping: DeepSpeed calls .keys() on it
        ) as error:
            yield Finding(
                ERROR,
                "deepspeed-config-invalid",
                file,
                "(file)",
                f"DeepSpeed refuses the config: {' '.join(str(error).split())}",
                "Fix the value DeepSpeed names.",
            )
            return
    for key in inp.deepspeed:
        if key not in tracked.read:
            yield Finding(
                ERROR,
                "unknown-deepspeed-key",
                file,
                key,
                "DeepSpeed never reads this top-level key: ignored without a warning.",
                _rename_fix(key, tracked.read, "DeepSpeed config key"),
                {f"{file}:{key}": inp.deepspeed[key]},
            )


def _zero_finding(
    file: str, ds: dict[str, Any], loc: tuple[str, ...], item: dict[str, Any], zero_model: Any
) -> Finding:
    path = "zero_optimization." + ".".join(loc)
    value = _get(ds, path, None)
    if item["type"] == "extra_forbidden":
        return Finding(
            ERROR,
            "unknown-deepspeed-key",
            file,
            path,
            "Not a DeepSpeed ZeRO key: DeepSpeed refuses the config.",
            _rename_fix(loc[-1], _pydantic_names(zero_model, loc[:-1]), "DeepSpeed ZeRO key"),
            {f"{file}:{path}": value},
        )
    return Finding(
        ERROR,
        "deepspeed-config-invalid",
        file,
        path,
        f"DeepSpeed refuses `{path}`={value!r}: {item['msg']}.",
        "Use a value DeepSpeed accepts.",
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
            "Set `use_cpu: false` for GPUs, or `num_processes: 1`; several CPU processes need "
            "`mpirun_config.mpirun_hostfile` (or torchrun with a gloo backend).",
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
        f"Drop {flag} to use the GPUs, or set num_processes: 1.",
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
            "Set `use_cpu: false` (FSDP through accelerate needs GPUs).",
            {f"{inp.accelerate_file}:use_cpu": True, f"{inp.accelerate_file}:distributed_type": dtype},
        )


@_check
def check_fsdp_without_gpu(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp-no-gpu` (warning): FSDP while this machine reports no GPU (fine on a login node)."""
    if inp.accelerate.get("distributed_type") == "FSDP" and inp.gpu_count == 0:
        yield Finding(
            WARNING,
            "fsdp-no-gpu",
            inp.accelerate_file,
            "distributed_type",
            "FSDP through accelerate needs GPUs and this machine reports none: here it would run without "
            "sharding or gradient sync.",
            "Ignore this on a login node; on the training machine check that the GPUs are visible.",
            {f"{inp.accelerate_file}:distributed_type": "FSDP", "torch.cuda.device_count()": 0},
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
        'Add an `optimizer` block to the DeepSpeed JSON, or set `"zero_force_ds_cpu_optimizer": false`.',
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
                f"Set `zero_optimization.{what}.nvme_path` (accelerate YAML: `{what}_nvme_path`) to a local "
                "NVMe mount.",
                {f"{file}:{key}": "nvme"},
            )


@_check
def check_zero3_save(inp: CheckInputs) -> Iterator[Finding]:
    """`zero3-no-16bit-save` (warning): ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`: the saved
    model is only the sharded checkpoint (needs zero_to_fp32.py)."""
    view = _ds_view(inp)
    if view is None or _get(view.config, "zero_optimization.stage", None) != 3:
        return
    path = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    legacy = _get(view.config, "zero_optimization.stage3_gather_fp16_weights_on_model_save", None)
    value = _get(view.config, path, None)
    if value is True or legacy is True:
        return
    file, key = view.where(path)
    # "auto" is filled from the YAML's zero3_save_16bit_model, which defaults to false.
    yield Finding(
        WARNING,
        "zero3-no-16bit-save",
        file,
        key,
        f'ZeRO-3 with this at {value!r} (missing and "auto" mean false): save_model() writes no usable '
        "weights, only the sharded checkpoint (convert it with zero_to_fp32.py).",
        f"Set `{key}` to true.",
        {f"{file}:{key}": value},
    )


@_check
def check_multinode(inp: CheckInputs) -> Iterator[Finding]:
    """`multinode-no-main-ip`, `processes-not-multiple-of-machines`, `machine-rank-out-of-range`: the
    multi-node topology."""
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
            "Set main_process_ip to the address of machine 0 (and main_process_port).",
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
            f"Set num_processes to processes-per-machine x {machines}, "
            f"e.g. {machines * max(1, processes // machines)}.",
            {f"{file}:num_processes": processes, f"{file}:num_machines": machines},
        )
    rank = acc.get("machine_rank", 0)
    if not _is_int(rank) or not 0 <= rank < machines:
        yield Finding(
            ERROR,
            "machine-rank-out-of-range",
            file,
            "machine_rank",
            f"machine_rank={rank!r} is outside 0..{machines - 1}.",
            f"Use 0 on the main machine and 1..{machines - 1} on the others.",
            {f"{file}:machine_rank": rank, f"{file}:num_machines": machines},
        )


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
    "machine_rank": (0, None),
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


def _accelerate_value_problems(inp: CheckInputs) -> Iterator[tuple[str, Any, str]]:
    """(dotted key, value, problem) for every top-level and `deepspeed_config`/`fsdp_config` value."""
    from accelerate.commands.config.config_args import ClusterConfig

    hints = typing.get_type_hints(ClusterConfig)
    options = {a.dest: a for group in ("DeepSpeed Arguments", "FSDP Arguments", "Resource Selection Arguments",
                                       "Distributed GPUs") for a in _launch_actions(group)}
    # `accelerate config` itself writes this bool as "no"/"yes" (a TPU-only setting): not a finding.
    hints["downcast_bf16"] = bool | str
    for key, value in inp.accelerate.items():
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
                "Write a value of the right type and range (`accelerate config` or `hf-scale generate` writes "
                "valid files).",
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
                'Write a valid value, or "auto" where the runner fills it.',
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


def _resolve_yaml_reference(written: str, yaml_dir: Path, cwd: Path) -> tuple[Path, str | None]:
    """accelerate resolves ``deepspeed_config_file`` relative to the directory it is launched from; a
    hand-written YAML usually means its own directory. Prefer the YAML's directory; say when only one
    works."""
    path = Path(written).expanduser()
    if path.is_absolute():
        return path, None
    beside_yaml, from_cwd = yaml_dir / path, cwd / path
    # exists(), not is_file(): a directory or FIFO there is reported as what it is when it is read.
    if beside_yaml.exists() and from_cwd.exists():
        return beside_yaml, None
    if beside_yaml.exists():
        return beside_yaml, "yaml_dir_only"
    if from_cwd.exists():
        return from_cwd, "cwd_only"
    raise UserError(
        f"deepspeed_config.deepspeed_config_file={written!r}: file not found relative to the YAML's "
        f"directory ({yaml_dir}) nor the current directory ({cwd})"
    )


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
    gpu_count: int = 0,
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
        gpu_count=gpu_count,
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
Training args after `--` are parsed like the Trainer does (unknown flags are ignored).

example:
  hf-scale check --accelerate-config accelerate_configs/zero3.yaml \\
      -- --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --bf16
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="report inconsistencies between an accelerate YAML, a DeepSpeed JSON and training args",
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
    import torch

    inputs = load_inputs(
        args.accelerate_config,
        args.deepspeed_config,
        args.training_args,
        args.runner,
        gpu_count=torch.cuda.device_count(),
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
