"""accelerate's FSDP plugin fields for a config's fsdp section, in one table read both ways: written into the
accelerate YAML's fsdp_config by `hf-scale generate` (hf_scale.generators.accelerate_yaml), handed to the plugin by
train.py under --hf_scale_config (hf_scale.train.model.fsdp), and read back from the FSDP_* variables `accelerate
launch` exports for a YAML train.py runs without one (train.py's reconcile, `hf-scale check`). One choice, every path
(accelerate's own utils/dataclasses keeps its YAML <-> plugin mapping the same way).
"""

from __future__ import annotations

from typing import Any

from hf_scale.config.distributed_config import FSDPSettings

_FSDP1_SHARDING = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid_shard": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}
_STATE_DICT_TYPE = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}


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


def fsdp_yaml_section(fsdp: FSDPSettings) -> dict[str, Any]:
    """The accelerate YAML's fsdp_config: :func:`fsdp_plugin_fields` under the keys ``accelerate launch`` reads."""
    section: dict[str, Any] = {}
    for field, value in fsdp_plugin_fields(fsdp).items():
        key = _YAML_KEY.get(field, field if field.startswith("fsdp_") else f"fsdp_{field}")
        section[key] = ",".join(value) if isinstance(value, list) else value  # accelerate splits it at commas
    if fsdp.version == 1:
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
