"""Checks of what the HF Trainer compares at launch between the DeepSpeed JSON and the training flags
(optimizer/scheduler values, clipping), and of the JSON blocks that replace training flags.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Iterator

from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, _get, _in
from hf_scale.check.inputs import CheckInputs, _flag_given, _world_size
from hf_scale.check.knowledge import _PARSE_ERRORS


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


def check_trainer_compared_values(inp: CheckInputs) -> Iterator[Finding]:
    """`ds-trainer-mismatch`: a concrete value of the JSON that the HF Trainer compares with a training flag
    differs from it (`gradient_clipping` vs `--max_grad_norm`, the optimizer's lr/betas/eps/weight_decay,
    the scheduler's `warmup_max_lr` vs `--learning_rate`), defaults included: the Trainer stops at start
    ("mismatch"). Found with transformers' own HfTrainerDeepSpeedConfig."""
    if inp.deepspeed is None or inp.runner != "trainer" or inp.training is None:
        return

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
