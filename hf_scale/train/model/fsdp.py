"""FSDP for the manual loop when the strategy comes from `--hf_scale_config` (not accelerate's YAML).

With GPUs, accelerate does the sharding: :func:`accelerate_plugin` turns the config's `fsdp` section into
accelerate's `FullyShardedDataParallelPlugin` with the fields the generated accelerate YAML gives `accelerate
launch` (hf_scale.contract.accelerate_fsdp.fsdp_plugin_fields), so fsdp.version 1 runs FSDP1 as it does there.
Without GPUs accelerate cannot run FSDP at all (it ignores the plugin and trains unsharded), while torch's own
`fully_shard` runs over gloo; so on CPU :func:`shard_on_cpu` applies FSDP2 directly with the same choices (each
decoder layer, then the root). That keeps FSDP2 testable on CPU-only machines and CI; FSDP1 has no such path,
and fsdp.version 1 is refused on CPU before anything loads (hf_scale.train.setup.reconcile).
"""

from __future__ import annotations

import torch

from hf_scale.train.model.load import decoder_layer_classes


def layer_classes(model, settings: dict) -> list[str]:
    """The config's `transformer_layer_cls_to_wrap`, else the model's own `_no_split_modules`."""
    return list(settings.get("transformer_layer_cls_to_wrap") or []) or decoder_layer_classes(model)


def plugin_fields(model, settings: dict) -> dict:
    """accelerate's FSDP plugin fields for the config's `fsdp` section: the ones the generated accelerate YAML gives
    `accelerate launch` (fsdp_version 1 or 2 with its sharding), with the layer classes resolved for `model`."""
    from hf_scale.config.distributed_config import FSDPSettings
    from hf_scale.contract.accelerate_fsdp import fsdp_plugin_fields

    fields = fsdp_plugin_fields(FSDPSettings(**settings))
    return {**fields, "transformer_cls_names_to_wrap": layer_classes(model, settings)}


def accelerate_plugin(model, settings: dict):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**plugin_fields(model, settings))


def shard_on_cpu(model, settings: dict):
    """`fully_shard` every decoder layer, then the root (FSDP2's documented recipe)."""
    from torch.distributed.fsdp import fully_shard

    if settings.get("version", 2) != 2:  # refused before (hf_scale.train.setup.reconcile): FSDP1 needs GPUs
        raise ValueError(f"fully_shard is FSDP2; fsdp.version={settings.get('version')}")
    fields = plugin_fields(model, settings)  # the plugin's choices, applied here by hand
    names, reshard = set(fields["transformer_cls_names_to_wrap"]), fields["reshard_after_forward"]
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        from hf_scale.errors import UserError

        raise UserError(f"fsdp.transformer_layer_cls_to_wrap={sorted(names)}: no such module in {type(model).__name__}")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Gather the sharded parameters into one full CPU state dict (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def set_gradient_sync(model, enabled: bool) -> None:
    """FSDP2's no_sync: skip the reduce-scatter on all but the last micro-batch of a window."""
    model.set_requires_gradient_sync(enabled)


def as_local_float(norm) -> float:
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def save_sharded(model, optimizer, path) -> None:
    """To `path` (a checkpoint's `checkpoint_layout.DCP_DIR`). Every rank writes its own shards (collective);
    DCP reshards on load, also at another world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_sharded(model, optimizer, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_sharded_model(model, path) -> None:
    """The model's part of `save_sharded`'s shards only (DCP reads just the keys asked for)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
