"""The strategy catalogue: one name per distributed setup, for `generate --preset NAME` and for the planner.

Each entry is a partial DistributedConfig (everything else takes the model's defaults), a one-line description and,
when ``hf-scale plan`` estimates it, how the planner lists it (:class:`Planned`). The planner's candidates are these
entries (hf_scale.planner.strategies); the files in ``accelerate_configs/``, ``ds_configs/`` and
``hf_scale_configs/`` are generated from them by ``hf-scale generate --preset NAME --output-dir .`` and a test fails
if they drift.

Naming rule of the planner's sizes: an entry that the planner tries at several degrees (``Planned.vary``: tp, cp or
ep, each of 2, 4, 8) is its own name at its own degree (2) and, at another degree, its name with the degree written
after the dimension: ``fsdp2_tp`` at tp=4 is ``fsdp2_tp4``, ``fsdp2_hybrid_tp`` at tp=8 ``fsdp2_hybrid_tp8``
(:func:`sized_name`). With activation checkpointing the planner adds ``_ac`` (``zero3_ac``).

GPU defaults: 8 processes per machine, 2 machines for the multi-node presets, bf16 (Ampere and newer),
micro batch 1 (the Trainer's --per_device_train_batch_size decides in "auto" DeepSpeed mode).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_scale.config.distributed_config import DistributedConfig, config_from_data
from hf_scale.errors import UserError

GPUS_PER_MACHINE = 8
# Reserved, never-resolving name (RFC 2606 ".invalid"): a multi-node launch that was not told the
# real address fails at once instead of hanging. The sbatch script and the launch scripts' environment
# variables override it; `--set topology.main_process_ip=HOST` bakes the real one in.
PLACEHOLDER_MAIN_IP = "main-node.invalid"


@dataclass(frozen=True)
class Planned:
    """How the planner lists an entry: the memory and time it estimates follow from the entry's config (engine, ZeRO
    stage, offload, sharding, degrees: hf_scale.planner.strategies.candidate); this adds what the config cannot say."""

    label: str
    """The name in the plan's tables; ``{size}`` stands for the degree of a varied entry, e.g. "FSDP2 x TP={size}"."""
    vary: str | None = None
    """tp, cp or ep: the planner tries this degree at each of its sizes (named by :func:`sized_name`); None: as is."""


@dataclass(frozen=True)
class Preset:
    """One entry of the strategy catalogue."""

    name: str
    description: str
    config: dict[str, Any]
    planned: Planned | None = None
    """None: the planner does not list it (a topology variant of a planned entry, or a setup it cannot estimate)."""


def _one_machine(strategy: str, **sections: Any) -> dict[str, Any]:
    return {"strategy": strategy, "topology": {"processes_per_machine": GPUS_PER_MACHINE}, **sections}


def _two_machines(strategy: str, **sections: Any) -> dict[str, Any]:
    topology = {
        "num_machines": 2,
        "processes_per_machine": GPUS_PER_MACHINE,
        "main_process_ip": PLACEHOLDER_MAIN_IP,
    }
    return {"strategy": strategy, "topology": topology, **sections}


_PRESETS = [
    # The planner's "ddp" on one GPU is this one (hf_scale.planner.rank.distributed_config): not listed twice.
    Preset("single_gpu", "One process on one GPU, bf16; no distribution.", {"strategy": "single"}),
    Preset("ddp", "Data parallel (DDP) on 8 GPUs of one machine.", _one_machine("ddp"), Planned("DDP")),
    Preset(
        "zero1",
        "DeepSpeed ZeRO-1 (optimizer states sharded) on 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 1}),
        Planned("ZeRO-1"),
    ),
    Preset(
        "zero2",
        "DeepSpeed ZeRO-2 (optimizer states + gradients sharded) on 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 2}),
        Planned("ZeRO-2"),
    ),
    Preset(
        "zero2_offload",
        "ZeRO-2 with optimizer states offloaded to CPU RAM, 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 2, "offload_optimizer": "cpu"}),
        Planned("ZeRO-2 + opt offload"),
    ),
    Preset(
        "zero3",
        "DeepSpeed ZeRO-3 (parameters sharded too), 16-bit weights gathered on save, 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 3}),
        Planned("ZeRO-3"),
    ),
    Preset(
        "zero3_offload_opt",
        "ZeRO-3 with only the optimizer states offloaded to CPU RAM (parameters stay on the GPUs), 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 3, "offload_optimizer": "cpu"}),
        Planned("ZeRO-3 + opt offload"),
    ),
    Preset(
        "zero3_offload",
        "ZeRO-3 with optimizer states and parameters offloaded to CPU RAM, 8 GPUs.",
        _one_machine(
            "deepspeed", deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
        ),
        Planned("ZeRO-3 + opt+param offload"),
    ),
    # Not planned: the planner has no model of NVMe bandwidth (its CPU offload: zero2_offload, zero3_offload).
    Preset(
        "zero3_nvme",
        "ZeRO-3 offloading optimizer states and parameters to local NVMe (/local_nvme), 8 GPUs.",
        _one_machine(
            "deepspeed",
            deepspeed={
                "zero_stage": 3,
                "offload_optimizer": "nvme",
                "offload_params": "nvme",
                "nvme_path": "/local_nvme",
            },
        ),
    ),
    Preset(
        "fsdp2_full_shard",
        "PyTorch FSDP2 full sharding of the decoder layers on 8 GPUs.",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}),
        Planned("FSDP2 full shard"),
    ),
    Preset(
        "fsdp2_hybrid_multinode",
        "FSDP2 hybrid sharding: shard within each machine, replicate across 2 x 8 GPUs.",
        _two_machines("fsdp", fsdp={"version": 2, "sharding": "hybrid_shard"}),
        Planned("FSDP2 hybrid shard"),
    ),
    # The planner's "ddp" on several machines is this one: not listed twice.
    Preset("ddp_multinode", "Data parallel (DDP) across 2 machines x 8 GPUs.", _two_machines("ddp")),
    Preset(
        "fsdp2_tp",
        "FSDP2 x tensor parallelism on 8 GPUs: dp_shard=4 x tp=2, TP inside the machine (large models, ZeRO-3's "
        "all-gathers too slow).",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}, parallelism={"tp": 2}),
        Planned("FSDP2 x TP={size}", vary="tp"),
    ),
    Preset(
        "fsdp2_tp_offload",
        "FSDP2 x tensor parallelism (tp=2) with parameters, gradients and optimizer states offloaded to CPU RAM, "
        "8 GPUs.",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard", "offload_params": True},
                     parallelism={"tp": 2}),
        Planned("FSDP2 x TP={size} + offload", vary="tp"),
    ),
    Preset(
        "fsdp2_hybrid_tp",
        "HSDP x tensor parallelism on 2 x 8 GPUs: tp=2 inside each machine, sharded within it, replicated across.",
        _two_machines("fsdp", fsdp={"version": 2, "sharding": "hybrid_shard"}, parallelism={"tp": 2}),
        Planned("HSDP x TP={size}", vary="tp"),
    ),
    Preset(
        "fsdp2_cp",
        "FSDP2 x context parallelism on 8 GPUs: dp_shard=4 x cp=2, each sequence split over 2 GPUs (long context; "
        "SDPA attention).",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}, parallelism={"cp": 2}),
        Planned("FSDP2 x CP={size}", vary="cp"),
    ),
    Preset(
        "fsdp2_cp_offload",
        "FSDP2 x context parallelism (cp=2) with parameters, gradients and optimizer states offloaded to CPU RAM, "
        "8 GPUs.",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard", "offload_params": True},
                     parallelism={"cp": 2}),
        Planned("FSDP2 x CP={size} + offload", vary="cp"),
    ),
    Preset(
        "fsdp2_ep",
        "FSDP2 x expert parallelism on 8 GPUs: a mixture-of-experts model's experts split over ep=2 (full fine-tune).",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}, parallelism={"ep": 2}),
        Planned("FSDP2 x EP={size}", vary="ep"),
    ),
    Preset(
        "fsdp2_ep_offload",
        "FSDP2 x expert parallelism (ep=2) with parameters, gradients and optimizer states offloaded to CPU RAM, "
        "8 GPUs.",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard", "offload_params": True},
                     parallelism={"ep": 2}),
        Planned("FSDP2 x EP={size} + offload", vary="ep"),
    ),
]

PRESETS: dict[str, Preset] = {preset.name: preset for preset in _PRESETS}
"""The catalogue by name, in the order `hf-scale presets` lists it and the planner breaks ties in (fewer moving parts
first)."""
OWN_DEGREE = 2
"""The degree a varied entry's config has (its ``parallelism``), named by the entry's own name."""


def sized_name(name: str, vary: str, size: int) -> str:
    """The name of entry ``name`` with its ``vary`` degree at ``size``: the name itself at OWN_DEGREE, else the degree
    written after the dimension (``fsdp2_tp``, 4 -> ``fsdp2_tp4``; ``fsdp2_cp_offload``, 8 -> ``fsdp2_cp8_offload``)."""
    return name if size == OWN_DEGREE else name.replace(f"_{vary}", f"_{vary}{size}", 1)


def preset_data(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's raw config dict (for applying overrides before validation)."""
    if name not in PRESETS:
        raise UserError(f"--preset {name!r} is unknown; allowed: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name].config)


def load_preset(name: str, overrides: Sequence[str] = ()) -> DistributedConfig:
    """The preset with dotted ``key=value`` overrides applied (as `config.load_config` applies them to a file),
    validated."""
    return config_from_data(preset_data(name), overrides)


def get_preset(name: str) -> DistributedConfig:
    """The validated DistributedConfig of a preset."""
    return load_preset(name)
