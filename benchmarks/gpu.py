"""GPU throughput: a ~1.1B-parameter Llama, hf_scale's train.py vs the plain HF Trainer (goals: >= 45% MFU and
>= 1.3x the baseline's tokens/s). Needs one CUDA GPU.

    python benchmarks/gpu.py                                   # every variant below, results/gpu.json
    python benchmarks/gpu.py --variants baseline hf_scale hf_scale_compile --steps 60
    python benchmarks/gpu.py --cpu-smoke --output /tmp/gpu.json  # no GPU: a tiny model, proves the script runs

Model: TinyLlama-1.1B's shapes built from a LlamaConfig (hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP 5632,
vocab 32000), random init, saved once in fp32 (nothing downloaded); the byte-level tokenizer of hf_scale's embedded
model. Data: ``common.INSTRUCTION_LENGTHS`` with medians x4 (prompt ~160, response ~240 tokens, log-normal
long tail, cut at --seq-len), loss on the responses. Every variant sees the same examples, --micro-batch of them
per step, 1 GPU, gradient accumulation 1.

Variants (each a fresh process; hf_scale ones are ``train.py`` and read its metrics.jsonl):

* ``baseline``: ``transformers.Trainer`` with default TrainingArguments except ``bf16=True`` and the batch size /
  step count; the model's default attention (sdpa), pad-to-longest collator (``DataCollatorForSeq2Seq``).
* ``hf_scale``: ``train.py --loop trainer --bf16 --packing``, flash_attention_2 when installed, else sdpa.
* ``hf_scale_gc`` / ``hf_scale_compile`` / ``hf_scale_gc_compile``: the same with ``--gradient_checkpointing``
  and/or ``--torch_compile``.
* ``hf_scale_loop``: ``train.py --loop accelerate --bf16 --packing`` (the manual loop).
* ``hf_scale_zero3``: ``hf_scale`` under DeepSpeed ZeRO-3 in one process (``hf-scale generate --preset zero3``
  for 1 GPU, launched with the generated torchrun script): the engine's own cost.

Metrics, over the steps after --warmup (compilation and allocator warm-up):

* tokens/s: real (non-padding) tokens / time.
* MFU: tokens/s x (6N + 12·L·H·Q·T) / peak, N = parameters taking part in matmuls (all but the input
  embedding), L layers, H heads, Q head dim, T = token-weighted mean example length (each token attends within
  its own example). Padding computed by the baseline counts as waste, not as useful FLOPs. Peak: 989 TFLOP/s
  bf16 dense for H100/H200 (hf_scale.train.metrics knows A100, L40S, ...), or --peak-tflops.
* peak memory: ``torch.cuda.max_memory_allocated``.

Planner accuracy (predicted vs measured peak memory per strategy) is benchmarks/planner_gpu_memory.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "gpu.json"
MFU_GOAL = 0.45
SPEEDUP_GOAL = 1.3
# TinyLlama-1.1B's shapes.
GPU_LLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# --cpu-smoke: the same pipeline on a model that trains in seconds on a CPU.
SMOKE_LLAMA = dict(common.SMALL_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
VARIANTS = (
    "baseline",
    "hf_scale",
    "hf_scale_gc",
    "hf_scale_compile",
    "hf_scale_gc_compile",
    "hf_scale_loop",
    "hf_scale_zero3",
)
SMOKE_VARIANTS = ("baseline", "hf_scale", "hf_scale_gc", "hf_scale_loop")


def flops_per_token(config: dict, mean_attended: float) -> tuple[float, int]:
    """(6N + 12·L·H·Q·T, N) with N = matmul parameters: everything but the input embedding table."""
    from transformers import LlamaConfig

    from hf_scale.planner import model_shapes

    shapes = model_shapes(LlamaConfig(**config), name="gpu-bench")
    n = shapes.total_params - config["vocab_size"] * config["hidden_size"]
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]  # hidden = H x Q
    return 6.0 * n + 12.0 * layers * hidden * mean_attended, n


# ---------------------------------------------------------------------------------------------- baseline
def _baseline_worker(ns: argparse.Namespace) -> int:
    """The plain HF Trainer in this process; writes step times, real tokens per step and peak memory."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    from hf_scale.train.data import DataArguments, load_raw_datasets, tokenize_dataset

    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    data_args = DataArguments(train_file=ns.data, max_seq_length=ns.seq_len)
    dataset = tokenize_dataset(load_raw_datasets(data_args)["train"], tokenizer, data_args)
    pad = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, padding="longest", return_tensors="pt")
    batch_tokens: list[int] = []

    def collate(features):
        batch = pad(features)
        batch_tokens.append(int(batch["attention_mask"].sum()))  # real tokens; GA 1: batch k is step k
        return batch

    cuda = torch.cuda.is_available()

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.last = 0.0

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()  # a step's time is its GPU work, not the kernel launches
            return time.perf_counter()

        def on_train_begin(self, *_, **__):
            self.last = self._now()

        def on_step_end(self, *_, **__):
            now = self._now()
            self.times.append(now - self.last)
            self.last = now

    model = AutoModelForCausalLM.from_pretrained(ns.model)
    args = TrainingArguments(
        output_dir=ns.output_dir,
        per_device_train_batch_size=ns.micro_batch,
        max_steps=ns.steps,
        bf16=ns.bf16,
        report_to="none",
        save_strategy="no",
    )
    clock = StepClock()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    Path(ns.worker_out).write_text(
        json.dumps(
            {
                "step_times": clock.times,
                "tokens": batch_tokens[: len(clock.times)],
                "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------- variants
def _attention() -> str:
    import importlib.util

    import torch

    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


def _zero3_launcher(workdir: Path, smoke: bool) -> Path:
    sets = ["topology.processes_per_machine=1"]
    if smoke:  # CPU: fp32 and torch's AdamW (DeepSpeed's fused Adam needs CUDA)
        sets += ["precision='no'", "deepspeed.torch_adam=true"]
    command = [
        sys.executable,
        "-m",
        "hf_scale.cli",
        "generate",
        "--preset",
        "zero3",
        "--name",
        "zero3_1gpu",
        "--output-dir",
        str(workdir / "configs"),
        "--force",
    ]
    for item in sets:
        command += ["--set", item]
    common.run_checked(command, env=common.child_env(1))
    return workdir / "configs" / "launch" / "zero3_1gpu.torchrun.sh"


def run_variant(variant: str, args, model_dir: Path, data_file: Path, run_dir: Path) -> dict:
    env = common.child_env(args.threads)
    if variant == "baseline":
        out = run_dir / "baseline.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            __file__,
            "--worker-out",
            str(out),
            "--model",
            str(model_dir),
            "--data",
            str(data_file),
            "--output-dir",
            str(run_dir),
            "--seq-len",
            str(args.seq_len),
            "--micro-batch",
            str(args.micro_batch),
            "--steps",
            str(args.steps),
        ]
        common.run_checked(command + ([] if args.cpu_smoke else ["--bf16"]), env=env)
        result = json.loads(out.read_text())
        times, tokens, peak = result["step_times"], result["tokens"], result["peak_memory_bytes"]
    else:
        flags = [
            "--loop",
            "accelerate" if variant == "hf_scale_loop" else "trainer",
            "--model_name_or_path",
            str(model_dir),
            "--train_file",
            str(data_file),
            "--max_seq_length",
            str(args.seq_len),
            "--per_device_train_batch_size",
            str(args.micro_batch),
            "--max_steps",
            str(args.steps),
            "--learning_rate",
            "1e-5",
            "--seed",
            "0",
            "--save_strategy",
            "no",
            "--packing",
            "--attn_implementation",
            _attention(),
            "--output_dir",
            str(run_dir),
        ]
        if not args.cpu_smoke:
            flags.append("--bf16")
        if "_gc" in variant:
            flags.append("--gradient_checkpointing")
        if variant.endswith("compile"):
            flags.append("--torch_compile")
        if variant == "hf_scale_zero3":
            env.update(TRAIN_SCRIPT=str(common.TRAIN_PY), MASTER_PORT=str(common.free_port()))
            common.run_checked(["bash", str(_zero3_launcher(args.workdir, args.cpu_smoke)), *flags], env=env)
        else:
            common.run_checked(common.train_command(flags), env=env)
        records = common.read_metrics(run_dir)
        times = [r["step_time_s"] for r in records]
        tokens = [r["tokens"] for r in records]
        peak = max(r["peak_memory_bytes"] for r in records) if not args.cpu_smoke else None
    if len(times) <= args.warmup:
        raise RuntimeError(f"{variant}: {len(times)} steps recorded, need more than --warmup {args.warmup}")
    seconds, real = sum(times[args.warmup :]), sum(tokens[args.warmup :])
    return {
        "tokens_per_s": real / seconds,
        "median_step_s": common.median(times[args.warmup :]),
        "peak_memory_bytes": peak,
        "steps": len(times),
    }


def _not_run(output: Path, environment: dict, reason: str) -> None:
    """Record that the benchmark did not run, unless `output` already holds results of a real run."""
    if output.is_file():
        try:
            if json.loads(output.read_text()).get("status") == "ok":
                return
        except (OSError, json.JSONDecodeError):
            pass
    common.write_results(
        output, {"benchmark": "gpu", "status": "not run", "reason": reason, "environment": environment}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: all (with --cpu-smoke: no compile)")
    parser.add_argument("--seq-len", type=int, default=2048, help="max tokens per example (default 2048)")
    parser.add_argument("--micro-batch", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per variant (default 40)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps not measured (default 10)")
    parser.add_argument("--rows", type=int, default=4000, help="synthetic examples (default 4000)")
    parser.add_argument(
        "--peak-tflops", type=float, help="device peak for MFU (default: known GPUs, 989 for H100/H200)"
    )
    parser.add_argument("--threads", type=int, default=4, help="OMP threads per process (default 4)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, fp32: check the script runs")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "gpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        return _baseline_worker(args)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")

    import torch

    from hf_scale.train.metrics import device_peak_flops

    environment = common.environment()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        reason = "no CUDA GPU visible; this benchmark needs one (--cpu-smoke runs a tiny CPU check of the script)"
        _not_run(args.output, environment, reason)
        print(f"gpu.py: error: {reason}; recorded 'not run' in {args.output}", file=sys.stderr)
        return 2
    config = SMOKE_LLAMA if args.cpu_smoke else GPU_LLAMA
    variants = args.variants or list(SMOKE_VARIANTS if args.cpu_smoke else VARIANTS)
    model_dir = common.build_llama(config, args.workdir / ("smoke-llama" if args.cpu_smoke else "llama-1.1b"))
    data_file = common.write_instruction_data(args.workdir / "instructions.jsonl", rows=args.rows, scale=4.0)
    lengths = common.token_lengths(model_dir, data_file, args.seq_len)
    mean_attended = sum(n * n for n in lengths) / sum(lengths)
    fpt, matmul_params = flops_per_token(config, mean_attended)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops()

    rows: dict[str, dict] = {}
    for variant in variants:
        try:
            row = run_variant(variant, args, model_dir, data_file, args.workdir / variant)
        except RuntimeError as error:  # one broken variant must not hide the others' numbers
            rows[variant] = {"error": str(error)[-3000:]}
            print(f"{variant:22s} FAILED: {str(error).splitlines()[0]}", flush=True)
            continue
        row["mfu"] = row["tokens_per_s"] * fpt / peak if peak else None
        rows[variant] = row
        print(f"{variant:22s} {row['tokens_per_s']:10.0f} tokens/s", flush=True)
    base = rows.get("baseline", {}).get("tokens_per_s")
    for row in rows.values():
        if "tokens_per_s" in row:
            row["vs_baseline"] = row["tokens_per_s"] / base if base else None
    print()
    print(
        common.format_table(
            ["variant", "tokens/s", "x baseline", "MFU", "peak mem GiB", "ms/step"],
            [
                [
                    v,
                    r["tokens_per_s"],
                    r["vs_baseline"] or "-",
                    f"{r['mfu']:.1%}" if r["mfu"] else "-",
                    r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else "-",
                    r["median_step_s"] * 1e3,
                ]
                if "tokens_per_s" in r
                else [v, "FAILED", "", "", "", ""]
                for v, r in rows.items()
            ],
        )
    )
    best = max(
        (r for v, r in rows.items() if v != "baseline" and "tokens_per_s" in r),
        key=lambda r: r["tokens_per_s"],
        default=None,
    )
    payload = {
        "benchmark": "gpu",
        "status": "cpu smoke (not a measurement)" if args.cpu_smoke else "ok",
        "environment": environment,
        "setup": {
            "model": dict(config, matmul_parameters=matmul_params),
            "data": {
                "spec": common.INSTRUCTION_LENGTHS,
                "median_scale": 4.0,
                "token_lengths": common.length_stats(lengths),
            },
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "steps": args.steps,
            "warmup_steps_dropped": args.warmup,
            "attention": _attention(),
            "flops_per_token": fpt,
            "mean_attended_tokens": mean_attended,
            "peak_flops": peak,
        },
        "goals": {"mfu": MFU_GOAL, "vs_baseline": SPEEDUP_GOAL},
        "results": rows,
        "best_hf_scale": {
            "mfu": best["mfu"] if best else None,
            "vs_baseline": best.get("vs_baseline") if best else None,
            "meets_mfu_goal": bool(best and best["mfu"] and best["mfu"] >= MFU_GOAL),
            "meets_speedup_goal": bool(best and best.get("vs_baseline") and best["vs_baseline"] >= SPEEDUP_GOAL),
        },
    }
    common.write_results(args.output, payload)
    print(f"wrote {args.output}")
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
