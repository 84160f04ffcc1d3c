"""Checks of the DeepSpeed JSON on its own: "auto" values the runner cannot fill, keys and values DeepSpeed's
parser refuses or never reads, numbers out of range.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hf_scale.check.accelerate_yaml import range_problem, value_problem
from hf_scale.check.findings import ERROR, WARNING, Finding, ignored_key_severity, in_file, is_comment_key, rename_fix
from hf_scale.check.inputs import CheckInputs
from hf_scale.files.reading import get_path
from hf_scale.knowledge import deepspeed_changes
from hf_scale.knowledge.library_tables import (
    BATCH_KEYS,
    CONTEXT_SECTIONS,
    PARSE_ERRORS,
    TRAINER_RESOLVED_ZERO3_ONLY,
    ReadTracker,
    auto_paths,
    deepspeed_off_stdout,
    pydantic_names,
    resolvable,
    section_errors,
    with_sample_values,
)


def check_auto_values(inp: CheckInputs) -> Iterator[Finding]:
    """`auto-unresolvable`: "auto" values the chosen runner cannot fill in (one finding per key)."""
    if inp.deepspeed is None:
        return
    for path in auto_paths(inp.deepspeed):
        if not resolvable(inp.runner, path, inp.deepspeed):
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
                f"{in_file(inp.deepspeed_file or '')}write a concrete value for `{path}` (`hf-scale generate` "
                "writes a resolved JSON for this runner).",
                {f"{inp.deepspeed_file}:{path}": "auto"},
            )


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
    sample = with_sample_values(inp.deepspeed)
    for change in deepspeed_changes.removed_keys(sample):  # `deepspeed-key-removed`, each one (DeepSpeed: the first)
        section, _, key = change.path.rpartition(".")
        del (sample[section] if section else sample)[key]
    with deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

        clean = [k for k in CONTEXT_SECTIONS if k in sample and section_errors(sample, k) == ([], None, None)]
        context = {k: sample[k] for k in clean}
        for key in [k for k in sample if k not in BATCH_KEYS]:
            items, model, message = section_errors(sample, key, context)
            for item in items:
                yield _schema_finding(file, inp.deepspeed, key, item, model)
            if message is not None:
                yield Finding(
                    ERROR,
                    "deepspeed-config-invalid",
                    file,
                    key,
                    f"DeepSpeed refuses `{key}`: {message}",
                    f"{in_file(file)}fix `{key}` as DeepSpeed says.",
                    {f"{file}:{key}": inp.deepspeed.get(key)},
                )
            if items or message is not None:
                del sample[key]  # reported: parse the rest without it
        tracked = ReadTracker(sample)
        try:
            DeepSpeedConfig(tracked)
        except (DeepSpeedConfigError, pydantic.ValidationError, *PARSE_ERRORS) as error:
            yield Finding(
                ERROR,
                "deepspeed-config-invalid",
                file,
                "(file)",
                f"DeepSpeed refuses the config: {' '.join(str(error).split())}",
                f"{in_file(file)}fix the value DeepSpeed names.",
            )
            return
    for key in inp.deepspeed:
        if key in sample and key not in tracked.read and not is_comment_key(key):
            yield Finding(
                ignored_key_severity(key, tracked.read),
                "unknown-deepspeed-key",
                file,
                key,
                "DeepSpeed never reads this top-level key: ignored without a warning.",
                rename_fix(key, tracked.read, "DeepSpeed config key", file),
                {f"{file}:{key}": inp.deepspeed[key]},
            )


def check_deepspeed_changes(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-key-removed`, `deepspeed-warmup-refused`: what a DeepSpeed release refuses at start in a config that
    ran before (hf_scale.knowledge.deepspeed_changes): a removed key (`amp`, `elasticity`, `sparse_attention`, MiCS,
    ...), a warmup scheduler with `warmup_num_steps` 0. An error where the installed DeepSpeed refuses it, a warning
    where it is older (the cluster's install will)."""
    if inp.deepspeed is None:
        return
    file = inp.deepspeed_file or ""
    for change in deepspeed_changes.removed_keys(inp.deepspeed):
        yield Finding(ERROR if change.applies_here else WARNING, "deepspeed-key-removed", file, change.path,
                      f"{change.describe()}.", f"{in_file(file)}remove `{change.path}`.",
                      {f"{file}:{change.path}": get_path(inp.deepspeed, change.path, None)})
    change = deepspeed_changes.warmup_refused(inp.deepspeed)
    if change is not None:
        yield Finding(ERROR if change.applies_here else WARNING, "deepspeed-warmup-refused", file, change.path,
                      f"{change.describe()}.", f'{in_file(file)}set `{change.path}` to 1 or more, or "auto" (the '
                      "Trainer fills it from --warmup_steps, at least 1).",
                      {f"{file}:{change.path}": get_path(inp.deepspeed, change.path, None)})


def _schema_finding(file: str, ds: dict[str, Any], key: str, item: dict[str, Any], model: Any) -> Finding:
    """A pydantic error raised by ``model`` while parsing the top-level section ``key``."""
    relative = tuple(str(part) for part in item["loc"])  # relative to `model`
    loc = relative if relative and relative[0] == key else (key, *relative)
    path = ".".join(loc)
    value = get_path(ds, path, None)
    if item["type"] == "extra_forbidden":
        names = pydantic_names(model, relative[:-1]) if model is not None else set()
        problem = "Not a key of this DeepSpeed section: DeepSpeed refuses the config."
        if is_comment_key(loc[-1]):
            problem = "DeepSpeed's sections refuse any key they do not define, comments included."
        return Finding(
            ERROR,
            "unknown-deepspeed-key",
            file,
            path,
            problem,
            rename_fix(loc[-1], names, f"key of `{'.'.join(loc[:-1])}`", file),
            {f"{file}:{path}": value},
        )
    return Finding(
        ERROR,
        "deepspeed-config-invalid",
        file,
        path,
        f"DeepSpeed refuses `{path}`={value!r}: {item['msg']}.",
        f"{in_file(file)}set `{path}` to a value DeepSpeed accepts.",
        {f"{file}:{path}": value},
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
    problem = value_problem(value, int if integer else float)
    return problem or range_problem(value, low, high)


def check_deepspeed_values(inp: CheckInputs) -> Iterator[Finding]:
    """`deepspeed-value-invalid`: a batch size, clipping, optimizer or fp16 value of the wrong type or out of
    range in the DeepSpeed JSON, e.g. a negative micro batch (the sample values DeepSpeed's parser sees
    elsewhere would hide it)."""
    if inp.deepspeed is None:
        return
    for path in (*DEEPSPEED_SECTIONS, *DEEPSPEED_NAMES, *DEEPSPEED_RANGES, *DEEPSPEED_FLAGS, "optimizer.params.betas"):
        value = get_path(inp.deepspeed, path, None)
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
                f'{in_file(inp.deepspeed_file or "")}set `{path}` to a valid value, or "auto" where the runner '
                "fills it.",
                {f"{inp.deepspeed_file}:{path}": value},
            )
