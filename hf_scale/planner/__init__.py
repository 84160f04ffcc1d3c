"""Memory planner: exact parameter counts (meta device), per-GPU memory of every distributed strategy, and
the fastest one that fits. ``hf-scale plan`` (hf_scale/plan.py) is its command line.

The names below are imported on first use: only ``model_shapes`` needs torch and transformers, and
`hf-scale plan --help` must not wait for them.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "hf_scale.planner.estimate": ("Candidate", "Estimate", "Workload", "activation_bytes", "estimate", "logits_bytes"),
    "hf_scale.planner.model_shapes": ("ModelShapes", "load_model_config", "model_shapes"),
    "hf_scale.planner.rank": ("Assessment", "Plan", "distributed_config", "make_plan"),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)


def __getattr__(name: str):
    for module, names in _EXPORTS.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
