"""Checks of a QLoRA run (`--load_in_4bit` in the training args): the combinations train.py refuses before the model
loads (hf_scale.contract.qlora_refusals, whose words these are), said from the files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import ERROR, TRAINING_ARGS, Finding
from hf_scale.check.fp8 import fp8_source
from hf_scale.check.inputs import FSDP_VERSION_KEY, CheckInputs, fsdp_version_of
from hf_scale.files.reading import get_path


def check_qlora(inp: CheckInputs) -> Iterator[Finding]:
    """`qlora-no-lora`, `qlora-fp8`, `qlora-fsdp1`: --load_in_4bit without a LoRA rank (a 4-bit base cannot be fully
    fine-tuned), with fp8 (the 4-bit layers fix the compute dtype), or under FSDP version 1 (accelerate's default when
    the YAML has no fsdp_version). DDP, ZeRO-3 and FSDP2 need nothing here: train.py stores the 4-bit weights in the
    dtype ZeRO-3/FSDP2 shard (tests/train/model/test_quantization.py runs all three on CPU)."""
    training = inp.training or {}
    if not training.get("load_in_4bit"):
        return
    from hf_scale.contract import qlora_refusals

    asked = {f"{TRAINING_ARGS}:--load_in_4bit": True}
    lora_r = int(training.get("lora_r") or 0)
    if lora_r <= 0:
        yield Finding(ERROR, "qlora-no-lora", TRAINING_ARGS, "--lora_r",
                      qlora_refusals.refusal(load_in_4bit=True, lora_r=lora_r, fp8_backend=None),
                      "Add --lora_r 16 to the training args (or drop --load_in_4bit to train all weights).",
                      {**asked, f"{TRAINING_ARGS}:--lora_r": lora_r})
    fp8 = fp8_source(inp)
    if fp8 is not None:
        file, key, backend = fp8
        yield Finding(ERROR, "qlora-fp8", file, key,
                      qlora_refusals.refusal(load_in_4bit=True, lora_r=16, fp8_backend=backend),
                      f"Set `{key}` to bf16 in {Path(file).name}, or drop --load_in_4bit.",
                      {**asked, f"{file}:{key}": "fp8"})
    if fsdp_version_of(inp) == 1:
        file = inp.accelerate_file
        yield Finding(ERROR, "qlora-fsdp1", file, FSDP_VERSION_KEY,
                      qlora_refusals.sharding_refusal(1, {}),
                      f"Set `fsdp_version: 2` under fsdp_config in {Path(file).name}, or drop --load_in_4bit.",
                      {**asked, f"{file}:{FSDP_VERSION_KEY}": get_path(inp.accelerate, FSDP_VERSION_KEY, None)})
