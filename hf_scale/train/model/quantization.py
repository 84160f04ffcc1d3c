"""QLoRA: the base model loaded in 4-bit NF4 by bitsandbytes (through transformers' BitsAndBytesConfig), trained
through a LoRA adapter (peft). What may be combined with it, and which FSDP can shard it, is decided before anything is
loaded (hf_scale.contract.qlora_refusals); the quantization config the model is loaded with is
built here (:func:`bnb_config`).

The choices are QLoRA's (Dettmers et al. 2023) and the ones peft's and accelerate's QLoRA guides use: NF4 weights,
double quantization of the scaling constants, bf16 compute. Under ZeRO-3 and FSDP the packed 4-bit weights are
stored in a tensor of the dtype the engine holds the other parameters in (`bnb_4bit_quant_storage`): DeepSpeed
casts every parameter to its precision and partitions them flat, FSDP2 (accelerate 1.15, and hf_scale's own
fully_shard on CPU) shards only floating Params4bit; with a matching storage dtype a 4-bit base shards like any other
model (bitsandbytes dequantizes the gathered weight with the quant_state kept on its Linear4bit module). Elsewhere
bitsandbytes' uint8.
"""

from __future__ import annotations

from hf_scale.errors import UserError

QUANT_TYPE = "nf4"
"""NormalFloat4: the quantiles of a normal distribution, what pretrained weights roughly follow."""
DOUBLE_QUANT = True
"""Quantize the per-block scales too (about 0.37 bits per weight saved, QLoRA section 3)."""
COMPUTE_DTYPE = "bfloat16"
"""The dtype the dequantized weights multiply in: bf16's range, as QLoRA trains."""
STORAGE_OF_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}
"""The run's precision -> the dtype ZeRO-3 holds its parameters in (FSDP2 with fp32 shards: precision no)."""


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--load_in_4bit needs bitsandbytes, which is not installed: pip install 'hf-scale[qlora]'")


def storage_dtype(sharded_precision: str | None) -> str:
    """The dtype the packed 4-bit weights are stored in: under ZeRO-3/FSDP (``sharded_precision``: the run's
    precision there, None elsewhere) the one the engine holds parameters in; else bitsandbytes' own uint8."""
    return "uint8" if sharded_precision is None else STORAGE_OF_PRECISION[sharded_precision]


def bnb_config(sharded_precision: str | None = None):
    """transformers' BitsAndBytesConfig for the 4-bit base (``sharded_precision``: see :func:`storage_dtype`)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=DOUBLE_QUANT,
        bnb_4bit_compute_dtype=getattr(torch, COMPUTE_DTYPE),
        bnb_4bit_quant_storage=getattr(torch, storage_dtype(sharded_precision)),
    )


def describe(sharded_precision: str | None) -> str:
    """The one line train.py logs."""
    return (f"QLoRA: base weights in 4-bit {QUANT_TYPE.upper()} (double quantization, {COMPUTE_DTYPE} compute, "
            f"stored as {storage_dtype(sharded_precision)}); only the LoRA adapter trains")
