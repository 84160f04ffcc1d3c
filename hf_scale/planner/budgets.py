"""Time budgets of a preemption, from the predicted step and save (hf_scale.planner.time_model): how long before the
SLURM time limit train.py is signalled (`#SBATCH --signal=USR1@N`) and how long a pod may take between SIGTERM and
SIGKILL (`terminationGracePeriodSeconds`). Both must cover the optimizer step in progress plus one checkpoint save;
`generate --strategy auto` and `plan --write-config` write them into the config (cluster.preempt_signal_lead_s,
cluster.termination_grace_period_s), and `hf-scale check` compares a hand-written launch file with them."""

from __future__ import annotations

import math

from hf_scale.config.cluster_section import DEFAULT_GRACE_PERIOD_S, DEFAULT_SIGNAL_LEAD_S
from hf_scale.planner.time_model import StepTime

HEADROOM = 1.5
"""Factor on step + save: the prediction's own error (docs/plan.md: 98% of the published rows within +-25% out of
sample) and a filesystem slower than assumed, with room to spare."""


def preemption_budget_s(step_s: float, save_s: float) -> dict[str, int]:
    """{"lead": SLURM's --signal lead, "grace": the pods' grace period} for a step of ``step_s`` and a save of
    ``save_s`` seconds: HEADROOM x (step + save), never below the floors (the former fixed values, 120 s for SLURM's
    signal and 600 s for the grace period)."""
    seconds = math.ceil(HEADROOM * (step_s + save_s))
    return {"lead": max(DEFAULT_SIGNAL_LEAD_S, seconds), "grace": max(DEFAULT_GRACE_PERIOD_S, seconds)}


def preemption_budget(step: StepTime) -> dict[str, int]:
    """The cluster fields of :func:`preemption_budget_s` for the predicted ``step``."""
    budget = preemption_budget_s(step.step_s, step.save_s)
    return {"preempt_signal_lead_s": budget["lead"], "termination_grace_period_s": budget["grace"]}
