"""Builds one known silent fallback for real (2 processes under torchrun) and runs the runtime guard on it.

Usage: torchrun --nproc_per_node 2 tests/_guard_worker.py MODE OUT_DIR
Each rank writes OUT_DIR/rank{N}.json with {"problems": [...]} (empty when the guard passes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs
from transformers import AutoModelForCausalLM

from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.setup import guard

MICRO, ACCUM = 2, 2


def deepspeed_config(stage: int, *, accum: int = ACCUM, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "train_batch_size": MICRO * accum * 2,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def expected(strategy: str, **overrides) -> guard.Expected:
    fields = {
        "strategy": strategy,
        "world_size": 2,
        "micro_batch_size": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "precision": "no",
    }
    fields.update(overrides)
    return guard.Expected(**fields)


def load_model():
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR)


def prepare_deepspeed(config: dict):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    model = load_model()
    from accelerate.utils import DummyOptim

    optimizer = DummyOptim(model.parameters(), lr=1e-3)
    model, _ = accelerator.prepare(model, optimizer)
    return accelerator, model


def scenario(mode: str) -> list[str]:
    if mode == "no_gloo":
        # The trap: accelerate on CPU without a backend → DistributedType.NO in each of the 2 processes.
        accelerator = Accelerator()
        model = accelerator.prepare(load_model())
        return guard.find_problems(expected("ddp"), guard.observe(accelerator, model, MICRO))
    if mode == "ddp_ok":
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(load_model())
        return guard.find_problems(expected("ddp"), guard.observe(accelerator, model, MICRO))
    if mode == "fsdp_on_cpu":
        # FSDP requested, but with cpu=True accelerate ignores the FSDP plugin and wraps the model in DDP.
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(load_model())
        return guard.find_problems(expected("fsdp"), guard.observe(accelerator, model, MICRO))
    if mode == "zero_stage_mismatch":
        accelerator, model = prepare_deepspeed(deepspeed_config(stage=2))
        return guard.find_problems(
            expected("deepspeed", zero_stage=3), guard.observe(accelerator, model, MICRO)
        )
    if mode == "accumulation_mismatch":
        # accelerate silently keeps DeepSpeed's accumulation when it disagrees with the loop's.
        accelerator, model = prepare_deepspeed(deepspeed_config(stage=2, accum=4))
        return guard.find_problems(
            expected("deepspeed", zero_stage=2), guard.observe(accelerator, model, MICRO)
        )
    if mode == "precision_mismatch":
        accelerator, model = prepare_deepspeed(deepspeed_config(stage=2, bf16=True))
        return guard.find_problems(
            expected("deepspeed", zero_stage=2), guard.observe(accelerator, model, MICRO)
        )
    if mode == "zero3_loaded_full":
        # The model is loaded before any DeepSpeed config exists: every rank materialises full weights.
        model = load_model()
        partitioned = guard.zero3_weights_partitioned(model)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=deepspeed_config(stage=3), zero3_init_flag=True),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
        )
        from accelerate.utils import DummyOptim

        model, _ = accelerator.prepare(model, DummyOptim(model.parameters(), lr=1e-3))
        return guard.find_problems(
            expected("deepspeed", zero_stage=3, zero3_init=True),
            guard.observe(accelerator, model, MICRO, loaded_partitioned=partitioned),
        )
    raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    problems = scenario(mode)
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"problems": problems}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
