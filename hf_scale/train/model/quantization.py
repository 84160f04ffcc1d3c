"""QLoRA: the base model loaded in 4-bit NF4 by bitsandbytes (through transformers' BitsAndBytesConfig), trained
through a LoRA adapter (peft). What may be combined with it is decided here (:func:`refusal`), before anything is
loaded, and which FSDP can shard it (:func:`sharding_refusal`); the quantization config the model is loaded with is
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
from hf_scale.knowledge.installed import version_of

QUANT_TYPE = "nf4"
"""NormalFloat4: the quantiles of a normal distribution, what pretrained weights roughly follow."""
DOUBLE_QUANT = True
"""Quantize the per-block scales too (about 0.37 bits per weight saved, QLoRA section 3)."""
COMPUTE_DTYPE = "bfloat16"
"""The dtype the dequantized weights multiply in: bf16's range, as QLoRA trains."""
STORAGE_OF_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}
"""The run's precision -> the dtype ZeRO-3 holds its parameters in (FSDP2 with fp32 shards: precision no)."""


def refusal(*, load_in_4bit: bool, lora_r: int, fp8_backend: str | None) -> str | None:
    """Why --load_in_4bit cannot run with the rest of the run (None when it can, or without 4-bit)."""
    if not load_in_4bit:
        return None
    if lora_r <= 0:
        return (f"--load_in_4bit with --lora_r={lora_r}: a 4-bit base cannot be fully fine-tuned (its weights are "
                "frozen integers); add --lora_r (e.g. 16) to train a LoRA adapter on it (QLoRA)")
    if fp8_backend is not None:
        return (f"--load_in_4bit with fp8 ({fp8_backend}): the 4-bit base already fixes the matmul precision "
                "(bf16 compute); use precision=bf16 for QLoRA")
    return None


FSDP2_NEEDS = {"accelerate": "1.14", "peft": "0.19"}
"""The first releases whose FSDP2 path takes a bitsandbytes 4-bit base: accelerate 1.14 stops loading a full state
dict into a 4-bit model under cpu_ram_efficient_loading (huggingface/accelerate#3981, with #3985 and #3987 on
Params4bit), peft 0.19 is the first tested with FSDP2 and 4-bit (huggingface/peft#3092)."""


def sharding_refusal(fsdp_version: int | None, installed: dict[str, str], *,
                     from_hf_scale_config: bool = False) -> str | None:
    """Why a 4-bit base cannot be sharded by the run's FSDP (None when it can, or without FSDP). ``installed``: the
    package versions here (data, so that the rule is tested with any); ``from_hf_scale_config``: the version is the
    --hf_scale_config's fsdp.version (else the accelerate config's)."""
    if fsdp_version == 1 and from_hf_scale_config:
        return ("--load_in_4bit with FSDP version 1 (the --hf_scale_config's fsdp.version): hf_scale shards a 4-bit "
                "base with FSDP2 or DeepSpeed ZeRO-3 only; set fsdp.version: 2, or use strategy deepspeed with ZeRO-3")
    if fsdp_version == 1:
        # FSDP1 flattens every parameter of a wrapped unit into one flat tensor; a 4-bit base then needs peft's wrap
        # policy and a quant-storage mixed-precision override that only transformers' Trainer applies, and no CPU
        # test can run it. FSDP2 shards the packed weights as they are (tests/train/model/test_quantization.py).
        return ("--load_in_4bit with FSDP version 1 (the accelerate config's fsdp_version, accelerate's default 1): "
                "hf_scale shards a 4-bit base with FSDP2 or DeepSpeed ZeRO-3 only; set fsdp_version: 2 in the "
                "accelerate config (hf-scale generate writes it), or use strategy deepspeed with ZeRO-3")
    if fsdp_version == 2:
        from packaging.version import Version

        old = [f"{name} >= {need} (installed: {installed.get(name) or 'none'})" for name, need in FSDP2_NEEDS.items()
               if Version(installed.get(name) or "0") < Version(need)]
        if old:
            return (f"--load_in_4bit with FSDP2 needs {' and '.join(old)}: the first releases whose FSDP2 path takes "
                    f"a 4-bit base; pip install -U {' '.join(repr(f'{n}>={v}') for n, v in FSDP2_NEEDS.items())}, or "
                    "use DeepSpeed ZeRO-3")
    return None


def installed_versions() -> dict[str, str]:
    """The versions of FSDP2_NEEDS's packages installed here (a missing one is left out)."""
    return {name: written for name in FSDP2_NEEDS if (written := version_of(name))}


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
