"""Checks of the batch: gradient accumulation, micro batch and DeepSpeed's `train_batch_size` arithmetic across
the YAML, the JSON and the training args.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_scale.check.findings import ERROR, WARNING, Finding, Source, agree_fix, disagreement, in_file, is_int
from hf_scale.check.inputs import (
    DEFAULT_FLAG_NOTE,
    CheckInputs,
    only_a_default_flag_differs,
    training_source,
    world_size_of,
)
from hf_scale.contract.launch_values import ACCUMULATION, MISSING_ACCUMULATION
from hf_scale.files.reading import get_path
from hf_scale.knowledge import rules
from hf_scale.knowledge.library_tables import deepspeed_off_stdout


def check_gradient_accumulation(inp: CheckInputs) -> Iterator[Finding]:
    """`grad-accum-mismatch`: gradient accumulation differs between the YAML, the JSON and the training
    args (a warning when only a flag left at its default differs from the DeepSpeed settings: train.py takes
    their value, a plain HF Trainer stops); a JSON without the key is 1 (accelerate's DeepSpeedPlugin writes it),
    not "auto"."""
    yield from _missing_accumulation(inp)
    sources = [
        Source(inp.accelerate_file, key, get_path(inp.accelerate, key))
        for key in ("deepspeed_config.gradient_accumulation_steps", "gradient_accumulation_steps")
        if is_int(get_path(inp.accelerate, key))
    ]
    if is_int(get_path(inp.deepspeed, "gradient_accumulation_steps")):
        sources.append(
            Source(
                inp.deepspeed_file or "",
                "gradient_accumulation_steps",
                inp.deepspeed["gradient_accumulation_steps"],
            )
        )
    if (training := training_source(inp, "gradient_accumulation_steps")) is not None:
        sources.append(training)
    soft = only_a_default_flag_differs(inp, sources, ("gradient_accumulation_steps",))
    hint = ' ("auto" in the DeepSpeed JSON follows the training args)' if inp.deepspeed is not None else ""
    yield from disagreement(
        "grad-accum-mismatch",
        "gradient_accumulation_steps",
        sources,
        agree_fix(sources, hint) if len(sources) > 1 else "",
        WARNING if soft else ERROR,
        DEFAULT_FLAG_NOTE if soft else "",
    )


def _missing_accumulation(inp: CheckInputs) -> Iterator[Finding]:
    """The JSON has no `gradient_accumulation_steps` and the training args ask for another accumulation: the HF
    Trainer and train.py go through accelerate's DeepSpeedPlugin, which writes 1 there (raw DeepSpeed derives it
    from train_batch_size instead: `train-batch-*`)."""
    training = training_source(inp, ACCUMULATION)
    if inp.deepspeed is None or ACCUMULATION in inp.deepspeed or inp.runner == "deepspeed" or training is None:
        return
    if training.value == MISSING_ACCUMULATION:
        return
    file = inp.deepspeed_file or ""
    yield Finding(
        ERROR,
        "grad-accum-mismatch",
        file,
        ACCUMULATION,
        f"{Path(file).name} has no {ACCUMULATION}: accelerate's DeepSpeedPlugin sets it to {MISSING_ACCUMULATION} "
        f"(not \"auto\"), but {training.label}={training.value}: the HF Trainer stops at DeepSpeed's train_batch_size "
        "assertion (or, without train_batch_size, accumulates 1 micro-batch); train.py stops at start.",
        f'{in_file(file)}add `"{ACCUMULATION}": "auto"` (it then follows --{ACCUMULATION}), or drop '
        f"--{ACCUMULATION} from the training args.",
        {f"{file}:{ACCUMULATION}": None, training.where: training.value},
    )


def check_micro_batch(inp: CheckInputs) -> Iterator[Finding]:
    """`micro-batch-mismatch`: the JSON's `train_micro_batch_size_per_gpu` differs from
    `--per_device_train_batch_size` (the Trainer raises; a warning when the flag is left at its default: train.py
    takes the JSON's value)."""
    micro = get_path(inp.deepspeed, "train_micro_batch_size_per_gpu")
    training = training_source(inp, "per_device_train_batch_size")
    if inp.runner != "trainer" or not is_int(micro) or training is None:
        return
    sources = [Source(inp.deepspeed_file or "", "train_micro_batch_size_per_gpu", micro), training]
    soft = only_a_default_flag_differs(inp, sources, ("per_device_train_batch_size",))
    yield from disagreement(
        "micro-batch-mismatch",
        "the micro batch size per device",
        sources,
        f'{in_file(inp.deepspeed_file or "")}set `train_micro_batch_size_per_gpu` to "auto" (the Trainer fills '
        "it) or pass it as --per_device_train_batch_size.",
        WARNING if soft else ERROR,
        DEFAULT_FLAG_NOTE if soft else "",
    )


_UNKNOWN = object()
"""A batch value that is "auto" and whose runner-filled value the inputs do not tell."""


def _trainer_compares_batch(inp: CheckInputs) -> bool:
    """Under the HF Trainer (and train.py), a concrete train_batch_size beside no micro batch is compared with
    the flags' product, not left to DeepSpeed to derive the micro batch from."""
    return (
        inp.runner == "trainer"
        and inp.training is not None
        and get_path(inp.deepspeed, "train_micro_batch_size_per_gpu", None) is None
    )


def _batch_value(inp: CheckInputs, key: str, flag: str) -> Any:
    """What DeepSpeed will see for one batch key: an int, None (absent: DeepSpeed derives it) or _UNKNOWN."""
    value = get_path(inp.deepspeed, key, None)
    if value is None:
        # The HF Trainer compares a concrete train_batch_size with world x --per_device_train_batch_size x
        # --gradient_accumulation_steps (HfTrainerDeepSpeedConfig.trainer_config_process) before DeepSpeed could
        # derive a missing micro batch from it; train.py applies the same rule (launch_values). DeepSpeedExamples'
        # cifar config (train_batch_size 16, no micro batch) stops a Trainer on 8 GPUs at the default micro batch 8.
        if _trainer_compares_batch(inp) and flag:
            return inp.training[flag]
        # accelerate's DeepSpeedPlugin (both the Trainer and an Accelerator loop) writes a missing
        # gradient_accumulation_steps as 1.
        return 1 if key == "gradient_accumulation_steps" and inp.runner != "deepspeed" else None
    if value == "auto" and inp.runner == "trainer" and inp.training is not None:
        return inp.training[flag]
    return value if is_int(value) and value > 0 else _UNKNOWN  # <= 0: `deepspeed-value-invalid`


def deepspeed_accepts_batch(total: Any, micro: Any, accum: Any, world: int) -> tuple[bool, Any, Any]:
    """Run DeepSpeed's own batch arithmetic (DeepSpeedConfig._configure_train_batch_size: derive the missing
    values, then assert) on the four numbers; returns (accepted, derived micro, derived accumulation). The
    two methods read only these attributes, so no full config is needed."""
    with deepspeed_off_stdout():
        from deepspeed.runtime.config import DeepSpeedConfig

    config = object.__new__(DeepSpeedConfig)
    config.train_batch_size, config.train_micro_batch_size_per_gpu = total, micro
    config.gradient_accumulation_steps, config.world_size = accum, world
    try:
        config._configure_train_batch_size()
    except AssertionError:
        return False, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    return True, micro, accum


def _batch_problem(
    total: Any, micro: Any, accum: Any, world: int, who: str = "DeepSpeed asserts"
) -> tuple[str, str, str] | None:
    """(code, problem, fix) when DeepSpeed's batch arithmetic fails for these values, else None; `who` says who
    stops on a plain mismatch (DeepSpeed's assertion, or the HF Trainer's comparison before it)."""
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
        ok, micro_seen, accum_seen = deepspeed_accepts_batch(total, micro, accum, world)
    if ok:
        return None
    if total is None:
        return (
            "train-batch-invalid",
            "neither train_batch_size nor train_micro_batch_size_per_gpu is set: DeepSpeed asserts at start.",
            'set `train_micro_batch_size_per_gpu` (or "auto" for the Trainer) or `train_batch_size`.',
        )
    if micro is not None and accum is not None:
        product = rules.global_batch_size(micro, accum, world)
        return (
            "train-batch-mismatch",
            f"train_batch_size={total} but micro batch x accumulation x world size = "
            f"{micro} x {accum} x {world} = {product} ({who} at start).",
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


def check_train_batch_size(inp: CheckInputs) -> Iterator[Finding]:
    """`train-batch-mismatch`, `train-batch-invalid`: DeepSpeed's batch arithmetic fails: `train_batch_size`
    != micro batch x accumulation x world size, or the value DeepSpeed derives is 0 or not a whole number
    (e.g. `train_batch_size` smaller than the world size), or no batch size is set at all. The world size is
    the YAML's `num_processes`, the total over all machines."""
    world = world_size_of(inp)
    if inp.deepspeed is None or world is None or get_path(inp.deepspeed, "train_batch_size", None) == "auto":
        return  # "auto": the runner computes it from the other two
    total = _batch_value(inp, "train_batch_size", "")
    micro = _batch_value(inp, "train_micro_batch_size_per_gpu", "per_device_train_batch_size")
    accum = _batch_value(inp, "gradient_accumulation_steps", "gradient_accumulation_steps")
    if total is _UNKNOWN or (micro is _UNKNOWN and accum is _UNKNOWN) or (total is None and micro is not None):
        return  # unknown, or DeepSpeed computes train_batch_size from the micro batch
    who = "the HF Trainer and train.py stop on it" if _trainer_compares_batch(inp) else "DeepSpeed asserts"
    problem = _batch_problem(total, micro, accum, world, who)
    if problem is None:
        return
    code, text, fix = problem
    file = inp.deepspeed_file or ""
    values = {f"{file}:train_batch_size": total, f"{inp.accelerate_file}:num_processes": world}
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)):
        if value is not _UNKNOWN:
            values[key] = value
    yield Finding(ERROR, code, file, "train_batch_size", text, in_file(file) + fix, values)
