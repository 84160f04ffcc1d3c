"""The planner's candidates are the strategy catalogue's entries (hf_scale.config.presets): what it estimates of an
entry (engine, ZeRO stage, offload, sharding, degrees) is read from the entry's own config, so a preset and the
candidate of the same setup cannot disagree, and they have one name."""

from __future__ import annotations

from dataclasses import fields, replace
from functools import cache

from hf_scale.config.presets import PRESETS, Preset, get_preset, sized_name
from hf_scale.planner.estimate import Candidate


def planned(vary: str | None) -> list[Preset]:
    """The catalogue's planned entries whose varied degree is ``vary`` (None: the ones planned as they are), in the
    catalogue's order (the planner's tie order)."""
    return [entry for entry in PRESETS.values() if entry.planned is not None and entry.planned.vary == vary]


@cache
def candidate(name: str, size: int | None = None) -> Candidate:
    """The candidate of catalogue entry ``name`` (its varied degree at ``size``, named by presets.sized_name), without
    activation checkpointing."""
    entry, cfg = PRESETS[name], get_preset(name)
    vary = entry.planned.vary
    key = sized_name(name, vary, size) if vary and size is not None else name
    degrees = {dim: getattr(cfg.parallelism, dim) or 1 for dim in ("tp", "cp", "ep")}  # None: not split
    if vary and size is not None:
        degrees[vary] = size
    label = entry.planned.label.format(size=degrees.get(vary or "", 1))
    if cfg.strategy == "deepspeed":
        ds = cfg.deepspeed
        return Candidate(key, label, "deepspeed", zero_stage=ds.zero_stage, offload_optimizer=ds.offload_optimizer
                         != "none", offload_params=ds.offload_params != "none")
    if cfg.strategy == "fsdp":
        return Candidate(key, label, "fsdp", offload_params=cfg.fsdp.offload_params,
                         hybrid=cfg.fsdp.sharding == "hybrid_shard", **degrees)
    return Candidate(key, label, "ddp")


_SETUP = tuple(f.name for f in fields(Candidate) if f.name not in ("key", "label", "activation_checkpointing"))
"""What makes two candidates the same setup: everything but the names and the checkpointing choice."""


def named(c: Candidate) -> Candidate:
    """``c`` with the catalogue's name and label of its setup (at its degree); ``c`` unchanged when the catalogue has
    no entry for it (e.g. tp and cp together)."""
    for entry in PRESETS.values():
        vary = entry.planned.vary if entry.planned else None
        if entry.planned is None or (vary and getattr(c, vary) < 2):
            continue  # not planned, or c is not split along the entry's dimension
        match = candidate(entry.name, getattr(c, vary) if vary else None)
        if all(getattr(match, f) == getattr(c, f) for f in _SETUP):
            return replace(c, key=match.key, label=match.label)
    return c
