"""A parameter's full size, also when DeepSpeed ZeRO-3 has partitioned it: zero.Init replaces each parameter's data
with an empty (0,) tensor and keeps the real shape and element count on the parameter (``ds_shape``, ``ds_numel``).
An FSDP2 DTensor reports its global shape itself."""

from __future__ import annotations


def full_shape(tensor) -> tuple[int, ...]:
    """The shape of the whole tensor, not of this rank's ZeRO-3 partition."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def full_numel(tensor) -> int:
    """The element count of the whole tensor, not of this rank's ZeRO-3 partition."""
    return getattr(tensor, "ds_numel", None) or tensor.numel()
