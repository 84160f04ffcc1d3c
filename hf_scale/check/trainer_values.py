"""Checks of what the HF Trainer compares at launch between the DeepSpeed JSON and the training flags
(optimizer/scheduler values, clipping), and of the JSON blocks that replace training flags.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, in_file, is_int
from hf_scale.check.inputs import CheckInputs, deepspeed_view, world_size_of
from hf_scale.check.parallelism import SECTION, yaml_layout
from hf_scale.config import parallelism
from hf_scale.contract import launch_values
from hf_scale.files.reading import get_path


def check_deepspeed_overrides_flags(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-overrides-flags`: the JSON's
    `optimizer` block replaces `--optim`/`--optim_args`, its `scheduler` block `--lr_scheduler_type`/
    `--lr_scheduler_kwargs` (e.g. WarmupLR: constant after a logarithmic warmup, where the Trainer's default
    decays linearly). train.py warns the same way, and refuses to start on an explicit flag."""
    if inp.deepspeed is None or inp.runner != "trainer":
        return
    from hf_scale.knowledge import deepspeed_overrides

    file = inp.deepspeed_file or ""
    for override in deepspeed_overrides.find_overrides(inp.deepspeed, inp.training_given):
        flags = " / ".join(f"--{flag}" for flag in (override.given or override.flags[:1]))
        key = override.path if override.ds_type is not None else override.block
        yield Finding(
            ERROR if override.given else WARNING,
            "ds-overrides-flags",
            file,
            key,
            deepspeed_overrides.describe(override, inp.training or {}) + ".",
            (
                f"{in_file(file)}remove the `{override.block}` block (`{key}`) to get {flags}, or drop {flags} "
                "from the training args."
                if override.given
                else f"{in_file(file)}keep `{key}` to run DeepSpeed's {override.block}, or remove the "
                f"`{override.block}` block to let {flags} decide."
            ),
            {f"{file}:{key}": override.ds_type, **{f"{TRAINING_ARGS}:--{f}": (inp.training or {}).get(f)
                                                 for f in override.given}},
        )


def check_hf_scale_config_flags(inp: CheckInputs) -> Iterator[Finding]:
    """`hf-scale-config-mismatch`: a training flag contradicts the DistributedConfig of `--hf_scale_config`
    (e.g. its batch.micro_batch_size=2 and `--per_device_train_batch_size 4`), or the accelerate YAML launches
    another world size, engine, parallelism, ZeRO stage, mixed_precision or FSDP activation checkpointing; train.py
    stops on it with this message (its own rule: hf_scale.contract.config_flags). The config's values fill the
    flags left unset (hf_scale.contract.config_flags.fill_flags_from_config)."""
    file = inp.hf_scale_config_file or ""
    where = f"--hf_scale_config={file}: "
    name = Path(file).name
    launch = tuple(_launch_contradictions(inp, where))
    for contradiction in (*launch, *inp.hf_scale_config_contradictions):
        text = contradiction.removeprefix(where)
        key = text.split(" ", 1)[0].split("=", 1)[0]
        flags = " ".join(dict.fromkeys(re.findall(r"--\w+", text.split(" but ", 1)[-1]))) or "--bf16/--fp16"
        fix = (
            f"Drop {flags} from the training args (train.py takes `{key}` from {name}), or change `{key}` in {name}."
            if contradiction not in launch
            else f"Launch with the accelerate YAML generated from {name} (`hf-scale generate {file}`), or change "
            f"`{key}` in {name} to what {Path(inp.accelerate_file).name} launches."
        )
        yield Finding(
            ERROR,
            "hf-scale-config-mismatch",
            file,
            key,
            f"{text}: train.py stops at start on this.",
            fix,
            {f"{file}:{key}": text},
        )


def _launch_contradictions(inp: CheckInputs, where: str) -> Iterator[str]:
    """What train.py's apply_hf_scale_config refuses about the accelerate launch of this YAML, by its own rules
    (hf_scale.contract.config_flags: one function per rule, the message or None) on what the files say: the world
    size, an engine the YAML chooses, the parallelism_config, the ZeRO stage, mixed_precision, FSDP's activation
    checkpointing."""
    from hf_scale.contract import config_flags

    cfg = inp.hf_scale_config
    if cfg is None:
        return
    where = where.removesuffix(": ")
    env = inp.launch_env or {}
    world = world_size_of(inp)
    yield from _said(config_flags.world_size_mismatch(cfg, "accelerate", world, where) if world is not None else None)
    engine = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(inp.accelerate.get("distributed_type"))
    yield from _said(config_flags.engine_mismatch(cfg, "accelerate", engine or "ddp", where))
    layout = yaml_layout(inp)
    if layout is not None:
        comm = inp.accelerate[SECTION].get(f"{parallelism.YAML_PREFIX}cp_comm_strategy")
        yield from _said(config_flags.launched_layout_mismatch(cfg, layout, comm if layout.cp > 1 else None, where))
    view = deepspeed_view(inp) if engine == "deepspeed" == cfg.strategy else None
    stage = get_path(view.config, "zero_optimization.stage", None if view.from_yaml else 0) if view else None
    if is_int(stage):
        source = view.file if not view.from_yaml else "the accelerate config's deepspeed_config"
        yield from _said(config_flags.zero_stage_mismatch(cfg, stage, source, where))
    mixed = env.get("ACCELERATE_MIXED_PRECISION", inp.accelerate.get("mixed_precision"))
    if isinstance(mixed, str) and (engine != "deepspeed" or (view is not None and view.from_yaml)):
        yield from _said(config_flags.precision_mismatch(cfg, mixed, where))
    if engine == "fsdp" == cfg.strategy and cfg.layout.tp <= 1:
        written = env.get("FSDP_ACTIVATION_CHECKPOINTING",
                          get_path(inp.accelerate, "fsdp_config.fsdp_activation_checkpointing", None))
        written = None if written is None else str(written)
        yield from _said(config_flags.fsdp_checkpointing_mismatch(cfg, written, where))


def _said(refusal: str | None) -> Iterator[str]:
    if refusal:
        yield refusal


# Trainer comparisons already reported by their own checks (batch sizes, accumulation, precision).
_COMPARED_ELSEWHERE = (
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "train_batch_size",
    "fp16.enabled",
    "bf16.enabled",
)


def check_trainer_compared_values(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-trainer-mismatch`: a concrete value of the JSON that the HF Trainer compares with a training flag at
    launch differs from it (`gradient_clipping` vs `--max_grad_norm`, the optimizer's lr/betas/eps/weight_decay,
    the scheduler's `warmup_max_lr` vs `--learning_rate`, `warmup_num_steps` vs `--warmup_steps`/`--warmup_ratio`,
    `total_num_steps` vs `--max_steps`): an error when the flag is typed (the HF Trainer and train.py stop), a warning
    when it is left at its default (train.py takes the JSON's value, a plain HF Trainer script stops). The
    comparisons are hf_scale.contract.launch_values.reconcile, the rule train.py applies (tested against transformers'
    own)."""
    if inp.deepspeed is None or inp.runner != "trainer" or inp.training is None:
        return
    if inp.training["bf16"] and inp.training["fp16"]:
        return  # `fp16-and-bf16`: no precision to compare with
    file = inp.deepspeed_file or ""
    max_steps = inp.training["max_steps"]
    # Every flag counts as typed: the HF Trainer compares a default like any other value (it follows nothing).
    result = launch_values.reconcile(
        _training_values(inp),
        _ALL_FLAGS,
        deepspeed_config=inp.deepspeed,
        deepspeed_source=file,
        num_training_steps=max_steps if max_steps > 0 else None,
    )
    for difference in result.differences:
        if difference.key not in _COMPARED_ELSEWHERE and _is_number_or_numbers(difference.config_value):
            yield _mismatch_finding(inp, file, difference)


# Every flag the rule compares (TrainingValues' fields; the run's length also by epochs).
_ALL_FLAGS = frozenset({f.name for f in dataclasses.fields(launch_values.TrainingValues)} | {"num_train_epochs"})


def _training_values(inp: CheckInputs) -> launch_values.TrainingValues:
    training = inp.training or {}
    names = {f.name for f in dataclasses.fields(launch_values.TrainingValues)} - {"world_size"}
    values = {name: training[name] for name in names}
    if training.get("warmup_ratio") is not None:  # train.py: --warmup_ratio is the warmup as a fraction
        values["warmup_steps"] = training["warmup_ratio"]
    return launch_values.TrainingValues(world_size=world_size_of(inp) or 1, **values)


def _is_number_or_numbers(value: Any) -> bool:
    """A value of the wrong kind is `deepspeed-value-invalid`'s, not a mismatch."""
    values = value if isinstance(value, list) else [value]
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _mismatch_finding(inp: CheckInputs, file: str, difference: launch_values.Difference) -> Finding:
    key, shown = difference.key, "/".join(f"--{name}" for name in difference.flags)
    typed = bool(inp.training_given & set(difference.flags))
    flag_value = difference.flag_value
    if key == "scheduler.params.warmup_num_steps":
        flag_value = f"{flag_value} steps" + (" (the Trainer compares it as 1)" if flag_value < 1 else "")
    elif key == "scheduler.params.total_num_steps":
        flag_value = f"{flag_value} optimizer steps"
    elif isinstance(flag_value, list):
        flag_value = "/".join(map(str, flag_value))
    consequence = (
        "the HF Trainer and train.py stop at start on this mismatch" if typed
        else "a plain HF Trainer script stops at start on this mismatch (train.py takes the JSON's value)"
    )
    return Finding(
        ERROR if typed else WARNING,
        "ds-trainer-mismatch",
        file,
        key,
        f"{key}={difference.config_value} but {shown}={flag_value}{'' if typed else ' (default)'}: {consequence}.",
        f'{in_file(file)}set `{key}` to "auto" (it then follows {shown}), or pass the value of `{key}` as {shown} in '
        "the training args.",
        {f"{file}:{key}": difference.config_value, f"{TRAINING_ARGS}:{shown}": difference.flag_value},
    )
