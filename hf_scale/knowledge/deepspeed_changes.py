"""What DeepSpeed releases changed under configs that used to run, each rule with the release that brought it.

`hf-scale check` and `hf-scale doctor` ask the same table, keyed on the installed DeepSpeed: a config the installed
release refuses at start is an error; on an older one the same finding is a warning, since the machine checking is
never the cluster, and the cluster's release is what `pip install deepspeed` gives today.

Verified against the DeepSpeed source: the removed keys in 0.19.8's ``runtime/config.py``
(``_REMOVED_TOP_LEVEL_CONFIG_KEYS``, ``_REMOVED_ZERO_CONFIG_KEYS``, refused by ``DeepSpeedConfig`` with
``DeepSpeedConfigError``; deepspeedai/DeepSpeed#8489); the warmup schedulers' ``ValueError: warmup_num_steps must be
a positive integer`` (``runtime/lr_schedules.py``, #8126, first in 0.19.3); offload's ``pin_memory`` default true
(``runtime/zero/offload_config.py``, #8207, first in 0.19.5).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from hf_scale.knowledge.installed import version_of

REMOVED_KEYS_SINCE = "0.19.7"
REMOVED_KEYS: dict[str, str] = {
    "nebula": "Nebula checkpointing was removed (checkpoints are saved with torch.save)",
    "compression_training": "the compression library was removed",
    "amp": "NVIDIA Apex AMP was removed; use the bf16 or fp16 block",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse gradients of dense embeddings were removed",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization was removed",
    "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch sizes directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "the top-level curriculum_learning was removed; use data_efficiency.data_sampling."
                           "curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
    "zero_optimization.mics_shard_size": "MiCS sharding was removed",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS sharding was removed",
    "zero_optimization.zeropp_loco_param": "LoCo-Zero++ was removed (ZeRO++ quantized gradients stay)",
}
"""Key path -> what happened to it; DeepSpeed refuses the whole config at start when one is present."""

POSITIVE_WARMUP_SINCE = "0.19.3"
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""The schedulers whose ``warmup_num_steps`` must be an integer >= 1 (a 0 was clamped to 2 before)."""

PINNED_OFFLOAD_SINCE = "0.19.5"
OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")


@dataclass(frozen=True)
class Change:
    """One place a config meets a change: the key path, what the release does with it, and whether the installed
    DeepSpeed already does it (else a later install will)."""

    path: str
    problem: str
    since: str
    installed: str | None

    @property
    def applies_here(self) -> bool:
        return self.installed is not None and Version(self.installed).release >= Version(self.since).release

    def describe(self) -> str:
        here = f"installed here: {self.installed}" if self.installed else "not installed here"
        return f"DeepSpeed >= {self.since} {self.problem} ({here})"


def _block(ds: dict[str, Any], name: str) -> dict[str, Any]:
    value = ds.get(name)
    return value if isinstance(value, dict) else {}


def removed_keys(ds: dict[str, Any]) -> Iterator[Change]:
    """Each removed key the config holds."""
    installed = version_of("deepspeed")
    for path, what in REMOVED_KEYS.items():
        section, _, key = path.rpartition(".")
        if key in (_block(ds, section) if section else ds):
            yield Change(path, f"refuses the config at start: {what}", REMOVED_KEYS_SINCE, installed)


def warmup_refused(ds: dict[str, Any]) -> Change | None:
    """A warmup scheduler with a concrete warmup_num_steps below 1 ("auto": the Trainer fills at least 1)."""
    scheduler = _block(ds, "scheduler")
    steps = _block(scheduler, "params").get("warmup_num_steps")
    if scheduler.get("type") not in WARMUP_SCHEDULERS or steps is None or steps == "auto":
        return None
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return None
    return Change("scheduler.params.warmup_num_steps",
                  f"refuses {scheduler['type']} with warmup_num_steps={steps!r} at start (ValueError: "
                  "warmup_num_steps must be a positive integer)", POSITIVE_WARMUP_SINCE, version_of("deepspeed"))


def pinned_offload(ds: dict[str, Any]) -> list[str]:
    """The offload blocks (to cpu or nvme) that pin host memory: ``pin_memory`` true, or left out on a DeepSpeed
    >= 0.19.5 (its new default). Pinned pages count against the locked-memory limit (``ulimit -l``)."""
    zero = _block(ds, "zero_optimization")
    installed = version_of("deepspeed")
    default = installed is None or Version(installed).release >= Version(PINNED_OFFLOAD_SINCE).release
    return [f"zero_optimization.{name}" for name in OFFLOAD_BLOCKS
            if _block(zero, name).get("device") in ("cpu", "nvme") and _block(zero, name).get("pin_memory", default)
            is True]
