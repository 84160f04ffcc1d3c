"""The gpu.py variants that need a generated config (ZeRO-3, FP8), and what the precision variants are compared
against in the same run (issue 25, measured on a GPU by issue 20):

* ``hf_scale_fp8``: ``precision: fp8`` (torchao, the default backend) in the config, launched by the generated
  accelerate script, ``--torch_compile`` (fp8 without it is slower, `hf-scale check` warns), against
  ``hf_scale_compile`` (the same flags in bf16): tokens/s ratio and the difference of the measured steps' mean loss.
* ``hf_scale_qlora``: ``--load_in_4bit --lora_r 16`` (NF4 base, bf16 compute), against ``hf_scale_lora`` (the
  same adapter on the bf16 base): tokens/s ratio, peak memory ratio and loss difference.

Both variants of a pair see the same examples in the same order (same seed, data and batch), so their losses are
comparable step for step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import common

LAUNCHED = {"hf_scale_zero3": ("zero3", "torchrun"), "hf_scale_fp8": ("single_gpu", "accelerate")}
"""variant -> (hf_scale preset, the generated launch script that starts it)."""
PAIRS = {"fp8_vs_bf16": ("hf_scale_fp8", "hf_scale_compile"), "qlora_vs_lora": ("hf_scale_qlora", "hf_scale_lora")}


def launcher(name: str, workdir: Path, args, learning_rate: float) -> Path:
    """The generated launch script of a LAUNCHED variant, one process. The script passes the config
    (--hf_scale_config): it holds the values gpu.py's _train_flags gives the other variants."""
    preset, script = LAUNCHED[name]
    sets = ["topology.processes_per_machine=1", f"optimizer.lr={learning_rate}",
            f"batch.micro_batch_size={args.micro_batch}", "batch.gradient_accumulation_steps=1"]
    if name == "hf_scale_fp8":
        sets.append("precision=fp8")
    elif args.cpu_smoke:  # CPU: fp32 and torch's AdamW (DeepSpeed's fused Adam needs CUDA)
        sets += ["precision='no'", "deepspeed.torch_adam=true"]
    command = [sys.executable, "-m", "hf_scale", "generate", "--preset", preset, "--name", name,
               "--output-dir", str(workdir / "configs"), "--force"]
    for item in sets:
        command += ["--set", item]
    common.run_checked(command, env=common.child_env(1))
    return workdir / "configs" / "launch" / f"{name}.{script}.sh"


REFUSAL = "train.py: error: "


def refusal(stderr: str) -> str | None:
    """train.py's one-line refusal in a variant's stderr (e.g. precision=fp8 without an fp8 GPU: the hf_scale_fp8
    variant of a --cpu-smoke run), without the launcher's report around it; None when the variant did not refuse."""
    lines = [line.removeprefix(REFUSAL) for line in stderr.splitlines() if line.startswith(REFUSAL)]
    return lines[0] if lines else None


def comparisons(rows: dict) -> dict:
    """Each precision variant against its twin, where both were measured."""
    out = {}
    for key, (variant, twin) in PAIRS.items():
        a, b = rows.get(variant, {}), rows.get(twin, {})
        if "tokens_per_s" not in a or "tokens_per_s" not in b:
            continue
        out[key] = {"variant": variant, "against": twin, "tokens_per_s_ratio": a["tokens_per_s"] / b["tokens_per_s"],
                    "mean_loss_difference": a["mean_loss"] - b["mean_loss"]}
        if a.get("peak_memory_bytes") and b.get("peak_memory_bytes"):
            out[key]["peak_memory_ratio"] = a["peak_memory_bytes"] / b["peak_memory_bytes"]
    return out
