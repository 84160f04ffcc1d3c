"""What train.py refuses of --load_in_4bit (QLoRA) before anything is loaded, in its own words: what may be combined
with a 4-bit base (:func:`refusal`) and which FSDP can shard one (:func:`sharding_refusal`). train.py's start
(hf_scale.train.prepare) and `hf-scale check` (hf_scale.check.qlora) ask the same functions."""

from __future__ import annotations

from hf_scale.knowledge.installed import version_of


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
