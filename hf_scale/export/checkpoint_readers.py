"""Where a checkpoint's weights are, one reader per format `hf-scale export` reads (DeepSpeed ZeRO partitions,
FSDP2 and accelerate-FSDP shards through torch.distributed.checkpoint, a torch.save'd full state dict, a
safetensors file): the tensors' names, and a reader of a few of them at a time, so that one full copy of the
weights is ever held."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hf_scale.errors import UserError

if TYPE_CHECKING:
    from hf_scale.contract.checkpoint_layout import Layout


@dataclass
class Source:
    """Where a checkpoint's weights are, read lazily: names and a reader for a few of them at a time."""

    description: str
    names: list[str]
    read: Callable[[list[str]], dict]
    """names -> {name: tensor} (fp32 or the saved dtype), reading only those."""


def find_source(found: Layout) -> Source:
    """The reader of the weights of the complete checkpoint `found`."""
    from hf_scale.contract import checkpoint_layout

    path = found.path
    if found.weights == checkpoint_layout.FSDP_DCP:
        return _dcp_source(path / checkpoint_layout.DCP_DIR, "FSDP2 shards")
    if found.weights == checkpoint_layout.ACCELERATE_FSDP and (source := _accelerate_fsdp_source(path)):
        return source
    if found.weights == checkpoint_layout.DEEPSPEED:
        return _deepspeed_source(path, found.deepspeed_tag)
    if found.weights == checkpoint_layout.FULL:
        return safetensors_source(path / checkpoint_layout.MODEL_WEIGHTS)
    if found.weights == checkpoint_layout.ADAPTER_ONLY:
        raise UserError(
            f"CHECKPOINT_DIR {path}: holds only a LoRA adapter (the Trainer's save without DeepSpeed); it already "
            "is a PEFT adapter directory: load it with peft's AutoPeftModelForCausalLM"
        )
    raise UserError(
        f"CHECKPOINT_DIR {path}: no model weights found (expected a DeepSpeed tag named in "
        f"'{checkpoint_layout.DEEPSPEED_LATEST}', {checkpoint_layout.DCP_DIR}/ or {checkpoint_layout.MODEL_WEIGHTS})"
    )


def _deepspeed_source(path: Path, tag: str | None) -> Source:
    """DeepSpeed's own consolidation, lazily: ZeRO-3 tensors are gathered from the partitions one at a time."""
    import torch

    from hf_scale.contract import checkpoint_layout

    if not tag or not (path / tag).is_dir():
        raise UserError(f"CHECKPOINT_DIR {path}: '{checkpoint_layout.DEEPSPEED_LATEST}' names {tag or 'nothing'}, "
                        "which is not a directory in it")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints progress; stdout stays clean
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag, lazy_mode=True)

    def read(names):
        return {n: lazy[n] if isinstance(lazy[n], torch.Tensor) else lazy[n].contiguous() for n in names}

    stage = json.loads((path / checkpoint_layout.STATE).read_text()).get("zero_stage")
    return Source(f"DeepSpeed ZeRO-{stage} partitions in {tag}/", list(lazy), read)


def _dcp_source(path: Path, what: str) -> Source:
    """FSDP shards saved as {"model": state_dict} (hf_scale's `fsdp.save_sharded`, accelerate's
    `save_fsdp_model`): torch.distributed.checkpoint reads the requested tensors (any world size) without
    a process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "model."  # DCP flattens the nested {"model": {name: tensor}} to "model.NAME"
    saved = {_module_name(k.removeprefix(prefix)): k for k, v in metadata.items()
             if k.startswith(prefix) and hasattr(v, "size")}

    def read(wanted):
        state = {saved[n]: torch.empty(tuple(metadata[saved[n]].size), dtype=metadata[saved[n]].properties.dtype)
                 for n in wanted}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return {n: state[saved[n]] for n in wanted}

    return Source(f"{what} in {path.name}/", list(saved), read)


def _accelerate_fsdp_source(path: Path) -> Source | None:
    """The model files accelerate's FSDP plugin writes (`accelerate.utils.fsdp_utils.save_fsdp_model`, FSDP1
    and FSDP2, the manual loop's `save_state` and the Trainer's checkpoints): SHARDED_STATE_DICT is a DCP
    folder, FULL_STATE_DICT one state dict torch.save'd by rank 0. Only the first model (index 0) is read;
None when neither is there."""
    from hf_scale.contract import checkpoint_layout

    if (path / checkpoint_layout.ACCELERATE_FSDP_SHARDED / ".metadata").is_file():
        return _dcp_source(path / checkpoint_layout.ACCELERATE_FSDP_SHARDED, "FSDP shards of accelerate's plugin")
    if (path / checkpoint_layout.ACCELERATE_FSDP_FULL).is_file():
        return _torch_file_source(path / checkpoint_layout.ACCELERATE_FSDP_FULL)
    per_rank = sorted(p.name for p in path.glob(f"{checkpoint_layout.ACCELERATE_FSDP_PREFIX}*_rank*.bin"))
    if per_rank:
        # LOCAL_STATE_DICT (FSDP1's flat parameters) or SHARDED_STATE_DICT saved without DCP: each rank's
        # slices, which only the same FSDP wrapping on the same world size reads back.
        raise UserError(
            f"CHECKPOINT_DIR {path}: holds accelerate's per-rank FSDP files ({per_rank[0]}, {len(per_rank)} in "
            f"all), which only the same FSDP setup reads back; export needs "
            f"{checkpoint_layout.ACCELERATE_FSDP_SHARDED}/ (fsdp state_dict_type sharded, saved with DCP) or "
            f"{checkpoint_layout.ACCELERATE_FSDP_FULL} (state_dict_type full)"
        )
    return None


def _torch_file_source(file: Path) -> Source:
    """A torch.save'd state dict, memory-mapped (tensors are read from disk when used), never unpickling code."""
    import torch

    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"CHECKPOINT_DIR {file.parent}: {file.name} is not a state dict (name -> tensor)")
    saved = {_module_name(name): name for name in state}
    return Source(f"full FSDP state dict in {file.name}", list(saved), lambda ns: {n: state[saved[n]] for n in ns})


def safetensors_source(file: Path) -> Source:
    from safetensors import safe_open

    handle = safe_open(str(file), framework="pt")
    saved = {_module_name(name): name for name in handle.keys()}  # noqa: SIM118 (not a dict)
    return Source(f"full weights in {file.name}", list(saved), lambda ns: {n: handle.get_tensor(saved[n]) for n in ns})


# Module names wrappers insert into saved tensor names: torch.compile's (a --torch_compile run saves
# `_orig_mod.model...`), FSDP1's and activation checkpointing's (the ones torch's own
# torch.distributed.fsdp._common_utils.clean_tensor_name removes; FSDP state dicts normally have them removed).
_WRAPPER_MODULES = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _module_name(saved: str) -> str:
    """The model's own name of a saved tensor: without the wrappers' parts."""
    return ".".join(part for part in saved.split(".") if part not in _WRAPPER_MODULES)


def with_adapter_names(source: Source, model) -> Source:
    """`source` with peft's adapter name put back into the adapter's tensor names the model does not know.

    peft's adapter-only state dict (`get_peft_model_state_dict`: the Trainer's FSDP checkpoints, whose
    `save_fsdp_model(adapter_only=True)` uses it with a sharded state dict) drops the adapter name
    (`lora_A.weight` for the model's `lora_A.default.weight`); peft's own loader puts it back with this helper.
    """
    from peft.utils.save_and_load import _insert_adapter_name_into_state_dict

    known = dict(model.named_parameters(remove_duplicate=False))
    unknown = {n: n for n in source.names if n not in known}
    if not unknown:
        return source
    renamed = _insert_adapter_name_into_state_dict(unknown, model.active_adapter, model.base_model.prefix)
    saved = {n: n for n in source.names if n in known} | renamed  # the model's name -> the saved one

    def read(names):
        found = source.read([saved[n] for n in names])
        return {n: found[saved[n]] for n in names}

    return Source(source.description, list(saved), read)


def with_model_names(source: Source, model) -> Source:
    """`source` read under the model's own tensor names where it holds them in transformers' saved form.

    A Trainer checkpoint's model.safetensors is written by `save_pretrained`, which writes a tensor transformers
    keeps in another form at run time as it is on disk: a mixture-of-experts model's fused experts
    (`mlp.experts.gate_up_proj`) as one tensor per expert (`mlp.experts.0.gate_proj.weight`, ...). Each such model
    tensor is read from the pieces transformers names for it and put together by transformers' load conversion
    (hf_scale.knowledge.weight_conversion), one model tensor at a time.
    """
    from hf_scale.knowledge import weight_conversion

    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    if all(name in targets for name in source.names):
        return source
    available = set(source.names)
    pieces: dict[str, list[str]] = {}  # model name -> the saved names it is put together from
    for name, tensor in targets.items():
        if name not in available and tensor.is_floating_point():
            saved = list(weight_conversion.saved_form(model, name, tensor.to("meta")))
            if saved != [name] and all(piece in available for piece in saved):
                pieces[name] = saved
    if not pieces:
        return source
    loader = weight_conversion.Loader(model)
    claimed = {piece for saved in pieces.values() for piece in saved}

    def read(names):
        direct = [n for n in names if n not in pieces]
        found = source.read(direct) if direct else {}
        for name in names:
            if name in pieces:
                found[name] = loader.runtime_tensor(name, source.read(pieces[name]))
        return found

    return Source(source.description, [n for n in source.names if n not in claimed] + list(pieces), read)
