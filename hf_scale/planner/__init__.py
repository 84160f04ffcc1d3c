"""Planner: exact parameter counts (meta device), per-GPU memory and predicted step time (time_model, on the GPU
profiles of hardware) of every distributed strategy, and the fastest one that fits. ``hf-scale plan``
(hf_scale/commands/plan.py) is its command line."""

from hf_scale.knowledge.model_shapes import ModelShapes, load_model_config, model_shapes
from hf_scale.planner.estimate import Candidate, Estimate, Workload, activation_bytes, estimate, logits_bytes
from hf_scale.planner.rank import Assessment, Plan, distributed_config, make_plan

__all__ = [
    "Assessment",
    "Candidate",
    "Estimate",
    "ModelShapes",
    "Plan",
    "Workload",
    "activation_bytes",
    "distributed_config",
    "estimate",
    "load_model_config",
    "logits_bytes",
    "make_plan",
    "model_shapes",
]
