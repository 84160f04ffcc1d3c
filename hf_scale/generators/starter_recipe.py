"""A starter train.py recipe (`recipes/NAME.yaml`, `hf-scale generate --recipe`) from a DistributedConfig.

Every key is a train.py flag, commented; what the config decides — micro batch, accumulation,
precision, clipping, activation checkpointing, the AdamW hyper-parameters the DeepSpeed JSON leaves
"auto" — is written with the config's values, so the recipe and the launch files agree. The rest
starts at train.py's defaults (`null` keeps a default). Unlike the other generated files it is meant
to be edited; `hf-scale generate` still refuses to overwrite an edited copy without --force.
"""

from __future__ import annotations

from typing import Any

import yaml

from hf_scale.config.distributed_config import DistributedConfig


def _scalar(value: Any) -> str:
    """One YAML scalar, quoted where YAML would misread it (e.g. the string "no" as false)."""
    if value is None:
        return "null"
    return yaml.safe_dump(value, default_flow_style=True, width=1000).splitlines()[0]


def starter_recipe(cfg: DistributedConfig, name: str, *, header: str, train_flags: dict | None = None) -> str:
    """``train_flags``: what a plan decided beyond the config (`max_seq_length`, `lora_r`, `load_in_4bit`)."""
    opt, planned = cfg.optimizer, train_flags or {}
    sections: list[tuple[str, list[tuple[str, Any, str]]]] = [
        ("model", [
            ("model_name_or_path", None, "Hub id or local directory; null: the tiny Llama shipped with hf_scale"),
            ("chat_template_path", None, "Jinja chat template for a base model without one (chat data)"),
            ("lora_r", planned.get("lora_r", 0), "LoRA rank; 0 trains all weights"),
            ("load_in_4bit", planned.get("load_in_4bit", False), "QLoRA: the base in 4-bit NF4 (needs lora_r > 0)"),
        ]),
        ("data (see docs/data.md)", [
            ("train_file", None, "file(s) .jsonl/.json/.csv/.parquet/.txt; a list of several is a mixture"),
            ("mixture_weights", None, "with several train_file/dataset_name: each one's share, e.g. [0.7, 0.3]"),
            ("dataset_name", None, "Hub id or dataset directory (instead of train_file)"),
            ("validation_file", None, "evaluated by eval_strategy below"),
            ("validation_split_percentage", None, "or carve this % of the training rows for validation"),
            ("max_seq_length", planned.get("max_seq_length"),
             "examples are truncated to this many tokens; null: train.py's default"),
            ("packing", False, "pack examples into rows (no padding)"),
        ]),
        (f"batch, precision and clipping: from the config ({name}); keep them equal to it", [
            ("per_device_train_batch_size", cfg.batch.micro_batch_size, "batch.micro_batch_size"),
            ("gradient_accumulation_steps", cfg.batch.gradient_accumulation_steps, "batch.gradient_accumulation_steps"),
            ("bf16", cfg.precision == "bf16", "precision"),
            ("fp16", cfg.precision == "fp16", "precision"),
            ("gradient_checkpointing", cfg.activation_checkpointing, "activation_checkpointing"),
            ("max_grad_norm", cfg.gradient_clipping or 0.0, "gradient_clipping (0: off)"),
        ]),
        ("optimizer: the config's optimizer section" + (' (the DeepSpeed JSON\'s "auto" values come from these)'
                                                         if cfg.strategy == "deepspeed" else ""), [
            ("learning_rate", opt.lr, "optimizer.lr"),
            ("weight_decay", opt.weight_decay, "optimizer.weight_decay"),
            ("adam_beta1", opt.betas[0], "optimizer.betas[0]"),
            ("adam_beta2", opt.betas[1], "optimizer.betas[1]"),
            ("adam_epsilon", opt.eps, "optimizer.eps"),
            ("lr_scheduler_type", "linear", "linear, cosine, constant_with_warmup, ..."),
            ("warmup_steps", 0, "steps, or a fraction < 1 of the run"),
        ]),
        ("length, evaluation, checkpoints, output", [
            ("num_train_epochs", 1, "or max_steps"),
            ("eval_strategy", "no", "no | steps | epoch (needs validation data)"),
            ("eval_steps", None, "with eval_strategy steps; null: logging_steps"),
            ("per_device_eval_batch_size", 8, "eval micro-batch per process"),
            ("save_steps", 500, "a checkpoint every N steps, and at the end"),
            ("save_total_limit", None, "keep the newest N checkpoints"),
            ("output_dir", f"outputs/{name}", "model, checkpoints, metrics.jsonl"),
            ("loop", "trainer", "trainer (HF Trainer) | accelerate (hf_scale's manual loop)"),
            ("push_to_hub", False, "push the final, verified model (hub_model_id; token: HF_TOKEN)"),
            ("hub_model_id", None, "namespace/name; null: the output directory's name"),
        ]),
    ]
    width = max(len(f"{key}: {_scalar(value)}") for _, rows in sections for key, value, _ in rows)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [
        f"# Starter recipe for train.py, consistent with the config {name}. Run it with the launch files:",
        f"#   bash launch/{name}.accelerate.sh recipes/{name}.yaml [flags that override it]",
        "# Every key is a train.py flag (python train.py --help); null keeps train.py's default.",
    ]
    for title, rows in sections:
        lines += ["", f"# --- {title}"]
        lines += [f"{key}: {_scalar(value)}".ljust(width) + f"  # {comment}" for key, value, comment in rows]
    return "\n".join(lines) + "\n"
