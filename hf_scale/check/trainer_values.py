"""Checks of what the HF Trainer compares at launch between the DeepSpeed JSON and the training flags
(optimizer/scheduler values, clipping), and of the JSON blocks that replace training flags.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_scale import launch_values, parallelism
from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, get_path, in_file, is_int
from hf_scale.check.inputs import CheckInputs, deepspeed_view, world_size_of
from hf_scale.check.parallelism import SECTION, yaml_layout


def check_deepspeed_overrides_flags(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-overrides-flags` (warning; an error when a replaced flag is given explicitly): the JSON's
    `optimizer` block replaces `--optim`/`--optim_args`, its `scheduler` block `--lr_scheduler_type`/
    `--lr_scheduler_kwargs` (e.g. WarmupLR: constant after a logarithmic warmup, where the Trainer's default
    decays linearly). train.py warns the same way, and refuses to start on an explicit flag."""
    if inp.deepspeed is None or inp.runner != "trainer":
        return
    from hf_scale import deepspeed_overrides

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
    another world size, engine or ZeRO stage; train.py stops on it with this message. The config's values fill the
    flags left unset (hf_scale.train.setup.reconcile.fill_flags_from_config)."""
    file = inp.hf_scale_config_file or ""
    where = f"--hf_scale_config={file}: "
    name = Path(file).name
    for contradiction in (*_launch_contradictions(inp, where), *inp.hf_scale_config_contradictions):
        text = contradiction.removeprefix(where)
        key = text.split(" ", 1)[0].split("=", 1)[0]
        flags = " ".join(dict.fromkeys(re.findall(r"--\w+", text.split(" but ", 1)[-1]))) or "--bf16/--fp16"
        fix = (
            f"Drop {flags} from the training args (train.py takes `{key}` from {name}), or change `{key}` in {name}."
            if key not in _LAUNCH_KEYS
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


_LAUNCH_KEYS = ("world_size", "strategy", "deepspeed.zero_stage", "parallelism", "parallelism.cp_comm_strategy")


def _launch_contradictions(inp: CheckInputs, where: str) -> Iterator[str]:
    """What train.py's apply_hf_scale_config refuses about the accelerate launch of this YAML, in its words: the
    world size, an engine the YAML chooses, the ZeRO stage of the DeepSpeed settings."""
    cfg = inp.hf_scale_config
    if cfg is None:
        return
    world = world_size_of(inp)
    if world is not None and cfg.world_size != world:
        yield (f"{where}world_size={cfg.world_size} ({cfg.topology.num_machines} machines x "
               f"{cfg.topology.processes_per_machine} processes_per_machine) but the accelerate launcher started "
               f"WORLD_SIZE={world}")
    engine = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(inp.accelerate.get("distributed_type"))
    if engine is not None and engine != cfg.strategy:
        yield f"{where}strategy={cfg.strategy} but the accelerate launch configures {engine}"
    layout = yaml_layout(inp)
    if layout is not None:
        from hf_scale.train.setup.reconcile import launched_layout_mismatch

        comm = inp.accelerate[SECTION].get(f"{parallelism.YAML_PREFIX}cp_comm_strategy")
        mismatch = launched_layout_mismatch(cfg, layout, comm if layout.cp > 1 else None, where.removesuffix(": "))
        if mismatch:
            yield mismatch
    view = deepspeed_view(inp) if engine == "deepspeed" == cfg.strategy else None
    stage = get_path(view.config, "zero_optimization.stage", None) if view is not None else None
    if is_int(stage) and stage != cfg.deepspeed.zero_stage:
        source = view.file if not view.from_yaml else "the accelerate config's deepspeed_config"
        yield f"{where}deepspeed.zero_stage={cfg.deepspeed.zero_stage} but {source} has zero_optimization.stage={stage}"


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
    comparisons are hf_scale.launch_values.reconcile, the rule train.py applies (tested against transformers' own)."""
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
