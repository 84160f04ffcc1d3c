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

from hf_scale.config.distributed_config import DistributedConfig, FSDPSettings
from hf_scale.config.parallelism import yaml_block
from hf_scale.knowledge.precision_rules import fp8_accelerate_section
from hf_scale.knowledge.rules import FP8

_DISTRIBUTED_TYPE = {"single": "NO", "ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}
_FSDP1_SHARDING = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid_shard": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}
_STATE_DICT_TYPE = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}


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


def fsdp_plugin_fields(fsdp: FSDPSettings) -> dict[str, Any]:
    """accelerate's ``FullyShardedDataParallelPlugin`` fields (its own names) for a config's fsdp section: what
    ``accelerate launch`` makes of the YAML's fsdp_config (written from these by :func:`_fsdp_section`) and what
    train.py hands the plugin itself under --hf_scale_config (hf_scale.train.model.fsdp): one choice, two paths.
    Without ``transformer_cls_names_to_wrap`` accelerate wraps the classes in the model's _no_split_modules."""
    fields: dict[str, Any] = {
        "fsdp_version": fsdp.version,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "state_dict_type": _STATE_DICT_TYPE[fsdp.state_dict_type],
        "cpu_ram_efficient_loading": fsdp.cpu_ram_efficient_loading,
        "cpu_offload": fsdp.offload_params,
        "activation_checkpointing": fsdp.activation_checkpointing,
    }
    if fsdp.transformer_layer_cls_to_wrap:
        fields["transformer_cls_names_to_wrap"] = list(fsdp.transformer_layer_cls_to_wrap)
    if fsdp.version == 2:
        # FSDP2 only knows "reshard after forward" (full_shard) or not (shard_grad_op); hybrid sharding is the
        # parallelism_config mesh, which reshards within the machine.
        fields["reshard_after_forward"] = fsdp.sharding != "shard_grad_op"
    else:
        # accelerate 1.x wraps an FSDP1 model with `sharding_strategy or reshard_after_forward`, and
        # `accelerate launch` exports FSDP_SHARDING_STRATEGY=FULL_SHARD unless the YAML names one: without it
        # shard_grad_op, hybrid_shard and no_shard would silently run FULL_SHARD.
        fields["sharding_strategy"] = _FSDP1_SHARDING[fsdp.sharding]
        fields["backward_prefetch"] = "BACKWARD_PRE"
        fields["forward_prefetch"] = False
        # use_orig_params keeps PEFT/LoRA and per-parameter optimizer groups working under FSDP1.
        fields["use_orig_params"] = True
        # Required by accelerate when cpu_ram_efficient_loading is on (rank 0 loads, the rest receive).
        fields["sync_module_states"] = True
    return fields


_YAML_KEY = {"cpu_offload": "fsdp_offload_params",
             "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap"}
"""The YAML keys (``accelerate launch``'s --fsdp_* arguments) whose names are not ``fsdp_`` + the plugin's field."""


def _fsdp_section(cfg: DistributedConfig) -> dict[str, Any]:
    section: dict[str, Any] = {}
    for field, value in fsdp_plugin_fields(cfg.fsdp).items():
        key = _YAML_KEY.get(field, field if field.startswith("fsdp_") else f"fsdp_{field}")
        section[key] = ",".join(value) if isinstance(value, list) else value  # accelerate splits it at commas
    if cfg.fsdp.version == 1:
        # The key `accelerate config` writes for FSDP1's strategy; accelerate reads fsdp_sharding_strategy first.
        section["fsdp_reshard_after_forward"] = section["fsdp_sharding_strategy"]
    return section


def fsdp_settings_from_launch(environ: dict[str, str]) -> FSDPSettings:
    """The fsdp section whose plugin fields (:func:`fsdp_plugin_fields`) `accelerate launch` exported from a YAML's
    fsdp_config as FSDP_* variables: the same tables read the other way, for a YAML train.py runs without
    --hf_scale_config (a peer project's parallelism config). accelerate's launcher defaults stand for what is unset."""

    def flag(name: str, default: bool) -> bool:
        return environ.get(f"FSDP_{name}", str(default)).strip().lower() == "true"

    version = 2 if environ.get("FSDP_VERSION", "1").strip() == "2" else 1
    if version == 2:
        sharding = "full_shard" if flag("RESHARD_AFTER_FORWARD", True) else "shard_grad_op"
    else:
        by_name = {name: sharding for sharding, name in _FSDP1_SHARDING.items()}
        sharding = by_name.get(environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"), "full_shard")
    by_type = {name: kind for kind, name in _STATE_DICT_TYPE.items()}
    return FSDPSettings(
        version=version,
        sharding=sharding,
        transformer_layer_cls_to_wrap=[c.strip() for c in environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",")
                                       if c.strip()],
        state_dict_type=by_type.get(environ.get("FSDP_STATE_DICT_TYPE", ""), "sharded" if version == 2 else "full"),
        cpu_ram_efficient_loading=flag("CPU_RAM_EFFICIENT_LOADING", True),
        offload_params=flag("OFFLOAD_PARAMS", False),
        activation_checkpointing=flag("ACTIVATION_CHECKPOINTING", False),
    )
