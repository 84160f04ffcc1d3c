"""Checks of the precision: accelerate's `mixed_precision`, DeepSpeed's fp16/bf16 blocks and `--bf16/--fp16`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, Source, agree_fix, disagreement, in_file
from hf_scale.check.inputs import CheckInputs, deepspeed_view
from hf_scale.contract import launch_values
from hf_scale.files.reading import get_path
from hf_scale.knowledge import rules
from hf_scale.knowledge.rules import DEEPSPEED_PRECISION_BLOCKS


def _precision_sources(inp: CheckInputs) -> tuple[list[Source], dict[str, Source]]:
    """(what the YAML / training args ask for, DeepSpeed's explicit ``enabled`` flags by dtype)."""
    wanted = []
    mixed = inp.accelerate.get("mixed_precision")
    # `no` is what accelerate writes when the YAML says nothing: the HF Trainer (and train.py) hand their own
    # --bf16/--fp16 to the Accelerator, which wins over it. A hand-written Accelerator loop runs with it.
    if isinstance(mixed, str) and not (mixed == "no" and inp.runner == "trainer"):
        wanted.append(Source(inp.accelerate_file, "mixed_precision", mixed))
    if inp.training is not None:
        flags = [name for name in ("bf16", "fp16") if inp.training[name]]
        typed = bool(inp.training_given & {"bf16", "fp16"})
        given = "--" + "/--".join(flags) if flags else "--bf16/--fp16 " + ("false" if typed else "(not given)")
        wanted.append(Source(TRAINING_ARGS, given, flags[0] if len(flags) == 1 else "no"))
    explicit = {}
    for dtype, block in ((d, b) for d, blocks in DEEPSPEED_PRECISION_BLOCKS.items() for b in blocks):
        enabled = get_path(inp.deepspeed, f"{block}.enabled", None)
        if isinstance(enabled, bool):
            explicit[dtype] = Source(inp.deepspeed_file or "", f"{block}.enabled", enabled)
    return wanted, explicit


def check_precision(inp: CheckInputs) -> Iterator[Finding]:
    """`precision-mismatch`: accelerate `mixed_precision`, DeepSpeed's fp16/bf16 blocks and typed `--bf16/--fp16`
    ask for different precisions (a warning when --bf16/--fp16 are left out and the DeepSpeed settings enable one:
    train.py follows them, a plain HF Trainer script stops)."""
    wanted, explicit = _precision_sources(inp)
    training = next((s for s in wanted if s.file == TRAINING_ARGS), None)
    untyped = training is not None and not inp.training_given & {"bf16", "fp16"}
    # Flags left out are not compared: train.py follows the launcher's config (hf_scale.contract.launch_values).
    compared = [s for s in wanted if s is not training] if untyped else wanted
    # fp8 computes in bf16 outside its matmuls and runs with --bf16 (hf_scale.knowledge.rules.compute_precision).
    if len({rules.compute_precision(str(s.value)) for s in compared}) > 1:
        yield from disagreement(
            "precision-mismatch",
            "mixed precision",
            compared,
            agree_fix(compared, " (one precision: no, fp16 or bf16; fp8 runs with --bf16)"),
        )
    for source in compared:
        # accelerate runs fp8 on top of DeepSpeed's bf16 (DeepSpeedPlugin.set_mixed_precision).
        asked = rules.compute_precision(source.value)
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
    if untyped and training is not None:
        yield from _followed_precision(inp, training, compared, explicit)


def _followed_precision(
    inp: CheckInputs, training: Source, files: list[Source], explicit: dict[str, Source]
) -> Iterator[Finding]:
    """--bf16/--fp16 left out while the DeepSpeed settings fix a precision: train.py follows it (the rule of
    hf_scale.contract.launch_values); the HF Trainer compares `bf16.enabled`/`fp16.enabled` with the flags and stops.
    (accelerate's `mixed_precision` alone is followed by the Trainer too: no finding.)"""
    view = deepspeed_view(inp)
    if view is None or inp.training is None:
        return
    mixed = inp.accelerate.get("mixed_precision")
    result = launch_values.reconcile(
        launch_values.TrainingValues(world_size=1, bf16=inp.training["bf16"], fp16=inp.training["fp16"]),
        (),
        deepspeed_config=view.config,
        accelerate_mixed_precision=mixed if isinstance(mixed, str) else None,
    )
    chosen = next((p for p in ("bf16", "fp16") if p in result.followed), None)
    if chosen is None or any("precision" in m or "mixed_precision" in m for m in result.mismatches):
        return  # nothing followed, or the files disagree (an error above)
    fixing = explicit.get(chosen) or next((s for s in files if s.key == "mixed_precision"), None)
    if fixing is None:  # an inline YAML without a precision of its own: accelerate's plugin default
        fixing = Source(view.file, view.where(f"{chosen}.enabled")[1], True)
    name = Path(fixing.file).name
    other = f'set `{fixing.key}` to "auto" in {name}' if fixing.key.endswith(".enabled") else (
        f"change `{fixing.key}` in {name}")
    yield Finding(
        WARNING,
        "precision-mismatch",
        fixing.file,
        fixing.key,
        f"{fixing.label}={fixing.value!r} but {training.label}={training.value!r}: train.py follows the file "
        f"({chosen}); a plain HF Trainer script stops at start on this mismatch.",
        f"Pass --{chosen} in the training args (then both agree for any script), or {other}.",
        {fixing.where: fixing.value, training.where: training.value},
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
