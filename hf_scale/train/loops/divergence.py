"""Stop at the first non-finite loss or gradient norm, before anything of that step is saved.

A NaN/inf loss or gradient norm means the weights are (or are about to be) garbage: every later step and
every checkpoint would carry it. Both loops call :func:`check_step` after each optimizer step with values
that are already the same on every rank (the loss all-reduced, the gradient norm computed over the
synchronised gradients), before the step's checkpoint, so all ranks stop together and the newest
checkpoint stays the last good one. Under fp16 a non-finite gradient norm is normal — dynamic loss scaling
skips that step and lowers the scale — so there only the loss counts.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store


def check_step(step: int, loss: float, grad_norm: float | None, *, loss_scaling: bool,
               output_dir: str | Path, trusted: Collection[Path] = frozenset()) -> None:
    """One-line UserError naming the step when its loss (or, without loss scaling, its gradient norm) is
    not finite. `trusted`: the checkpoints the run's Publisher wrote or verified (`checkpoint.intact_note`)."""
    bad = [] if math.isfinite(loss) else [f"loss {loss}"]
    if grad_norm is not None and not math.isfinite(grad_norm) and not loss_scaling:
        bad.append(f"gradient norm {grad_norm}")
    if bad:
        raise UserError(
            f"step {step}: {' and '.join(bad)}; training stopped before saving anything of this step; "
            f"{store.intact_note(output_dir, trusted)}. Lower --learning_rate, check the data and the model's "
            "weights, or go back to an earlier checkpoint"
        )
