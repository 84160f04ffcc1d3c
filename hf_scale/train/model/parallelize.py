"""Tensor parallelism in the manual loop: the model built on the mesh by transformers, the data split by
data-parallel rank.

transformers (>= 5) builds the model on the device mesh itself: ``from_pretrained(...,
distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size))`` applies the model's own TP plan
(``tp_plan="auto"``) and, when the data-parallel size is above 1, FSDP2 over the same mesh (pp, dp_replicate,
fsdp, tp: TP ranks neighbours, as in accelerate's mesh). So the parameters are DTensors when the loop gets them.

accelerate is not handed that model: accelerate 1.15 refuses a ``ParallelismConfig`` on a machine without GPUs
("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device}...,
but got DistributedType.MULTI_CPU") and, without one, would wrap the DTensor model in DDP. As for FSDP2 on CPU
(fsdp.py), hf_scale keeps the model and accelerate prepares the data loader and scheduler; the loader is split by
data-parallel rank with accelerate's own ``prepare_data_loader``, given the sizes accelerate derives from its mesh
(data_loader.py: ``process_index // (tp * cp)``, ``num_processes = dp_replicate * dp_shard``).
"""

from __future__ import annotations

import torch

from hf_scale.config.parallelism import Layout


def accelerate_parallelism_config(layout: Layout, cp_comm_strategy: str = "allgather"):
    """The Accelerator's ``parallelism_config`` of both loops: sp > 1, DeepSpeed Ulysses (accelerate wires the
    attention and the data adapter: sequence_parallel.py); cp > 1, FSDP2 over dp_shard x cp and the ring attention's
    hooks (context_parallel.py); else None (TP's mesh is transformers', built at load). The config never has both."""
    from hf_scale.train.model import context_parallel, sequence_parallel

    return (sequence_parallel.accelerate_config(layout)
            or context_parallel.accelerate_config(layout, cp_comm_strategy))


def sharded_at_load(layout: Layout) -> bool:
    """transformers builds this layout's model already sharded (TP and/or EP, and FSDP2 over the data-parallel
    ranks)."""
    return layout.tp > 1 or layout.ep > 1


def load_kwargs(layout: Layout, fsdp_settings: dict | None) -> dict:
    """The `from_pretrained` arguments that build the model on the layout's mesh (none without TP or EP): the
    model's own TP plan under tp > 1, its expert-parallel plan (``base_model_ep_plan``: experts split over ep, tokens
    dispatched by all-to-all) under ep > 1, FSDP2 over dp_shard (and the experts over dp_shard x tp / ep)."""
    if not sharded_at_load(layout):
        return {}
    from transformers.distributed.configuration_utils import DistributedConfig

    return {"distributed_config": DistributedConfig(
        tp_size=layout.tp, tp_plan="auto" if layout.tp > 1 else None, fsdp_size=layout.dp_shard,
        dp_replicate_size=layout.dp_replicate, ep_size=layout.ep,
        fsdp_cpu_offload=bool((fsdp_settings or {}).get("offload_params", False)),
    )}


def accelerate_mesh(layout: Layout, device: torch.device):
    """accelerate's device mesh for the layout (the dimension names its data loader reads), built without an
    Accelerator holding a ParallelismConfig (which accelerate 1.15 refuses on CPU)."""
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=layout.dp_replicate, dp_shard_size=layout.dp_shard, tp_size=layout.tp,
                             cp_size=layout.cp).get_device_mesh(device.type)


def data_rank(layout: Layout, rank: int) -> int:
    """The data-parallel rank of global rank `rank`: the ranks of one TP/CP/SP group (neighbours in the mesh)
    share it, hence the same batches."""
    return rank // layout.model_parallel_size


def prepare_data(accelerator, dataloader, layout: Layout):
    """The loader prepared by accelerate, split over the data-parallel ranks only."""
    if layout.model_parallel_size == 1:
        return accelerator.prepare(dataloader)
    from accelerate.data_loader import prepare_data_loader

    prepared = prepare_data_loader(
        dataloader, accelerator.device,
        num_processes=layout.data_parallel_size,
        process_index=data_rank(layout, accelerator.process_index),
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
    )
    accelerator._dataloaders.append(prepared)  # what prepare() does: save_state/load_state include its sampler
    return prepared


def has_dtensors(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """The gradient norm over every rank's shards (clipped to `max_norm`). torch's clip_grad_norm_ refuses a mix
    of DTensors and the plain tensors a TP plan leaves whole; the Trainer's own per-mesh norm handles it (its
    method uses no Trainer state, so it is called unbound, as manual.py does with get_decay_parameter_names)."""
    from transformers import Trainer

    return Trainer._mixed_mesh_grad_norm(None, model, max_norm)
