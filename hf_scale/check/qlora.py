"""Checks of a QLoRA run (`--load_in_4bit` in the training args): the combinations train.py refuses before the model
loads (hf_scale.train.model.quantization.refusal, whose words these are), said from the files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding
from hf_scale.check.fp8 import fp8_source
from hf_scale.check.inputs import CheckInputs


def _strategy(inp: CheckInputs) -> str | None:
    """fsdp or deepspeed when the accelerate YAML or the --hf_scale_config asks for it."""
    kind = str(inp.accelerate.get("distributed_type", "")).upper()
    if kind in ("FSDP", "DEEPSPEED"):
        return kind.lower()
    return inp.hf_scale_config.strategy if inp.hf_scale_config is not None else None


def check_qlora(inp: CheckInputs) -> Iterator[Finding]:
    """`qlora-no-lora`, `qlora-fp8`, `qlora-fsdp` (warning): --load_in_4bit without a LoRA rank (a 4-bit base cannot
    be fully fine-tuned), with fp8 (the 4-bit layers fix the compute dtype), or under FSDP (accelerate shards the 4-bit
    weights only when stored in a floating dtype, as train.py stores them; hf_scale proves it on GPUs only)."""
    training = inp.training or {}
    if not training.get("load_in_4bit"):
        return
    from hf_scale.train.model import quantization

    asked = {f"{TRAINING_ARGS}:--load_in_4bit": True}
    lora_r = int(training.get("lora_r") or 0)
    if lora_r <= 0:
        yield Finding(ERROR, "qlora-no-lora", TRAINING_ARGS, "--lora_r",
                      quantization.refusal(load_in_4bit=True, lora_r=lora_r, strategy="single", fp8_backend=None),
                      "Add --lora_r 16 to the training args (or drop --load_in_4bit to train all weights).",
                      {**asked, f"{TRAINING_ARGS}:--lora_r": lora_r})
    fp8 = fp8_source(inp)
    if fp8 is not None:
        file, key, backend = fp8
        yield Finding(ERROR, "qlora-fp8", file, key,
                      quantization.refusal(load_in_4bit=True, lora_r=16, strategy="single", fp8_backend=backend),
                      f"Set `{key}` to bf16 in {Path(file).name}, or drop --load_in_4bit.",
                      {**asked, f"{file}:{key}": "fp8"})
    if _strategy(inp) == "fsdp":
        yield Finding(WARNING, "qlora-fsdp", TRAINING_ARGS, "--load_in_4bit",
                      "--load_in_4bit under FSDP: train.py stores the 4-bit weights in the run's precision so that "
                      "accelerate's FSDP2 shards them (uint8 storage would be left unsharded); FSDP needs GPUs, so "
                      "hf_scale has not run this combination on CPU.",
                      "Prefer DeepSpeed ZeRO-3 (proven on CPU) or DDP for QLoRA, or measure --load_in_4bit under FSDP "
                      "with benchmarks/gpu.py --qlora first.", asked)
