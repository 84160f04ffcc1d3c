"""The final save — a Hugging Face model directory loadable without DeepSpeed — and its proof.

After saving, every rank runs the trained (still wrapped, possibly ZeRO-3-sharded) model on a short
probe; the main process reloads the saved directory with plain `from_pretrained` and compares the
logits. A save that lost weights (the classic empty ZeRO-3 `pytorch_model.bin`) fails here instead of
being discovered at deployment. The probe and the live logits are kept in `hf_scale_verify.pt` so the
comparison can be repeated offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VERIFY_FILE = "hf_scale_verify.pt"
REPORT_FILE = "hf_scale_verify.json"


def save_with_accelerator(accelerator, model, tokenizer, output_dir: str) -> None:
    """Manual loop: gather (ZeRO-3: 16-bit weights) and write safetensors + tokenizer."""
    accelerator.wait_for_everyone()
    state_dict = _gathered_state_dict(accelerator, model)
    # --torch_compile: accelerate keeps the compiled wrapper, whose keys carry `_orig_mod.`; a saved model
    # must use the plain module's names (found by the save verification below).
    if state_dict is not None:  # ZeRO-3 gathers onto the main process only
        state_dict = {key.removeprefix("_orig_mod."): value for key, value in state_dict.items()}
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    unwrapped.save_pretrained(
        output_dir,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=state_dict,
        safe_serialization=True,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def _gathered_state_dict(accelerator, model) -> dict:
    """The full state dict; a collective under ZeRO-3 and FSDP (every rank calls it)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and accelerator.distributed_type.name != "FSDP":
        from hf_scale.train.fsdp import full_state_dict

        return full_state_dict(model)  # sharded by hf_scale.train.fsdp.shard_on_cpu; accelerate can't gather it
    return accelerator.get_state_dict(model)


@torch.no_grad()
def live_logits(wrapped_model, input_ids: torch.Tensor, device) -> torch.Tensor:
    """Logits of the trained model as it is wrapped for training (all ranks must call: ZeRO-3 gathers)."""
    was_training = wrapped_model.training
    wrapped_model.eval()
    logits = wrapped_model(input_ids=input_ids.to(device)).logits.float().cpu()
    if was_training:
        wrapped_model.train()
    return logits


def verify_saved_model(
    output_dir: str, input_ids: torch.Tensor, logits: torch.Tensor, *, is_lora: bool
) -> dict:
    """Reload `output_dir` without DeepSpeed (main process) and compare its logits with the live ones."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # Otherwise from_pretrained would build the reloaded model inside zero.Init, a collective.
    unset_hf_deepspeed_config()
    if is_lora:
        from peft import AutoPeftModelForCausalLM

        reloaded = AutoPeftModelForCausalLM.from_pretrained(output_dir)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(output_dir)
    reloaded.eval()
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=input_ids).logits.float()
    max_abs_diff = float((reloaded_logits - logits).abs().max())
    dtype = str(next(reloaded.parameters()).dtype).removeprefix("torch.")
    # fp32 weights must reproduce the logits up to kernel-order noise; 16-bit saves within bf16 precision.
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    report = {
        "max_abs_diff": max_abs_diff,
        "tolerance": tolerance,
        "saved_dtype": dtype,
        "ok": max_abs_diff <= tolerance,
    }
    torch.save({"input_ids": input_ids, "logits": logits}, Path(output_dir) / VERIFY_FILE)
    (Path(output_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report
