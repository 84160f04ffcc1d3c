"""The values of train.py's flags, each in the range where it means something, checked before anything loads.

argparse checks types only; transformers and torch accept most out-of-range values and fail later with a
traceback (numpy's seed, the DataLoader's workers, os.makedirs('')) or, worse, run with them (--save_steps 0
saves every step in the manual loop). Each refusal is one line naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import math

from hf_scale.errors import UserError

MAX_LEARNING_RATE = 10.0
"""Above any rate that trains (SGD rarely exceeds 1, Adam 1e-2): a larger one is a typo (1e30 for 1e-3)."""
MAX_SEED = 2**32 - 1
"""numpy's legacy seeding (transformers' set_seed) takes 0 .. 2**32-1."""


_AT_LEAST = {"dataloader_num_workers": 0, "per_device_eval_batch_size": 1, "eval_accumulation_steps": 1,
             "dataloader_prefetch_factor": 1, "save_total_limit": 1, "ddp_timeout": 1}
"""Integer flags and their least value; None (the default) leaves the choice to hf_scale or transformers."""
_STEP_FLAGS = {"save_steps": "save_strategy", "logging_steps": "logging_strategy", "eval_steps": "eval_strategy"}
"""Interval flags, with the strategy that reads them when it is "steps"."""
_SCHEDULE_OWN = ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")
"""A schedule's arguments that the Trainer and the manual loop fill themselves."""


def check(ns) -> None:
    """Every float flag finite; each flag of a range in it (one line naming the first that is not)."""
    for name, value in vars(ns).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name}={value}: must be a finite number")
    if not 0 <= ns.learning_rate <= MAX_LEARNING_RATE:
        raise UserError(f"--learning_rate={ns.learning_rate}: must be in [0, {MAX_LEARNING_RATE:g}]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(ns, name) < 1:
            raise UserError(f"--{name}={getattr(ns, name)}: must be in [0, 1)")
    for name in ("weight_decay", "adam_epsilon", "max_grad_norm", "warmup_steps", "neftune_noise_alpha"):
        if (getattr(ns, name, None) or 0) < 0:
            raise UserError(f"--{name}={getattr(ns, name)}: must be >= 0")
    if not 0 <= ns.label_smoothing_factor < 1:
        raise UserError(f"--label_smoothing_factor={ns.label_smoothing_factor}: must be in [0, 1)")
    if not 0 <= ns.max_bad_row_fraction <= 1:
        raise UserError(f"--max_bad_row_fraction={ns.max_bad_row_fraction}: must be in [0, 1]")
    for name in ("seed", "data_seed"):
        value = getattr(ns, name)
        if value is not None and not 0 <= value <= MAX_SEED:
            raise UserError(f"--{name}={value}: must be an integer from 0 to {MAX_SEED} (2**32 - 1)")
    for name, least in _AT_LEAST.items():
        value = getattr(ns, name, None)
        if value is not None and value < least:
            raise UserError(f"--{name}={value}: must be >= {least}")
    _check_intervals(ns)
    if ns.torch_compile_mode is not None:
        from torch._inductor import list_mode_options  # torch's own list of modes, checked before the compile

        try:
            list_mode_options(ns.torch_compile_mode)
        except RuntimeError as error:
            raise UserError(f"--torch_compile_mode={ns.torch_compile_mode}: {error}") from None
    _check_scheduler_kwargs(ns)
    if not str(ns.output_dir).strip():
        what = "empty" if not ns.output_dir else "only whitespace"
        raise UserError(f"--output_dir is {what}: it must name a directory (created if missing)")


def _check_intervals(ns) -> None:
    """--save_steps, --logging_steps, --eval_steps under their "steps" strategy: a number of steps >= 1, or a
    fraction in (0, 1) of the run (transformers' rule); 0 or less would save/log/evaluate at every step."""
    for name, strategy in _STEP_FLAGS.items():
        value, chosen = getattr(ns, name, None), getattr(ns, strategy, None)
        if value is None or getattr(chosen, "value", chosen) != "steps":
            continue
        if value <= 0 or (value > 1 and value != int(value)):
            raise UserError(f"--{name}={value:g}: must be a whole number of steps >= 1, or a fraction in (0, 1) of "
                            f"the run, with --{strategy} steps (--{strategy} no turns it off)")


def _check_scheduler_kwargs(ns) -> None:
    """--lr_scheduler_kwargs: only arguments the chosen schedule takes (transformers passes them on as **kwargs:
    an unknown one is a TypeError once training starts; the constant schedules silently drop them)."""
    if not ns.lr_scheduler_kwargs:
        return
    import inspect

    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    kind = SchedulerType(ns.lr_scheduler_type)
    params = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[kind]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    constant = kind in (SchedulerType.CONSTANT, SchedulerType.CONSTANT_WITH_WARMUP)
    allowed = [] if constant else [n for n in params if n not in _SCHEDULE_OWN]
    unknown = sorted(set(ns.lr_scheduler_kwargs) - set(allowed))
    if unknown:
        raise UserError(f"--lr_scheduler_kwargs: {unknown[0]!r} is not an argument of --lr_scheduler_type "
                        f"{kind.value}; allowed: {', '.join(allowed) or 'none'}")
