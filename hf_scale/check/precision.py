"""Checks of the precision: accelerate's `mixed_precision`, DeepSpeed's fp16/bf16 blocks and `--bf16/--fp16`.
"""

from __future__ import annotations

from collections.abc import Iterator

from hf_scale import rules
from hf_scale.check.findings import (
    ERROR,
    TRAINING_ARGS,
    WARNING,
    Finding,
    Source,
    agree_fix,
    disagreement,
    get_path,
    in_file,
)
from hf_scale.check.inputs import DEFAULT_FLAG_NOTE, CheckInputs, only_a_default_flag_differs


def _precision_sources(inp: CheckInputs) -> tuple[list[Source], dict[str, Source]]:
    """(what the YAML / training args ask for, DeepSpeed's explicit ``enabled`` flags by dtype)."""
    wanted = []
    mixed = inp.accelerate.get("mixed_precision")
    if isinstance(mixed, str):
        wanted.append(Source(inp.accelerate_file, "mixed_precision", mixed))
    if inp.training is not None:
        flags = [name for name in ("bf16", "fp16") if inp.training[name]]
        given = "--" + "/--".join(flags) if flags else "--bf16/--fp16 (not given)"
        wanted.append(Source(TRAINING_ARGS, given, flags[0] if len(flags) == 1 else "no"))
    explicit = {}
    for dtype, block in (("fp16", "fp16"), ("bf16", "bf16"), ("bf16", "bfloat16")):
        enabled = get_path(inp.deepspeed, f"{block}.enabled", None)
        if isinstance(enabled, bool):
            explicit[dtype] = Source(inp.deepspeed_file or "", f"{block}.enabled", enabled)
    return wanted, explicit


def check_precision(inp: CheckInputs) -> Iterator[Finding]:
    """`precision-mismatch`: accelerate `mixed_precision`, DeepSpeed's fp16/bf16 blocks and `--bf16/--fp16`
    ask for different precisions (a warning when only unset flags differ from an inline `deepspeed_config`
    YAML, as for grad-accum-mismatch)."""
    wanted, explicit = _precision_sources(inp)
    soft = only_a_default_flag_differs(inp, wanted, ("bf16", "fp16"))
    yield from disagreement(
        "precision-mismatch",
        "mixed precision",
        wanted,
        agree_fix(wanted, " (one precision: no, fp16 or bf16)") if len(wanted) > 1 else "",
        WARNING if soft else ERROR,
        DEFAULT_FLAG_NOTE if soft else "",
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
                    f'{in_file(ds.file)}set `{ds.key}` to "auto" (it then follows {source.label}), or make the two '
                    "agree.",
                    {ds.where: ds.value, source.where: source.value},
                )


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
            f"{in_file(explicit['fp16'].file)}enable only one of `fp16.enabled` and `{explicit['bf16'].key}` "
            "(bf16 on Ampere+).",
            {s.where: s.value for s in explicit.values()},
        )
    training = inp.training or {}
    try:
        rules.precision_from_flags(bool(training.get("bf16")), bool(training.get("fp16")))
    except ValueError as refused:
        yield Finding(
            ERROR,
            "fp16-and-bf16",
            TRAINING_ARGS,
            "--fp16/--bf16",
            f"{refused}: TrainingArguments and train.py refuse this.",
            "Pass only one of --fp16 and --bf16 in the training args.",
            {f"{TRAINING_ARGS}:--fp16": True, f"{TRAINING_ARGS}:--bf16": True},
        )
