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

With ``--packing`` the rows carry no ``attention_mask`` (one would switch off transformers' packed-sequence detection),
so the model's own aux loss counts the padding rows as tokens routed to experts. The loops hand the packed batch's
``real_token_mask`` to :meth:`Router.aux_loss`, which recomputes the loss with the model's own
``load_balancing_loss_func`` (every transformers MoE model with ``router_aux_loss_coef`` defines one, taking an
attention mask) from the router logits the model returned, the padding left out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_scale.train.data.packing import REAL_TOKEN_MASK


@dataclass(frozen=True)
class Router:
    """The router auxiliary loss a loop adds itself (see the module docstring)."""

    coefficient: float
    """The model's configured ``router_aux_loss_coef`` (its module attribute is 0 while hf_scale adds the term)."""
    balancing_loss: Callable
    """The model's ``load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)``."""
    num_experts: int
    top_k: int

    def aux_loss(self, outputs: Any, batch: dict):
        """The micro-batch's aux loss (a tensor in the graph), None outside training (the model returned none): the
        model's own where the batch marks no padding, else recomputed over the tokens of ``real_token_mask``."""
        aux = getattr(outputs, "aux_loss", None)
        mask = batch.get(REAL_TOKEN_MASK)
        if aux is None or mask is None or getattr(outputs, "router_logits", None) is None:
            return aux
        return self.balancing_loss(outputs.router_logits, self.num_experts, self.top_k, mask)

    def step_term(self, aux, accumulation: int):
        """What a micro-batch adds to its (already data-parallel-multiplied) loss: ``coefficient x aux /
        accumulation``; 0 without an aux loss."""
        return 0.0 if aux is None else self.coefficient * aux / accumulation


def take_over(model) -> Router | None:
    """When the model returns a router auxiliary loss in training (a module with ``router_aux_loss_coef`` whose
    config has ``output_router_logits``), zero that module's coefficient and return the :class:`Router` that adds it
    instead; None (and the model untouched) otherwise. The saved config keeps its coefficient: only the module
    attribute changes."""
    from hf_scale.config.expert_parallel import expert_counts

    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "router_aux_loss_coef") and getattr(config, "output_router_logits", False):
            routed, active, _ = expert_counts(config)
            router = Router(float(module.router_aux_loss_coef), _balancing_loss(module), routed, active)
            module.router_aux_loss_coef = 0.0
            return router
    return None


def _balancing_loss(module) -> Callable:
    """The ``load_balancing_loss_func`` of the modeling file that defines the module's class (searched up its
    classes: FSDP2 wraps the model in a subclass defined elsewhere)."""
    for cls in type(module).__mro__:
        function = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if function is not None:
            return function
    raise TypeError(f"{type(module).__name__} has router_aux_loss_coef but its modeling file no "
                    "load_balancing_loss_func: hf_scale cannot weight its router loss")


def aux_value(aux):
    """The micro-batch's aux loss, detached (0.0 without one), for the step's record."""
    return 0.0 if aux is None else aux.detach().float()
