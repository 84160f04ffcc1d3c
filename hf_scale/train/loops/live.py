"""What the run really uses, read back from the live objects at its first optimizer step and written to
OUTPUT_DIR/hf_scale_live.json by the main process.

Flags, YAMLs and JSONs say what was asked; this record says what runs — the proof that every value of a
DistributedConfig reached the run, shaped like the config so that the two compare field by field:

- batch: rows per forward pass and forward passes per optimizer step as this rank's training step saw
  them, and the rows of the step over all ranks (a collective);
- gradient_clipping: the DeepSpeed engine's own value, else the max_grad_norm the loop clips with (null: off);
- optimizer: the live optimizer's first parameter group (the decayed one) — the base lr before warmup and
  decay (`initial_lr`, set by the scheduler), betas, eps, weight decay;
- activation_checkpointing: the unwrapped model's `is_activation_checkpointing`; fsdp.activation_checkpointing:
  FSDP's checkpoint wrappers around its layers;
- precision: the DeepSpeed engine's, else accelerate's mixed precision;
- deepspeed: the engine's own batch, clipping, precision and ZeRO stage (guard.deepspeed_engine_facts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from hf_scale.contract.checkpoint_layout import LIVE_FILE
from hf_scale.train.setup import guard


@dataclass
class Window:
    """The micro-batches of the current optimizer step on this rank."""

    passes: int = 0
    rows: int = 0
    micro_batch_size: int = 0

    def add(self, batch) -> None:
        rows = int(batch["input_ids"].shape[0])
        self.passes += 1
        self.rows += rows
        self.micro_batch_size = max(self.micro_batch_size, rows)


def window_of(batches) -> Window:
    window = Window()
    for batch in batches:
        window.add(batch)
    return window


def _clipping(value) -> float | None:
    return float(value) if value else None  # 0 / None: no clipping, as the config's null


def _activation_checkpointing(model) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (which now warns) to is_activation_checkpointing.
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def read(accelerator, model, optimizer, window: Window, *, max_grad_norm: float, loop: str, step: int) -> dict:
    """The live values (collective: every rank calls it at the same step)."""
    engine = model if guard.is_deepspeed_engine(model) else None
    rows = accelerator.reduce(torch.tensor(window.rows, device=accelerator.device), reduction="sum")
    group = optimizer.param_groups[0]
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    engine_facts = guard.deepspeed_engine_facts(engine) if engine is not None else None
    return {
        "step": step,
        "loop": loop,
        "world_size": accelerator.num_processes,
        "precision": engine_facts["precision"] if engine_facts else str(accelerator.mixed_precision),
        "gradient_clipping": _clipping(engine_facts["gradient_clipping"] if engine_facts else max_grad_norm),
        "activation_checkpointing": _activation_checkpointing(unwrapped),
        "batch": {
            "micro_batch_size": window.micro_batch_size,
            "gradient_accumulation_steps": window.passes,
            "global_batch_size": int(rows.item()),
        },
        "optimizer": {
            "lr": float(group.get("initial_lr", group["lr"])),
            "betas": [float(beta) for beta in group["betas"]] if "betas" in group else None,
            "eps": float(group["eps"]) if "eps" in group else None,
            "weight_decay": float(group.get("weight_decay", 0.0)),
        },
        "fsdp": {"activation_checkpointing": any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())},
        "deepspeed": engine_facts,
    }


def write(output_dir: str, record: dict, accelerator) -> None:
    if accelerator.is_main_process:
        path = os.path.join(output_dir, LIVE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=2)
        os.replace(path + ".tmp", path)
