"""Named starting points for common setups.

Each preset is a partial DistributedConfig (everything else takes the model's defaults). The files in
``accelerate_configs/`` and ``ds_configs/`` are generated from these by
``hf-scale generate --preset NAME --output-dir .`` and a test fails if they drift.

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
class Preset:
    name: str
    description: str
    config: dict[str, Any]


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
    Preset("single_gpu", "One process on one GPU, bf16; no distribution.", {"strategy": "single"}),
    Preset("ddp", "Data parallel (DDP) on 8 GPUs of one machine.", _one_machine("ddp")),
    Preset(
        "zero1",
        "DeepSpeed ZeRO-1 (optimizer states sharded) on 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 1}),
    ),
    Preset(
        "zero2",
        "DeepSpeed ZeRO-2 (optimizer states + gradients sharded) on 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 2}),
    ),
    Preset(
        "zero2_offload",
        "ZeRO-2 with optimizer states offloaded to CPU RAM, 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 2, "offload_optimizer": "cpu"}),
    ),
    Preset(
        "zero3",
        "DeepSpeed ZeRO-3 (parameters sharded too), 16-bit weights gathered on save, 8 GPUs.",
        _one_machine("deepspeed", deepspeed={"zero_stage": 3}),
    ),
    Preset(
        "zero3_offload",
        "ZeRO-3 with optimizer states and parameters offloaded to CPU RAM, 8 GPUs.",
        _one_machine(
            "deepspeed", deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
        ),
    ),
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
    ),
    Preset(
        "fsdp2_hybrid_multinode",
        "FSDP2 hybrid sharding: shard within each machine, replicate across 2 x 8 GPUs.",
        _two_machines("fsdp", fsdp={"version": 2, "sharding": "hybrid_shard"}),
    ),
    Preset("ddp_multinode", "Data parallel (DDP) across 2 machines x 8 GPUs.", _two_machines("ddp")),
    Preset(
        "fsdp2_tp",
        "FSDP2 x tensor parallelism on 8 GPUs: dp_shard=4 x tp=2, TP inside the machine (large models, ZeRO-3's "
        "all-gathers too slow).",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}, parallelism={"tp": 2}),
    ),
    Preset(
        "fsdp2_cp",
        "FSDP2 x context parallelism on 8 GPUs: dp_shard=4 x cp=2, each sequence split over 2 GPUs (long context; "
        "SDPA attention).",
        _one_machine("fsdp", fsdp={"version": 2, "sharding": "full_shard"}, parallelism={"cp": 2}),
    ),
]

PRESETS: dict[str, Preset] = {preset.name: preset for preset in _PRESETS}


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
