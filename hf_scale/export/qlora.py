"""`hf-scale export --lora merged` (`--merge`) of a QLoRA checkpoint (`train.py --load_in_4bit`): the adapter merged
into the base as the run trained it, written as a plain 16-bit model.

The model that trained is the 4-bit base plus the adapter, so the merge starts from that base: loaded again with
the checkpoint's own quantization config (bitsandbytes' NF4 quantization is deterministic, so these are the
weights the run saw), dequantized (transformers' `dequantize`), then the adapter is merged in fp32 and the result
cast to the output dtype. Merging into the original full-precision weights instead would change every base weight
by its quantization error.

The adapter is peft's adapter file where the checkpoint has a sound one (the Trainer's), else it is read from
wherever the checkpoint keeps its weights (`hf_scale.export.checkpoint_readers`, like any export): the manual loop's
`model.safetensors`, DeepSpeed's ZeRO partitions, FSDP2's DCP shards (:func:`adapter_source`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hf_scale.errors import UserError
from hf_scale.export.checkpoint_readers import Source, find_source, safetensors_source

if TYPE_CHECKING:
    from hf_scale.contract.checkpoint_layout import Layout

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def merge_dtype():
    """The dtype the base is dequantized to and the adapter merged in: fp32, so the merge adds no rounding."""
    import torch

    return torch.float32


def quantization_of(checkpoint_dir: Path) -> dict | None:
    """The checkpoint's bitsandbytes quantization config (from its config.json), None for an unquantized run.
    Refused in one line when hf_scale_state.json records another base than config.json (which one the adapter
    trained on is then unknown); a state written before it recorded the quantization leaves config.json to say
    (transformers' own record of a quantized model, as for resume: reshard.saved_quantization)."""
    from hf_scale.contract.checkpoint_layout import MODEL_CONFIG, STATE

    config = checkpoint_dir / MODEL_CONFIG
    found = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    found = found if isinstance(found, dict) and found.get("quant_method") == "bitsandbytes" else None
    try:
        state = json.loads((checkpoint_dir / STATE).read_text())
    except (OSError, ValueError):
        state = {}
    if isinstance(state, dict) and "quantization" in state and (state["quantization"] == "4bit") != bool(found):
        raise UserError(f"{checkpoint_dir}: {STATE} records quantization={state['quantization']}, but its "
                        f"{MODEL_CONFIG} {'has a' if found else 'has no'} 4-bit quantization_config: which base its "
                        "adapter was trained on is unknown; export it without --lora merged (the adapter alone)")
    return found


def adapter_problem(directory: Path) -> str | None:
    """What is wrong with `directory`'s adapter file (None when it holds tensors, none empty): the classic ZeRO-3
    failure is an adapter file without tensors."""
    from safetensors import safe_open

    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        return f"{directory}: no {ADAPTER_WEIGHTS}"
    with safe_open(str(file), framework="pt") as handle:
        keys = list(handle.keys())
        empty = [k for k in keys if 0 in handle.get_slice(k).get_shape()]
    if not keys or empty:
        return f"the adapter {file} has {len(keys)} tensors, {len(empty)} of them empty"
    return None


def check_adapter(out: Path) -> None:
    """Never write (or merge) an adapter file without tensors."""
    problem = adapter_problem(out)
    if problem:
        raise UserError(problem)


def adapter_source(found: Layout) -> Source:
    """Where the adapter of QLoRA checkpoint `found` is read: peft's adapter file when the checkpoint has a sound one
    (the Trainer's: a few MB, where DeepSpeed's reader would first concatenate the whole frozen 4-bit base of a ZeRO-3
    checkpoint), else the checkpoint's own weights (every format export reads: the manual loop's, ZeRO partitions,
    FSDP2 shards; also what rescues an empty ZeRO-3 adapter file)."""
    from hf_scale.contract import checkpoint_layout

    problem = adapter_problem(found.path)
    if problem is None:
        return safetensors_source(found.path / ADAPTER_WEIGHTS)
    if found.weights == checkpoint_layout.ADAPTER_ONLY:
        raise UserError(problem)  # nothing else to read it from: the one-line refusal
    return find_source(found)


def dequantized_with_adapter(checkpoint_dir: Path, quantization: dict):
    """The 4-bit base as the run trained it, dequantized to fp32, with the checkpoint's LoRA adapter attached and its
    weights left on the meta device: the caller puts the saved ones in place (a missing one stays meta, and is
    named)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    lora_config = LoraConfig.from_pretrained(str(checkpoint_dir))
    base_path = lora_config.base_model_name_or_path
    try:
        base = AutoModelForCausalLM.from_pretrained(
            base_path, quantization_config=BitsAndBytesConfig.from_dict(quantization), dtype=merge_dtype())
    except OSError as error:
        raise UserError(f"the QLoRA base {base_path} (adapter_config.json base_model_name_or_path) cannot be "
                        f"loaded: {str(error).splitlines()[0][:200]}") from None
    base = base.dequantize(dtype=merge_dtype())  # the weights the run trained against, in full precision
    return get_peft_model(base, lora_config, low_cpu_mem_usage=True)


def merged(model, quantization: dict, torch_dtype):
    """The adapter merged into the dequantized base in fp32, then cast to ``torch_dtype`` (None: the 4-bit compute
    dtype, bf16 for train.py's runs)."""
    from transformers import BitsAndBytesConfig

    model = model.merge_and_unload()
    out_dtype = torch_dtype or BitsAndBytesConfig.from_dict(quantization).bnb_4bit_compute_dtype
    model = model.to(out_dtype)
    model.config.dtype = out_dtype
    model.config.use_cache = True  # train.py turns the KV cache off for training; the export is for inference
    return model
