"""`hf-scale export --lora merged` of a QLoRA checkpoint (`train.py --load_in_4bit`): the adapter merged into the
base as the run trained it, written as a plain 16-bit model.

The model that trained is the 4-bit base plus the adapter, so the merge starts from that base: loaded again with
the checkpoint's own quantization config (bitsandbytes' NF4 quantization is deterministic, so these are the
weights the run saw), dequantized (transformers' `dequantize`), then the adapter is merged in fp32 and the result
cast to the output dtype. Merging into the original full-precision weights instead would change every base weight
by its quantization error. The adapter is the checkpoint's adapter file (peft's own save, checked non-empty).
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_scale.errors import UserError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def quantization_of(checkpoint_dir: Path) -> dict | None:
    """The checkpoint's bitsandbytes quantization config (from its config.json), None for an unquantized run."""
    config = checkpoint_dir / "config.json"
    if not config.is_file():
        return None
    found = json.loads(config.read_text()).get("quantization_config")
    return found if isinstance(found, dict) and found.get("quant_method") == "bitsandbytes" else None


def check_adapter(out: Path) -> None:
    """The classic ZeRO-3 failure is an adapter file without tensors; never write (or merge) one."""
    from safetensors import safe_open

    file = out / ADAPTER_WEIGHTS
    if not file.is_file():
        raise UserError(f"{out}: no {ADAPTER_WEIGHTS}")
    with safe_open(str(file), framework="pt") as handle:
        keys = list(handle.keys())
        empty = [k for k in keys if 0 in handle.get_slice(k).get_shape()]
    if not keys or empty:
        raise UserError(f"the adapter {file} has {len(keys)} tensors, {len(empty)} of them empty")


def merged_model(checkpoint_dir: Path, quantization: dict, torch_dtype):
    """The dequantized 4-bit base with the checkpoint's adapter merged in, in ``torch_dtype`` (None: the 4-bit
    compute dtype)."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    check_adapter(checkpoint_dir)
    base_path = PeftConfig.from_pretrained(str(checkpoint_dir)).base_model_name_or_path
    bnb = BitsAndBytesConfig.from_dict(quantization)
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, quantization_config=bnb, dtype=torch.float32)
    except OSError as error:
        raise UserError(f"the QLoRA base {base_path} (adapter_config.json base_model_name_or_path) cannot be "
                        f"loaded: {str(error).splitlines()[0][:200]}") from None
    base = base.dequantize(dtype=torch.float32)  # the weights the run trained against, in full precision
    model = PeftModel.from_pretrained(base, str(checkpoint_dir)).merge_and_unload()
    out_dtype = torch_dtype or bnb.bnb_4bit_compute_dtype
    model = model.to(out_dtype)
    model.config.dtype = out_dtype
    model.config.use_cache = True  # train.py turns the KV cache off for training; the export is for inference
    return model
