"""accelerate config YAML (``accelerate launch --config_file``) from a DistributedConfig.

Written the way ``accelerate config`` writes it (sorted keys, its key names), with the choices that
accelerate 1.x needs to be told explicitly:

* ``num_processes`` is the TOTAL over all machines (accelerate divides by ``num_machines``).
* DeepSpeed points at the generated JSON through ``deepspeed_config_file`` and repeats nothing that is in
  it: with a config file, accelerate raises at launch on ``gradient_accumulation_steps``,
  ``gradient_clipping``, ``zero_stage``, ``offload_*``, ``zero3_save_16bit_model`` in ``deepspeed_config``
  and on a top-level ``mixed_precision`` (``DeepSpeedPlugin._deepspeed_config_checks``); the precision
  comes from the JSON's bf16/fp16 blocks (fp8: bf16, as accelerate runs it; train.py takes the fp8 recipe from
  --hf_scale_config).
* precision fp8 (without DeepSpeed): ``mixed_precision: fp8`` and an ``fp8_config`` in the keys ``accelerate
  launch`` reads (hf_scale.knowledge.precision_rules).
* FSDP hybrid sharding under FSDP2 is a 2-D device mesh: accelerate builds it from
  ``parallelism_config`` (dp_replicate = machines, dp_shard = processes per machine); so are TP, CP and SP
  (``hf_scale.config.parallelism.yaml_block``: the keys ``accelerate config`` writes).
"""

from __future__ import annotations

from typing import Any

import yaml

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.config.parallelism import yaml_block
from hf_scale.contract.accelerate_fsdp import fsdp_yaml_section
from hf_scale.knowledge.precision_rules import fp8_accelerate_section
from hf_scale.knowledge.rules import FP8

_DISTRIBUTED_TYPE = {"single": "NO", "ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}
def accelerate_config(cfg: DistributedConfig, *, deepspeed_config_file: str | None) -> dict[str, Any]:
    """The accelerate ClusterConfig as a dict. ``deepspeed_config_file`` (a path relative to the
    directory ``accelerate launch`` runs in) is required for, and only for, strategy deepspeed."""
    if (cfg.strategy == "deepspeed") != (deepspeed_config_file is not None):
        raise ValueError("deepspeed_config_file is required for strategy deepspeed and only for it")
    topo = cfg.topology
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": _DISTRIBUTED_TYPE[cfg.strategy],
        "machine_rank": topo.machine_rank,
        "main_training_function": "main",
        "num_machines": topo.num_machines,
        "num_processes": cfg.world_size,
        "rdzv_backend": topo.rdzv_backend,
        "same_network": topo.same_network,
        # Never true: with use_cpu accelerate's simple launcher starts ONE process, whatever
        # num_processes says.
        "use_cpu": False,
    }
    if cfg.strategy != "deepspeed":
        config["mixed_precision"] = cfg.precision
        if cfg.precision == FP8:
            config["fp8_config"] = fp8_accelerate_section(cfg)
    if cfg.strategy != "single":
        config["main_process_port"] = topo.main_process_port
    if topo.num_machines > 1:
        config["main_process_ip"] = topo.main_process_ip
    if cfg.strategy == "deepspeed":
        config["deepspeed_config"] = _deepspeed_section(cfg, deepspeed_config_file)
    if cfg.strategy == "fsdp":
        config["fsdp_config"] = _fsdp_section(cfg)
    if cfg.layout.active:
        config["parallelism_config"] = yaml_block(cfg.layout, cp_comm_strategy=cfg.parallelism.cp_comm_strategy)
    return config


def accelerate_yaml(cfg: DistributedConfig, *, deepspeed_config_file: str | None, header: str) -> str:
    """The YAML text: ``header`` as ``#`` comment lines, then the config with sorted keys."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    body = yaml.safe_dump(
        accelerate_config(cfg, deepspeed_config_file=deepspeed_config_file),
        sort_keys=True,
        default_flow_style=False,
    )
    return comment + body


def _deepspeed_section(cfg: DistributedConfig, deepspeed_config_file: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {
        "deepspeed_config_file": deepspeed_config_file,
        # accelerate warns and resets the flag below stage 3; write what will actually happen.
        "zero3_init_flag": cfg.deepspeed.zero3_init and cfg.deepspeed.zero_stage == 3,
    }
    if cfg.topology.num_machines > 1:
        # "standard": one `accelerate launch` per machine with a torchrun rendezvous (what SLURM's srun
        # or a manual start per node does); pdsh needs passwordless ssh and is what
        # launch/NAME.deepspeed.sh is for.
        section["deepspeed_multinode_launcher"] = "standard"
    return section


def _fsdp_section(cfg: DistributedConfig) -> dict[str, Any]:
    return fsdp_yaml_section(cfg.fsdp)
