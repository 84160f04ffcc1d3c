"""Checks of the accelerate YAML on its own: keys accelerate's loader refuses or ignores, values of the wrong
type or range, and what `accelerate launch`'s own code fails on.
"""

from __future__ import annotations

import enum
import math
import types
import typing
from collections.abc import Iterator
from typing import Any

from hf_scale.check.findings import (
    ERROR,
    WARNING,
    Finding,
    ignored_key_severity,
    in_file,
    is_comment_key,
    is_int,
    rename_fix,
)
from hf_scale.check.inputs import CheckInputs, fsdp_version_of
from hf_scale.knowledge.library_tables import OFFLOAD_DEVICES, accelerate_config_fields, known_section_keys


def check_accelerate_top_level(inp: CheckInputs) -> Iterator[Finding]:
    """`unknown-accelerate-key`, `accelerate-config-invalid`: accelerate's loader rejects the YAML."""
    known = accelerate_config_fields(inp.accelerate)
    unknown = [key for key in inp.accelerate if key not in known]
    for key in unknown:
        yield Finding(
            ERROR,
            "unknown-accelerate-key",
            inp.accelerate_file,
            key,
            "Not an accelerate config key: `accelerate launch` refuses the file.",
            rename_fix(key, known, "accelerate config key", inp.accelerate_file),
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
            f"{in_file(inp.accelerate_file)}fix the value accelerate names (or regenerate the file with "
            "`accelerate config` or `hf-scale generate`).",
        )


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
        f"{in_file(inp.accelerate_file)}write the value accelerate cannot use as a plain number/string of the "
        "type `accelerate config` writes.",
    )


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
                    ignored_key_severity(effective, known),
                    "unknown-accelerate-key",
                    inp.accelerate_file,
                    f"{section}.{key}",
                    "Not an option accelerate reads: ignored without a warning.",
                    rename_fix(effective, known, f"`{section}` key", inp.accelerate_file),
                    {f"{inp.accelerate_file}:{section}.{key}": value},
                )


FSDP1_ONLY = ("fsdp_forward_prefetch",)
"""fsdp_config keys accelerate's FSDP plugin reads from the launch environment only under FSDP1
(FullyShardedDataParallelPlugin.__post_init__: forward_prefetch is read `if ... fsdp_version == 1`); under FSDP2 the
exported value is dropped without a word."""


def check_fsdp2_ignored(inp: CheckInputs) -> Iterator[Finding]:
    """`fsdp2-option-ignored`: an FSDP1-only option turned on under `fsdp_version: 2`, e.g.
    `fsdp_forward_prefetch: true` (FSDP2 does not implement it; accelerate ignores it silently)."""
    section = inp.accelerate.get("fsdp_config")
    if fsdp_version_of(inp) != 2 or not isinstance(section, dict):
        return
    for key, value in section.items():
        effective = key if key.startswith("fsdp_") else f"fsdp_{key}"
        if effective in FSDP1_ONLY and str(value).lower() == "true":
            yield Finding(WARNING, "fsdp2-option-ignored", inp.accelerate_file, f"fsdp_config.{key}",
                          f"`fsdp_config.{key}`: {value!r} under fsdp_version 2: FSDP2 does not implement it and "
                          "accelerate drops it without a warning (the run trains without it).",
                          f"{in_file(inp.accelerate_file)}remove `{key}` (or set `fsdp_version: 1` if you need it).",
                          {f"{inp.accelerate_file}:fsdp_config.{key}": value})


def launch_int(value: Any) -> int | None:
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
def value_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the type annotation ``hint`` of accelerate's ClusterConfig (None if it
    does). Booleans are not numbers; numbers must be finite; None means "accelerate's default"."""
    if value is None:
        return None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        problems = [value_problem(value, arg) for arg in typing.get_args(hint) if arg is not type(None)]
        return None if None in problems else problems[0]
    if typing.get_origin(hint) is list:
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else "must be a list"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return None  # accelerate's own loader checks its enums (`accelerate-config-invalid`)
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        return None if is_int(value) else "must be an integer"
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else "must be a finite number"
    if hint is str:
        # YAML reads a bare no/yes/on/off as a boolean.
        return None if isinstance(value, str) else "must be a string (quote it)"
    if hint is dict:
        return None if isinstance(value, dict) else "must be a mapping of keys"
    return None


def range_problem(value: Any, low: float | None, high: float | None) -> str | None:
    if low is not None and value < low:
        return f"must be >= {low}"
    if high is not None and value > high:
        return f"must be <= {high}"
    return None


# What `accelerate launch` needs of these numbers (torchrun gets num_processes // num_machines processes
# per node; a port is 1-65535); ZeRO stages and offload devices are DeepSpeed's ZeroStageEnum and
# OffloadDeviceEnum (tests/knowledge/test_library_tables.py proves them against DeepSpeed).
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
        if key == "num_processes" and value == "auto":
            yield key, value, _auto_processes_problem(inp.accelerate.get("num_machines", 1))
            continue
        problem = value_problem(value, hints[key]) if key in hints else None
        yield key, value, problem or _option_problem(key, value, options.get(key))
    for section, prefix in (("deepspeed_config", ""), ("fsdp_config", "fsdp_")):
        values = inp.accelerate.get(section)
        for key, value in values.items() if isinstance(values, dict) else ():
            effective = key if key.startswith(prefix) else prefix + key
            yield f"{section}.{key}", value, _option_problem(f"{section}.{effective}", value, options.get(effective))


def _auto_processes_problem(machines: Any) -> str | None:
    """`num_processes: auto`: accelerate hands it to torchrun as `--nproc_per_node auto` (one process per GPU of
    the machine) when there is one machine; with several it divides it by num_machines and fails."""
    if machines in (None, 1, "1"):
        return None
    return "works on one machine only (accelerate divides num_processes by num_machines); write the total number"


def _option_problem(key: str, value: Any, action: Any) -> str | None:
    """``value`` read as the `accelerate launch` option ``action`` (its type and choices) and its range."""
    if value is None or action is None:
        return None
    if action.type is int or action.type is float:
        problem = value_problem(value, action.type)
        if problem:
            return problem
    elif isinstance(value, dict | list):
        return "must be a single value, not a list or mapping"
    if action.choices and str(value) not in action.choices:
        return f"must be one of {', '.join(map(str, action.choices))}"
    if key.endswith(("offload_optimizer_device", "offload_param_device")) and value not in OFFLOAD_DEVICES:
        return f"must be one of {', '.join(OFFLOAD_DEVICES)}"
    if key == "main_process_ip":
        from hf_scale.config.value_types import host_problem

        return host_problem(str(value))
    bounds = ACCELERATE_RANGES.get(key)
    return range_problem(value, *bounds) if bounds and isinstance(value, int | float) else None


def _launch_actions(group: str) -> list[Any]:
    from accelerate.commands.launch import launch_command_parser

    groups = {g.title: g for g in launch_command_parser()._action_groups}
    return list(groups[group]._group_actions)


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
                f"{in_file(inp.accelerate_file)}write `{key}` as a value of the right type and range "
                "(`accelerate config` or `hf-scale generate` writes valid files).",
                {f"{inp.accelerate_file}:{key}": value},
            )
