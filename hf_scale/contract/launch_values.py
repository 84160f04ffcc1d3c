"""The training values a launcher's config fixes, reconciled with train.py's flags: ONE rule, shared by
train.py and `hf-scale check`.

A run's precision, batch, clipping and optimizer numbers can come from three places: train.py's flags,
the accelerate YAML (`mixed_precision`, exported as ACCELERATE_MIXED_PRECISION) and the DeepSpeed JSON.
transformers compares the JSON with the flags in `HfTrainerDeepSpeedConfig.trainer_config_process` /
`trainer_config_finalize` (every `fill_match` there) and raises a multi-line traceback on a mismatch,
after the model has loaded. :func:`reconcile` applies the same comparisons first:

- a JSON value of ``"auto"`` (or no such key) is filled from the flags, as the Trainer does; but a missing
  ``gradient_accumulation_steps`` is 1 (accelerate's DeepSpeedPlugin writes it before DeepSpeed starts);
- a concrete value the user did not type a flag for is FOLLOWED: the flag takes the config's value (a
  user who generated a bf16 config does not repeat ``--bf16``);
- a concrete value that differs from a flag the user typed is a MISMATCH (one line, exit 2 in train.py).

accelerate's ``mixed_precision: no`` is what accelerate writes when the YAML says nothing, so it fixes
nothing; ``bf16``/``fp16`` there are followed and compared like the JSON's ``bf16.enabled``/``fp16.enabled``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from hf_scale.contract.shared_values import FLAG_KEYS
from hf_scale.knowledge import rules

PRECISIONS = rules.PRECISIONS
_INT_FLAGS = {"per_device_train_batch_size", "gradient_accumulation_steps", "max_steps"}


@dataclass(frozen=True)
class TrainingValues:
    """The flags the comparison reads (TrainingArguments names)."""

    world_size: int
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    max_steps: int = -1
    warmup_steps: float = 0
    """transformers 5: a number of steps (>= 1) or a fraction of the run (< 1)."""

    @property
    def precision(self) -> str:
        return rules.precision_from_flags(self.bf16, self.fp16)


@dataclass(frozen=True)
class Difference:
    """One mismatch as data (for `hf-scale check`): a value of the DeepSpeed config and the flag(s) it is compared
    with."""

    key: str
    """The DeepSpeed config's key, e.g. ``optimizer.params.lr``."""
    config_value: Any
    flags: tuple[str, ...]
    """The TrainingArguments flag names it is compared with (two for the betas)."""
    flag_value: Any
    """What the flags give (a list for the betas; the warmup in steps for ``warmup_num_steps``, 0 included, which
    transformers compares as 1; the run's optimizer steps for ``total_num_steps``)."""


@dataclass(frozen=True)
class Reconciled:
    values: TrainingValues
    """The flags after following the config."""
    followed: dict[str, str]
    """flag -> where its new value came from, e.g. {"bf16": "ds.json bf16.enabled=True"}."""
    mismatches: list[str]
    """One sentence each; empty when the config and the flags agree."""
    differences: list[Difference] = dataclasses.field(default_factory=list)
    """The mismatches between one DeepSpeed value and its flag(s), as data."""


def _get(config: dict, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _concrete(value: Any) -> bool:
    return value is not None and value != "auto"


def _flag(name: str | tuple[str, ...]) -> str:
    return "+".join(f"--{n}" for n in name) if isinstance(name, tuple) else f"--{name}"


def reconcile(
    values: TrainingValues,
    given: Collection[str],
    *,
    deepspeed_config: dict | None = None,
    deepspeed_source: str = "the DeepSpeed config",
    accelerate_mixed_precision: str | None = None,
    num_training_steps: int | None = None,
) -> Reconciled:
    """Compare (and follow) the launcher's config against the flags.

    `given`: the flag names the user typed (``bf16``, ``learning_rate``, …; ``warmup_ratio`` counts as
    ``warmup_steps``). `num_training_steps`: the run's optimizer steps when known (for a JSON scheduler).
    """
    ds = deepspeed_config or {}
    state = _State(values, set(given), deepspeed_source)
    _precision(state, ds, accelerate_mixed_precision)
    for key, flag in FLAG_KEYS:
        _fill_match(state, key, _get(ds, key), flag)
    if deepspeed_config is not None and _get(ds, ACCUMULATION) is None:
        _missing_accumulation(state)
    _train_batch_size(state, ds)
    _scheduler_steps(state, ds, num_training_steps)
    return Reconciled(state.values, state.followed, state.mismatches, state.differences)


@dataclass
class _State:
    values: TrainingValues
    given: set[str]
    source: str
    followed: dict[str, str] = dataclasses.field(default_factory=dict)
    mismatches: list[str] = dataclasses.field(default_factory=list)
    differences: list[Difference] = dataclasses.field(default_factory=list)

    def differ(self, key: str, config_value: Any, flag: str | tuple[str, ...], flag_value: Any) -> None:
        flags = flag if isinstance(flag, tuple) else (flag,)
        self.differences.append(Difference(key, config_value, flags, flag_value))

    def current(self, flag: str | tuple[str, ...]) -> Any:
        if isinstance(flag, tuple):
            return [getattr(self.values, name) for name in flag]
        return getattr(self.values, flag)

    def follow(self, flag: str | tuple[str, ...], value: Any, why: str) -> None:
        names, new = (flag, list(value)) if isinstance(flag, tuple) else ((flag,), [value])
        updates = {n: int(v) if n in _INT_FLAGS else float(v) for n, v in zip(names, new, strict=True)}
        self.values = dataclasses.replace(self.values, **updates)
        for name in names:
            self.followed[name] = why


def _precision(state: _State, ds: dict, accelerate: str | None) -> None:
    allowed = set(PRECISIONS)
    fixed_by: list[str] = []
    for dtype, block in ((d, b) for d, blocks in rules.DEEPSPEED_PRECISION_BLOCKS.items() for b in blocks):
        enabled = _get(ds, f"{block}.enabled")
        if _concrete(enabled):
            on = str(enabled).lower() == "true"
            allowed &= {p for p in PRECISIONS if (p == dtype) == on}
            fixed_by.append(f"{state.source} {block}.enabled={str(on).lower()}")
    if accelerate and accelerate != "no":
        # fp8 trains under bf16 autocast (hf_scale.knowledge.rules.FP8_AUTOCAST): its flags are --bf16.
        computes_in = rules.compute_precision(accelerate)
        if computes_in not in PRECISIONS:
            state.mismatches.append(
                f"the accelerate config's mixed_precision={accelerate} is not supported by train.py (allowed: no, "
                "bf16, fp16)"
            )
            return
        allowed &= {computes_in}
        fixed_by.append(f"the accelerate config's mixed_precision={accelerate}")
    if not allowed:
        state.mismatches.append(f"{' and '.join(fixed_by)} disagree about the precision")
        return
    flags_given = bool({"bf16", "fp16"} & state.given)
    eval_precision = "bf16" if state.values.bf16_full_eval else "fp16" if state.values.fp16_full_eval else None
    wanted = state.values.precision
    if flags_given and wanted not in allowed:
        state.mismatches.append(
            f"{_precision_flags(wanted)} conflicts with {' and '.join(fixed_by)}; drop the flag (the precision "
            "follows the launcher's config) or change the config"
        )
    elif not flags_given and wanted not in allowed:
        # Constraints only exclude: without "no" among them, exactly one precision is left.
        (chosen,) = allowed
        state.values = dataclasses.replace(state.values, bf16=chosen == "bf16", fp16=chosen == "fp16")
        state.followed[chosen] = " and ".join(fixed_by)
    if eval_precision and eval_precision not in allowed:
        state.mismatches.append(f"--{eval_precision}_full_eval conflicts with {' and '.join(fixed_by)}")


def _precision_flags(precision: str) -> str:
    return {"bf16": "--bf16", "fp16": "--fp16", "no": "--bf16 false / --fp16 false"}[precision]


def _fill_match(state: _State, key: str, ds_value: Any, flag: str | tuple[str, ...]) -> None:
    if not _concrete(ds_value):
        return
    current = state.current(flag)
    if _same(ds_value, current):
        return
    names = flag if isinstance(flag, tuple) else (flag,)
    if any(name in state.given or name in state.followed for name in names):
        state.mismatches.append(f"{state.source} {key}={ds_value} but {_flag(flag)}={_show(current)}")
        state.differ(key, ds_value, flag, current)
    elif _valid(ds_value, flag):
        state.follow(flag, ds_value, f"{state.source} {key}")
    else:
        state.mismatches.append(f"{state.source} {key}={ds_value!r} is not a valid value for {_flag(flag)}")


ACCUMULATION = "gradient_accumulation_steps"
MISSING_ACCUMULATION = 1
"""What accelerate's DeepSpeedPlugin writes into a DeepSpeed config without `gradient_accumulation_steps` (both
loops and the HF Trainer go through it): 1, not "auto". DeepSpeed then asserts on a train_batch_size the Trainer
computed with the flag, or steps the optimizer on every micro-batch."""


def _missing_accumulation(state: _State) -> None:
    current = state.values.gradient_accumulation_steps
    if current == MISSING_ACCUMULATION:
        return
    state.differ(ACCUMULATION, MISSING_ACCUMULATION, ACCUMULATION, current)
    state.mismatches.append(
        f"{state.source} has no {ACCUMULATION}, which accelerate's DeepSpeedPlugin sets to {MISSING_ACCUMULATION}, "
        f'but --{ACCUMULATION}={current}; add "{ACCUMULATION}": "auto" to it (then it follows the flag)'
    )


def _same(ds_value: Any, current: Any) -> bool:
    if isinstance(current, list):
        return isinstance(ds_value, list | tuple) and list(ds_value) == current
    return not isinstance(ds_value, bool) and isinstance(ds_value, int | float) and ds_value == current


def _valid(ds_value: Any, flag: str | tuple[str, ...]) -> bool:
    if isinstance(flag, tuple):
        return isinstance(ds_value, list | tuple) and len(ds_value) == len(flag) and all(
            _valid(v, name) for v, name in zip(ds_value, flag, strict=True)
        )
    if isinstance(ds_value, bool) or not isinstance(ds_value, int | float):
        return False
    return ds_value >= 1 and float(ds_value).is_integer() if flag in _INT_FLAGS else math.isfinite(ds_value)


def _show(value: Any) -> str:
    return "+".join(map(str, value)) if isinstance(value, list) else str(value)


def _train_batch_size(state: _State, ds: dict) -> None:
    ds_value = _get(ds, "train_batch_size")
    if not _concrete(ds_value):
        return
    v = state.values
    per_step = rules.global_batch_size(v.per_device_train_batch_size, 1, v.world_size)
    implied = rules.global_batch_size(v.per_device_train_batch_size, v.gradient_accumulation_steps, v.world_size)
    if ds_value == implied:
        return
    # An "auto" accumulation follows train_batch_size when no flag says it (a missing one is 1: accelerate's).
    accumulation_free = _get(ds, ACCUMULATION) == "auto" and ACCUMULATION not in state.given
    if accumulation_free and isinstance(ds_value, int) and ds_value > 0 and ds_value % per_step == 0:
        state.follow("gradient_accumulation_steps", ds_value // per_step, f"{state.source} train_batch_size")
        return
    state.differ("train_batch_size", ds_value, ("per_device_train_batch_size", "gradient_accumulation_steps"), implied)
    state.mismatches.append(
        f"{state.source} train_batch_size={ds_value} but micro batch {v.per_device_train_batch_size} x accumulation "
        f"{v.gradient_accumulation_steps} x world size {v.world_size} = {implied}"
    )


def planned_optimizer_steps(num_examples: int, values: TrainingValues, num_train_epochs: float) -> int:
    """The optimizer steps of an epoch-based run, as the Trainer counts them (set_initial_training_values):
    each rank's loader has ceil(examples / (micro x world)) micro-batches; a partial window is a step."""
    per_rank = math.ceil(num_examples / (values.per_device_train_batch_size * values.world_size))
    per_epoch = max(math.ceil(per_rank / values.gradient_accumulation_steps), 1)
    return math.ceil(num_train_epochs * per_epoch)


def warmup_steps(values: TrainingValues, num_training_steps: int) -> int:
    """TrainingArguments.get_warmup_steps."""
    ws = values.warmup_steps
    return int(ws) if ws >= 1 else math.ceil(num_training_steps * ws)


def _scheduler_steps(state: _State, ds: dict, num_training_steps: int | None) -> None:
    total = _get(ds, "scheduler.params.total_num_steps")
    if _concrete(total):
        length_given = bool({"max_steps", "num_train_epochs"} & state.given)
        if not length_given and _valid(total, "max_steps"):
            if state.values.max_steps != total:
                state.follow("max_steps", total, f"{state.source} scheduler.params.total_num_steps")
            num_training_steps = int(total)
        elif num_training_steps is not None and total != num_training_steps:
            state.differ("scheduler.params.total_num_steps", total, ("max_steps", "num_train_epochs"),
                         num_training_steps)
            state.mismatches.append(
                f"{state.source} scheduler.params.total_num_steps={total} but the run takes {num_training_steps} "
                "optimizer steps (--max_steps / --num_train_epochs)"
            )
    warmup = _get(ds, "scheduler.params.warmup_num_steps")
    fraction = 0 < state.values.warmup_steps < 1
    if not _concrete(warmup) or (fraction and num_training_steps is None):
        return
    # transformers fills and compares max(1, warmup): DeepSpeed >= 0.19.6 refuses a warmup of 0 steps.
    flags_give = warmup_steps(state.values, num_training_steps or 0)
    ours = max(1, flags_give)
    if warmup == ours:
        return
    if "warmup_steps" in state.given or not _valid(warmup, "max_steps"):
        state.differ("scheduler.params.warmup_num_steps", warmup, ("warmup_steps", "warmup_ratio"), flags_give)
        compared = "" if ours == flags_give else f" (compared as {ours})"
        state.mismatches.append(
            f"{state.source} scheduler.params.warmup_num_steps={warmup} but --warmup_steps gives {flags_give}{compared}"
        )
    else:
        state.values = dataclasses.replace(state.values, warmup_steps=int(warmup))
        state.followed["warmup_steps"] = f"{state.source} scheduler.params.warmup_num_steps"


def launchers(strategy: str) -> list[str]:
    """The launchers with a one-machine script (``launch/NAME.LAUNCHER.sh``) for a config of this strategy: accelerate
    always, torchrun except for FSDP (configured by the accelerate YAML), the deepspeed launcher for DeepSpeed. What
    `generate` writes and what train.py tells a user who starts a config with plain python."""
    return ["accelerate"] + ["torchrun"] * (strategy != "fsdp") + ["deepspeed"] * (strategy == "deepspeed")
