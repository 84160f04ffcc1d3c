"""What a DeepSpeed config's `optimizer` and `scheduler` blocks take over from the training flags.

With an `optimizer` block the HF Trainer hands the optimizer to DeepSpeed (transformers'
`deepspeed_optim_sched`; hf_scale's manual loop does the same): `--optim` and `--optim_args` are then
ignored and `optimizer.type` runs. With a `scheduler` block DeepSpeed's scheduler runs and
`--lr_scheduler_type` / `--lr_scheduler_kwargs` are ignored: e.g. `WarmupLR` stays constant after its
warmup (logarithmic unless `warmup_type` is "linear"), where the Trainer's default decays linearly to 0.
The numbers the Trainer *compares* (lr, betas, eps, weight decay, warmup steps) are not overridden
silently: a concrete value that disagrees with its flag stops the Trainer at start.

`hf-scale check` reports these blocks as `ds-overrides-flags`. train.py prints one warning line and refuses
to start when one of the replaced flags was given explicitly: an explicit choice that would silently not
happen is a mistake, while a block replacing defaults is how many public configs (axolotl, LLaMA-Factory,
accelerate's tests) ask for DeepSpeed's own optimizer on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

# block -> the training flags it replaces (transformers' deepspeed_optim_sched; create_optimizer/create_scheduler
# read these flags only when the block is absent).
REPLACED_FLAGS = {
    "optimizer": ("optim", "optim_args"),
    "scheduler": ("lr_scheduler_type", "lr_scheduler_kwargs"),
}
# DeepSpeed's warmup schedulers whose warmup is logarithmic unless params.warmup_type says "linear".
_LOG_WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# DeepSpeed's schedulers that never lower the learning rate after their warmup (deepspeed.runtime.lr_schedules).
_NO_DECAY_SCHEDULERS = ("WarmupLR",)


@dataclass(frozen=True)
class Override:
    """A block of the DeepSpeed config that replaces training flags."""

    block: str
    """`optimizer` or `scheduler`."""
    ds_type: Any
    """The block's `type`."""
    flags: tuple[str, ...]
    """The flags it replaces (without `--`)."""
    given: tuple[str, ...]
    """Those of them given explicitly on the command line."""
    log_warmup: bool = False
    """A DeepSpeed warmup scheduler whose warmup is logarithmic (its default), not linear."""

    @property
    def path(self) -> str:
        return f"{self.block}.type"


def _adamw_like(section: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """DeepSpeed's Adam/AdamW with decoupled weight decay (its default adam_w_mode): the algorithm of the
    Trainer's default --optim (adamw_torch / adamw_torch_fused)."""
    return str(section.get("type", "")).lower() in ("adam", "adamw") and params.get("adam_w_mode", True) is True


def _linear_like(section: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """WarmupDecayLR with a linear warmup from 0: the Trainer's default --lr_scheduler_type linear."""
    return (
        section.get("type") == "WarmupDecayLR"
        and params.get("warmup_type") == "linear"
        and params.get("warmup_min_lr", 0) in (0, "auto")
    )


def find_overrides(ds_config: Mapping[str, Any], given: Set[str]) -> list[Override]:
    """The blocks that change what the flags would train with: an `optimizer` block unless it is AdamW in
    place of the default --optim, a `scheduler` block unless it is linear warmup + decay in place of the
    default --lr_scheduler_type, and any block replacing a flag given explicitly (`given`: the flags typed, as
    rules.given_flags found them)."""
    found = []
    for block, flags in REPLACED_FLAGS.items():
        section = ds_config.get(block)
        if not isinstance(section, Mapping):
            continue
        ds_type = section.get("type")
        params = section.get("params") if isinstance(section.get("params"), Mapping) else {}
        log_warmup = block == "scheduler" and ds_type in _LOG_WARMUP_SCHEDULERS and params.get(
            "warmup_type", "log"
        ) != "linear"
        typed = tuple(flag for flag in flags if flag in given)
        same = _adamw_like(section, params) if block == "optimizer" else _linear_like(section, params)
        if same and not typed:
            continue
        found.append(Override(block, ds_type, flags, typed, log_warmup))
    return found


def _show(value: Any) -> str:
    value = getattr(value, "value", value)  # enums such as SchedulerType
    return "none" if value in (None, "", {}) else str(value)


def describe(override: Override, flag_values: Mapping[str, Any]) -> str:
    """One sentence: what runs instead of which flags (with their values)."""
    flags = ", ".join(
        f"--{flag}"
        + (f" {_show(flag_values[flag])}" if flag in flag_values else "")
        + ("" if flag in override.given else " (default)")
        for flag in override.flags
        if flag in override.given or flag == override.flags[0]
    )
    what = "optimizer" if override.block == "optimizer" else "learning-rate scheduler"
    text = f"DeepSpeed's {what} {override.path}={override.ds_type!r} runs instead of {flags}"
    notes = []
    if override.log_warmup:
        notes.append("its warmup is logarithmic unless params.warmup_type is \"linear\"")
    if override.ds_type in _NO_DECAY_SCHEDULERS:
        notes.append("after the warmup it stays at warmup_max_lr: no decay")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def startup_message(overrides: Sequence[Override], flag_values: Mapping[str, Any], where: str) -> str:
    """train.py's one warning line."""
    return f"{where}: " + "; ".join(describe(o, flag_values) for o in overrides)


def refusal(overrides: Sequence[Override], flag_values: Mapping[str, Any], where: str) -> str | None:
    """train.py's one-line error when a replaced flag was given explicitly (None when none was)."""
    explicit = [o for o in overrides if o.given]
    if not explicit:
        return None
    flags = " and ".join("/".join(f"--{f}" for f in o.given) for o in explicit)
    return (
        f"{where}: " + "; ".join(describe(o, flag_values) for o in explicit)
        + f": {flags} would be ignored; drop {flags}, or remove the block from the DeepSpeed config"
    )
