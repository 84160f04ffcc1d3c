"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model, weighted once per optimizer step.

transformers' MoE models (Qwen3-MoE, Mixtral, ...) with ``config.output_router_logits`` add
``router_aux_loss_coef x aux_loss`` to the loss of every forward. Both loops normalise the token loss over the whole
accumulation window (sum of token losses / the window's targets on all ranks) and multiply each rank's loss by the
data-parallel size; the model's aux term would ride along that arithmetic and count ``gradient_accumulation_steps x
data-parallel size`` times (the Trainer's own rule does the same: the coefficient grows with accumulation and ranks).
hf_scale takes the term over: the model's coefficient is set to 0 (so its returned loss is the token loss alone) and
each micro-batch adds ``coefficient x aux_loss / gradient_accumulation_steps`` after the data-parallel multiplier, so
the step's gradient holds ``coefficient x`` the mean of the global batch's micro-batch aux losses, whatever the
accumulation, the number of ranks and the expert-parallel size. That is Megatron-LM's convention (each micro-batch's
aux loss scaled by 1/num_microbatches, ``MoEAuxLossAutoScaler``); the Switch loss is a product of two batch means, so
a batch split into micro-batches is the mean of their losses, which equals one big batch's when the micro-batches route
alike (tests/train/model/test_router_loss.py).
"""

from __future__ import annotations

from typing import Any


def take_over(model) -> float | None:
    """When the model returns a router auxiliary loss in training (a module with ``router_aux_loss_coef`` whose
    config has ``output_router_logits``), zero that module's coefficient and return the configured one; None (and
    the model untouched) otherwise. The saved config keeps its coefficient: only the module attribute changes."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "router_aux_loss_coef") and getattr(config, "output_router_logits", False):
            coefficient = float(module.router_aux_loss_coef)
            module.router_aux_loss_coef = 0.0
            return coefficient
    return None


def step_term(outputs: Any, coefficient: float | None, accumulation: int):
    """What a micro-batch adds to its (already data-parallel-multiplied) loss: ``coefficient x aux_loss /
    accumulation``; 0 without a router loss (or outside training, when the model returns none)."""
    aux = getattr(outputs, "aux_loss", None) if coefficient else None
    if aux is None:
        return 0.0
    return coefficient * aux / accumulation


def aux_value(outputs: Any):
    """The micro-batch's aux loss, detached (0.0 when the model returned none), for the step's record."""
    aux = getattr(outputs, "aux_loss", None)
    return 0.0 if aux is None else aux.detach().float()
