"""QLoRA: the base model loaded in 4-bit NF4 by bitsandbytes (through transformers' BitsAndBytesConfig), trained
through a LoRA adapter (peft). What may be combined with it is decided here (:func:`refusal`), before anything is
loaded; the quantization config the model is loaded with is built here (:func:`bnb_config`).

The choices are QLoRA's (Dettmers et al. 2023) and the ones peft's and accelerate's QLoRA guides use: NF4 weights,
double quantization of the scaling constants, bf16 compute. The packed 4-bit weights are stored in a tensor of the
same dtype as the model's other weights (`bnb_4bit_quant_storage`): ZeRO-3 and FSDP flatten and shard all
parameters of a module together and need one dtype; with it, a 4-bit base shards like any other model.
"""

from __future__ import annotations

from hf_scale import rules
from hf_scale.errors import UserError

QUANT_TYPE = "nf4"
"""NormalFloat4: the quantiles of a normal distribution, what pretrained weights roughly follow."""
DOUBLE_QUANT = True
"""Quantize the per-block scales too (about 0.37 bits per weight saved, QLoRA section 3)."""
COMPUTE_DTYPE = "bfloat16"
"""The dtype the dequantized weights multiply in: bf16's range, as QLoRA trains."""
QUANT_STORAGE_FOR_SHARDING = "bfloat16"
"""What the packed weights are stored in under ZeRO-3/FSDP when the model loads in fp32 (the default): a 16-bit
container keeps the flat buffers half the size of an fp32 one, and DeepSpeed/FSDP cast the other weights to it."""


def refusal(*, load_in_4bit: bool, lora_r: int, strategy: str, fp8_backend: str | None) -> str | None:
    """Why --load_in_4bit cannot run with the rest of the run (None when it can, or without 4-bit)."""
    if not load_in_4bit:
        return None
    if lora_r <= 0:
        return (f"--load_in_4bit with --lora_r={lora_r}: a 4-bit base cannot be fully fine-tuned (its weights are "
                "frozen integers); add --lora_r (e.g. 16) to train a LoRA adapter on it (QLoRA)")
    if fp8_backend is not None:
        return (f"--load_in_4bit with fp8 ({fp8_backend}): the 4-bit base already fixes the matmul precision "
                "(bf16 compute); use precision=bf16 for QLoRA")
    if strategy == "fsdp":
        return fsdp_refusal()
    return None


def fsdp_refusal() -> str:
    """accelerate 1.15 prepares FSDP2 by `fully_shard`ing modules whose parameters include bitsandbytes'
    Params4bit, which FSDP2's DTensor sharding does not carry (the quant_state is lost); accelerate documents
    QLoRA only for FSDP1 on GPUs, and FSDP through accelerate needs a GPU here."""
    return ("--load_in_4bit with strategy fsdp: the installed accelerate/peft do not shard bitsandbytes' 4-bit "
            "weights under FSDP2 (DTensor loses their quant_state); use strategy deepspeed (ZeRO-3) or ddp")


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("--load_in_4bit needs bitsandbytes, which is not installed: pip install 'hf-scale[qlora]'")


def storage_dtype(torch_dtype: str, *, sharded: bool) -> str:
    """The dtype the packed 4-bit weights are stored in: under ZeRO-3/FSDP (``sharded``) the one the other weights
    shard in (the --torch_dtype, 16-bit when that is fp32 or auto); else bitsandbytes' own uint8."""
    if not sharded:
        return "uint8"
    name = rules.torch_dtype_name(torch_dtype, "--torch_dtype")
    return name if name in ("bfloat16", "float16") else QUANT_STORAGE_FOR_SHARDING


def bnb_config(torch_dtype: str, *, sharded: bool):
    """transformers' BitsAndBytesConfig for the 4-bit base (``sharded``: ZeRO-3 or FSDP)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=DOUBLE_QUANT,
        bnb_4bit_compute_dtype=getattr(torch, COMPUTE_DTYPE),
        bnb_4bit_quant_storage=getattr(torch, storage_dtype(torch_dtype, sharded=sharded)),
    )


def describe(torch_dtype: str, *, sharded: bool) -> str:
    """The one line train.py logs."""
    return (f"QLoRA: base weights in 4-bit {QUANT_TYPE.upper()} (double quantization, {COMPUTE_DTYPE} compute, "
            f"stored as {storage_dtype(torch_dtype, sharded=sharded)}); only the LoRA adapter trains")
