"""transformers' checkpoint conversion, one tensor at a time: the names and shapes `save_pretrained` writes for a
tensor of the model at run time, and back.

transformers 5 keeps some weights in another form at run time than on disk: a mixture-of-experts model's experts
are fused (`mlp.experts.gate_up_proj`, one [experts, 2 x intermediate, hidden] tensor) while its checkpoints hold
them per expert (`mlp.experts.0.gate_proj.weight`, ...), as the Hub's files do. `from_pretrained` converts on load
(`transformers.conversion_mapping`: WeightConverter / WeightRenaming per model type) and `save_pretrained` reverts
the conversion on save (`transformers.core_model_loading.revert_weight_conversion`). The final save's proof
(hf_scale.train.checkpoint.save) and `hf-scale export` (a Trainer checkpoint's model.safetensors is a
save_pretrained file) ask transformers' own conversion here rather than restating it. A tensor the model keeps as
saved comes back as it is.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def saved_form(model, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """{saved name: tensor} that `save_pretrained` writes for `model`'s run-time tensor `name` (`tensor` its full
    value, or a meta tensor for the names and shapes only): transformers' revert of its conversion, on this tensor
    alone."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor})


class Loader:
    """The run-time tensor of `model` from its saved pieces: transformers' load conversion (the reverse of what
    `save_pretrained` reverts), found once per model."""

    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        conversions = getattr(model, "_weight_conversions", None)  # a model from from_pretrained: the ones it used
        if conversions is None:
            # As revert_weight_conversion does for a model built from its config: the model type's mapping, without
            # the legacy renamings and prefix changes no saved file of this model has.
            conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                           if not isinstance(c, PrefixChange)]
        # revert_weight_conversion reverses the transforms it is given: given the reversed ones, it loads.
        self._loading = SimpleNamespace(_weight_conversions=[c.reverse_transform() for c in conversions[::-1]],
                                        config=model.config)

    def runtime_tensor(self, name: str, saved: dict[str, torch.Tensor]) -> torch.Tensor:
        """`name`'s run-time tensor from the saved tensors `saved_form` names for it."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self._loading, saved)[name]
