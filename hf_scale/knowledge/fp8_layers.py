"""Which linear layers an FP8 backend runs in fp8 and which stay in bf16 (:func:`plan`), and the one line that says it
(:func:`describe`): train.py logs it at start, `hf-scale check` says it from the model's config, both from here.

The choice is torchao's own auto filter for its default (tensorwise) recipe, which keeps layers whose dimensions are not
multiples of 16 (an fp8 GEMM requirement) or too small to gain (torchao's H100 thresholds) in bf16, plus the LM head,
kept in bf16 for accuracy as torchtitan and accelerate do. TransformerEngine and MS-AMP convert by their own rules
inside accelerate (no filter can be handed to them); :func:`plan` reports what accelerate's TE conversion swaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hf_scale.knowledge.partitioned import full_shape

KEEP_IN_BF16 = ("lm_head",)
"""Kept in bf16 whatever their size: the output head's logits are where fp8's rounding costs the loss most."""
TORCHAO_RECIPE = "tensorwise"
"""torchao's Float8LinearConfig() default scaling (dynamic, per tensor): what accelerate's AORecipeKwargs builds."""


def weight_shape(module) -> tuple[int, ...]:
    """The linear layer's (out_features, in_features), also under DeepSpeed's zero.Init (ZeRO-3, which accelerate
    hands to torchao before DeepSpeed wraps the model), where the weight is partitioned to shape (0,)."""
    return full_shape(module.weight)


def module_filter(backend: str = "torchao") -> Callable:
    """torchao's `module_filter_fn(module, fqn) -> bool`: True converts the linear layer to fp8."""
    if backend != "torchao":
        raise ValueError(f"only torchao takes a module filter, not {backend}")
    import torch
    from torchao.float8 import _auto_filter_for_recipe

    decide = _auto_filter_for_recipe(TORCHAO_RECIPE, filter_fqns=list(KEEP_IN_BF16))

    def keep_in_fp8(module, fqn: str) -> bool:
        # torchao's filter unpacks `module.weight.shape`; a ZeRO-3-partitioned layer is asked about through a
        # weightless stand-in of its real shape (on the meta device), so the decision stays torchao's own.
        if isinstance(module, torch.nn.Linear) and module.weight.dim() != 2:
            out_features, in_features = weight_shape(module)
            with torch.device("meta"):
                module = torch.nn.Linear(in_features, out_features, bias=False)
        return decide(module, fqn)

    return keep_in_fp8


@dataclass(frozen=True)
class Plan:
    backend: str
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    """Linear layers left in bf16 -> why."""


def _why_kept(name: str, module) -> str:
    out_features, in_features = weight_shape(module)
    if any(keep in name for keep in KEEP_IN_BF16):
        return "output head"
    if in_features % 16 or out_features % 16:
        return "dimensions not multiples of 16"
    return "below the backend's size threshold"


def plan(model, backend: str) -> Plan:
    """Which linear layers of ``model`` the backend runs in fp8 and which stay in bf16 (nothing is changed)."""
    import torch

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if backend == "torchao":
        keep = module_filter("torchao")
        converts = {name: keep(module, name) for name, module in linears}
    else:
        # accelerate.utils.transformer_engine.convert_model swaps every nn.Linear whose dimensions are multiples
        # of 16 (the head included); MS-AMP casts every linear weight.
        converts = {name: backend == "msamp" or not any(d % 16 for d in weight_shape(m)) for name, m in linears}
    by_name = dict(linears)
    return Plan(backend=backend, converted=[n for n, c in converts.items() if c],
                kept={n: _why_kept(n, by_name[n]) for n, c in converts.items() if not c})


def describe(fp8_plan: Plan) -> str:
    """The one line train.py logs: how many linear layers run in fp8, which stay in bf16 and why."""
    reasons: dict[str, list[str]] = {}
    for name, why in fp8_plan.kept.items():
        reasons.setdefault(why, []).append(name)
    total = len(fp8_plan.converted) + len(fp8_plan.kept)
    kept = "; ".join(f"{why}: {len(names)} ({names[0]}{', ...' if len(names) > 1 else ''})"
                     for why, names in reasons.items())
    line = f"fp8 ({fp8_plan.backend}): {len(fp8_plan.converted)} of {total} linear layers in fp8"
    return line + (f"; kept in bf16: {kept}" if kept else "")
