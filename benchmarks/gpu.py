"""GPU throughput: a ~1.1B-parameter Llama on one GPU, hf_scale's train.py vs the plain HF Trainer and a plain
PyTorch packed loop (goals of issue 12: >= 3x the plain Trainer's tokens/s and >= 40% MFU). Needs one CUDA GPU.

    python benchmarks/gpu.py --profile                         # every variant below, results/gpu.json (+ profile)
    python benchmarks/gpu.py --variants baseline hf_scale_best --steps 40 --merge   # add rows to results/gpu.json
    python benchmarks/gpu.py --cpu-smoke --output /tmp/gpu.json  # no GPU: a tiny model, proves the script runs

Model: TinyLlama-1.1B's shapes built from a LlamaConfig (hidden 2048, 22 layers, 32 heads / 4 KV heads, MLP 5632,
vocab 32000), random init, saved once in fp32 (nothing downloaded); the byte-level tokenizer of hf_scale's embedded
model. Data: ``common.INSTRUCTION_LENGTHS`` with medians x4 (prompt ~160, response ~240 tokens, log-normal long
tail), every example cut to --seq-len (2,048) tokens, loss on the responses. Every variant sees the same examples.

Variants, each a fresh process with its own time limit (--variant-timeout); a failed or timed-out variant is
recorded with its whole stderr (in the results and in WORKDIR/VARIANT/stderr.log), its last lines are printed, and
the next variant runs:

* ``baseline``: ``transformers.Trainer`` with default TrainingArguments except ``bf16=True``, batch and steps; the
  model's default attention (sdpa), pad-to-longest collator, --micro-batch (8) examples per step.
* ``torch_packed``: plain PyTorch, no hf_scale: one row of --budget (16,384) tokens per step, examples packed
  greedily in a shuffled order, sdpa with the dense document mask transformers builds from restarting position
  ids, fp32 master weights + bf16 autocast, fused AdamW. ``torch_packed_bf16``: the same with bf16 parameters.
  These references (and ``baseline``) are benchmarks/gpu_workers.py; this file runs and measures the variants.
* ``hf_scale``: ``train.py --loop trainer --bf16 --packing``, --micro-batch rows of --seq-len tokens,
  ``--attn_implementation auto``. ``hf_scale_gc`` / ``hf_scale_compile`` / ``hf_scale_gc_compile``: the same with
  ``--gradient_checkpointing`` and/or ``--torch_compile``. ``hf_scale_loop``: the manual loop. ``hf_scale_zero3``:
  DeepSpeed ZeRO-3 in one process (``hf-scale generate --preset zero3``, the generated torchrun script).
* ``hf_scale_best``: ``train.py --loop accelerate --bf16 --packing --max_seq_length BUDGET
  --per_device_train_batch_size 1 --use_liger_kernel --torch_compile --optim adamw_torch_fused`` (auto attention:
  flash-attention if installed, else PyTorch's varlen kernel). ``hf_scale_best_bf16``: the same with bf16 weights
  (``--torch_dtype bfloat16``), like ``torch_packed_bf16``.
* ``hf_scale_fp8`` (FP8, against ``hf_scale_compile``), ``hf_scale_qlora`` (QLoRA, against ``hf_scale_lora``): see
  benchmarks/gpu_variants.py; the results' ``precision`` section holds the comparisons.

Metrics, over the steps after --warmup (compilation and allocator warm-up):

* tokens/s: real (non-padding) tokens / time; each train.py variant's attention kernel is read from its log.
* MFU: tokens/s x (6N + 12·L·H·Q·T) / peak, N = parameters taking part in matmuls (all but the input embedding),
  L layers, H heads, Q head dim, T = token-weighted mean example length (each token attends within its own
  example). Padding, and attention computed across examples under a dense mask, count as waste, not useful FLOPs.
  Peak: 989 TFLOP/s bf16 dense for H100/H200 (hf_scale.train.loops.metrics knows A100, L40S, ...), or --peak-tflops.
* peak memory: ``torch.cuda.max_memory_allocated``; mean loss of the measured steps (variants see different
  batches, so losses are comparable only in kind: per-token equality of packing is proven by the test suite).

--profile re-runs the fastest variant for a few steps under torch.profiler (train.py: ``HF_SCALE_PROFILE``) and
writes its top kernels to the results and to ``results/gpu_profile.txt`` (for benchmarks/README.md).
--cpu-smoke runs the same pipeline on a tiny model in fp32 without the GPU-only flags (--bf16, --use_liger_kernel,
--torch_compile), which it lists in the results. Planner accuracy on GPU is benchmarks/planner_gpu_memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import common
import gpu_variants

RESULTS = common.RESULTS_DIR / "gpu.json"
WORKERS = Path(__file__).with_name("gpu_workers.py")
"""The baseline and torch_packed* variants: the references without hf_scale, each its own process."""
MFU_GOAL = 0.40
SPEEDUP_GOAL = 3.0
# TinyLlama-1.1B's shapes; positions up to the packing budget (random init: RoPE has no trained range).
GPU_LLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
# --cpu-smoke: the same pipeline on a model that trains in seconds on a CPU.
SMOKE_LLAMA = dict(common.SMALL_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
GPU_ONLY_FLAGS = ("--bf16", "--use_liger_kernel", "--torch_compile")
LEARNING_RATE = 1e-5
BEST_FLAGS = ["--loop", "accelerate", "--packing", "--per_device_train_batch_size", "1", "--use_liger_kernel",
              "--torch_compile", "--optim", "adamw_torch_fused"]


@dataclass(frozen=True)
class Variant:
    kind: str  # "baseline" (plain Trainer), "torch" (plain PyTorch packed loop) or "train" (train.py)
    flags: list[str] = field(default_factory=list)
    bf16_params: bool = False
    budget_rows: bool = False  # train.py rows of --budget tokens (else --seq-len) per micro-batch


VARIANTS = {
    "baseline": Variant("baseline"),
    "torch_packed": Variant("torch"),
    "torch_packed_bf16": Variant("torch", bf16_params=True),
    "hf_scale": Variant("train", ["--loop", "trainer", "--packing"]),
    "hf_scale_gc": Variant("train", ["--loop", "trainer", "--packing", "--gradient_checkpointing"]),
    "hf_scale_compile": Variant("train", ["--loop", "trainer", "--packing", "--torch_compile"]),
    "hf_scale_gc_compile": Variant(
        "train", ["--loop", "trainer", "--packing", "--gradient_checkpointing", "--torch_compile"]
    ),
    "hf_scale_loop": Variant("train", ["--loop", "accelerate", "--packing"]),
    "hf_scale_zero3": Variant("train", ["--loop", "trainer", "--packing"]),
    "hf_scale_best": Variant("train", BEST_FLAGS, budget_rows=True),
    "hf_scale_best_bf16": Variant("train", [*BEST_FLAGS, "--torch_dtype", "bfloat16"], budget_rows=True),
    # Precision (benchmarks/gpu_variants.py: what each is compared with)
    "hf_scale_fp8": Variant("train", ["--loop", "trainer", "--packing", "--torch_compile"]),
    "hf_scale_lora": Variant("train", ["--loop", "trainer", "--packing", "--lora_r", "16"]),
    "hf_scale_qlora": Variant("train", ["--loop", "trainer", "--packing", "--lora_r", "16", "--load_in_4bit"]),
}
SMOKE_VARIANTS = ("baseline", "torch_packed", "torch_packed_bf16", "hf_scale", "hf_scale_loop", "hf_scale_best")


class VariantFailed(RuntimeError):
    def __init__(self, reason: str, stderr: str):
        super().__init__(reason)
        self.stderr = stderr


class VariantRefused(VariantFailed):
    """train.py refused the variant in one line before training (recorded as that line, not as a failure's stderr;
    a failure of the run except under --cpu-smoke, where the GPU-only variants are refused by design)."""


def flops_per_token(config: dict, mean_attended: float) -> tuple[float, int]:
    """(6N + 12·L·H·Q·T, N) with N = matmul parameters: everything but the input embedding table."""
    from transformers import LlamaConfig

    from hf_scale.planner import model_shapes

    shapes = model_shapes(LlamaConfig(**config), name="gpu-bench")
    n = shapes.total_params - config["vocab_size"] * config["hidden_size"]
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]  # hidden = H x Q
    return 6.0 * n + 12.0 * layers * hidden * mean_attended, n


# ------------------------------------------------------------------------------------------ variants
def run_process(command: list[str], *, env: dict, timeout: float, log_dir: Path) -> tuple[int, str]:
    """Run a variant in its own process group; its whole stdout/stderr go to LOG_DIR/{stdout,stderr}.log.

    Returns (exit code, stderr). A variant past its time limit is killed with its children (torchrun's workers).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = log_dir / "stderr.log"
    with (log_dir / "stdout.log").open("w") as out, stderr_path.open("w") as err:
        process = subprocess.Popen(command, cwd=common.REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise VariantFailed(f"timed out after {timeout:.0f} s", stderr_path.read_text(errors="replace")) from None
    return code, stderr_path.read_text(errors="replace")


def _train_flags(variant: Variant, args, model_dir: Path, data_file: Path, out_dir: Path) -> list[str]:
    flags = [
        "--model_name_or_path", str(model_dir), "--train_file", str(data_file),
        "--max_seq_length", str(args.budget if variant.budget_rows else args.seq_len),
        "--max_steps", str(args.steps), "--learning_rate", str(LEARNING_RATE), "--seed", "0", "--save_strategy", "no",
        "--output_dir", str(out_dir), "--bf16", *variant.flags,
    ]  # fmt: skip
    if "--per_device_train_batch_size" not in variant.flags:
        flags += ["--per_device_train_batch_size", str(args.micro_batch)]
    return [flag for flag in flags if flag not in GPU_ONLY_FLAGS] if args.cpu_smoke else flags


def _worker_command(variant: Variant, args, model_dir: Path, data_file: Path, run_dir: Path,
                    profile_dir: Path | None) -> list[str]:
    command = [
        sys.executable, str(WORKERS), variant.kind, "--worker-out", str(run_dir / "result.json"),
        "--model", str(model_dir), "--data", str(data_file), "--output-dir", str(run_dir / "out"),
        "--seq-len", str(args.seq_len), "--budget", str(args.budget), "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    if not args.cpu_smoke:
        command.append("--bf16")
    if variant.bf16_params:
        command.append("--bf16-params")
    if profile_dir is not None:
        command += ["--profile-dir", str(profile_dir)]
    return command


def _measure(times: list[float], tokens: list[int], losses: list[float], warmup: int) -> dict:
    if len(times) <= warmup:
        raise VariantFailed(f"{len(times)} steps recorded, need more than --warmup {warmup}", "")
    seconds, real = sum(times[warmup:]), sum(tokens[warmup:])
    measured_losses = losses[warmup:]
    return {
        "tokens_per_s": real / seconds,
        "median_step_s": common.median(times[warmup:]),
        "tokens_per_step": real / len(times[warmup:]),
        "mean_loss": sum(measured_losses) / len(measured_losses) if measured_losses else None,
        "steps": len(times),
    }


def _logged_attention(stderr: str) -> str | None:
    match = re.search(r"^hf_scale: attention: (\S+)", stderr, re.MULTILINE)
    return match.group(1) if match else None


def run_variant(name: str, args, model_dir: Path, data_file: Path, profile_dir: Path | None = None) -> dict:
    """One variant in a fresh process; raises VariantFailed (with the whole stderr) when it produced no numbers."""
    import shutil

    variant = VARIANTS[name]
    run_dir = args.workdir / (f"{name}-profile" if profile_dir else name)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = common.child_env(args.threads)
    if variant.kind != "train":
        command = _worker_command(variant, args, model_dir, data_file, run_dir, profile_dir)
        code, stderr = run_process(command, env=env, timeout=args.variant_timeout, log_dir=run_dir)
        if code != 0:
            raise VariantFailed(f"exit {code}", stderr)
        result = json.loads((run_dir / "result.json").read_text())
        return dict(_measure(result["step_times"], result["tokens"], result["losses"], args.warmup),
                    peak_memory_bytes=result["peak_memory_bytes"])
    out_dir = run_dir / "out"
    flags = _train_flags(variant, args, model_dir, data_file, out_dir)
    if profile_dir is not None:
        env.update(HF_SCALE_PROFILE=str(profile_dir), HF_SCALE_PROFILE_WAIT=str(args.warmup))
    if name in gpu_variants.LAUNCHED:
        env.update(TRAIN_SCRIPT=str(common.TRAIN_PY), MASTER_PORT=str(common.free_port()))
        command = ["bash", str(gpu_variants.launcher(name, args.workdir, args, LEARNING_RATE)), *flags]
    else:
        command = common.train_command(flags)
    code, stderr = run_process(command, env=env, timeout=args.variant_timeout, log_dir=run_dir)
    records = common.read_metrics(out_dir) if (out_dir / "metrics.jsonl").is_file() else []
    if len(records) < args.steps:
        if not records and gpu_variants.refusal(stderr):
            raise VariantRefused(gpu_variants.refusal(stderr), stderr)
        raise VariantFailed(f"exit {code} after {len(records)} of {args.steps} steps", stderr)
    row = _measure([r["step_time_s"] for r in records], [r["tokens"] for r in records],
                   [r["loss"] for r in records], args.warmup)
    row["peak_memory_bytes"] = None if args.cpu_smoke else max(r["peak_memory_bytes"] for r in records)
    row["attention"] = _logged_attention(stderr)
    row["max_data_wait_s"] = max(r.get("data_wait_s", 0.0) for r in records[args.warmup :])
    if "compilations" in records[-1]:
        row["compilations"] = records[-1]["compilations"]
    if code != 0:  # trained every step, failed afterwards (e.g. the save check): keep the numbers, say so
        row.update(exit_code=code, stderr=stderr)
    return row


# ------------------------------------------------------------------------------------------- driver
def write_data(path: Path, *, rows: int, seq_len: int) -> Path:
    """The instruction data with every example cut to `seq_len` tokens (bos + prompt + response + eos; the byte
    tokenizer makes one character one token), so that packing budgets above seq_len see the same examples."""
    common.write_instruction_data(path, rows=rows, scale=4.0)
    room = seq_len - 2
    lines = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        prompt = row["instruction"][: room - 1]
        row.update(instruction=prompt, response=row["response"][: room - len(prompt)])
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


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


def _previous_rows(output: Path, setup: dict) -> dict:
    """--merge: the rows of an earlier run with the same setup (so variants can run in separate calls)."""
    try:
        previous = json.loads(output.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if previous.get("setup") != setup:
        print(f"gpu.py: --merge: {output} was measured with another setup; starting afresh", file=sys.stderr)
        return {}
    return previous.get("results", {})


def _report_failure(name: str, error: VariantFailed, lines: int = 15) -> dict:
    if isinstance(error, VariantRefused):
        print(f"{name:22s} refused: {error}", flush=True)
        return {"refused": str(error)}
    tail = error.stderr.rstrip().splitlines()[-lines:]
    print(f"{name:22s} FAILED ({error}); last lines of its stderr:", flush=True)
    for line in tail:
        print(f"    {line}", flush=True)
    return {"error": str(error), "stderr": error.stderr}


def _profile(best: str, args, model_dir: Path, data_file: Path) -> dict:
    """Re-run `best` for a few steps under torch.profiler; its top kernels go to the results."""
    profile_dir = args.workdir / f"{best}-profile" / "profile"
    short = argparse.Namespace(**{**vars(args), "steps": args.warmup + 5})
    try:
        run_variant(best, short, model_dir, data_file, profile_dir=profile_dir)
    except VariantFailed as error:
        return {"variant": best, **_report_failure(f"{best} (profile)", error)}
    from hf_scale.train.loops.torch_profiler import TOP_KERNELS

    table = (profile_dir / TOP_KERNELS).read_text()
    text_file = args.output.with_name(f"{args.output.stem}_profile.txt")
    text_file.write_text(f"# top kernels of {best} (benchmarks/gpu.py --profile)\n{table}")
    print(f"wrote {text_file}")
    return {"variant": best, "top_kernels": table, "file": str(text_file)}


def _table(rows: dict) -> str:
    return common.format_table(
        ["variant", "tokens/s", "x baseline", "MFU", "peak mem GiB", "ms/step", "attention"],
        [
            [v, r["tokens_per_s"], r["vs_baseline"] or "-", f"{r['mfu']:.1%}" if r["mfu"] else "-",
             r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] else "-", r["median_step_s"] * 1e3,
             r.get("attention") or "-"]
            if "tokens_per_s" in r
            else [v, "REFUSED" if "refused" in r else "FAILED", r.get("refused") or r["error"], "", "", "", ""]
            for v, r in rows.items()
        ],
    )  # fmt: skip


def _summary(rows: dict) -> dict:
    best_name = max(
        (v for v, r in rows.items() if v.startswith("hf_scale") and "tokens_per_s" in r),
        key=lambda v: rows[v]["tokens_per_s"],
        default=None,
    )
    best = rows.get(best_name, {})
    return {
        "variant": best_name,
        "mfu": best.get("mfu"),
        "vs_baseline": best.get("vs_baseline"),
        "meets_mfu_goal": bool(best.get("mfu") and best["mfu"] >= MFU_GOAL),
        "meets_speedup_goal": bool(best.get("vs_baseline") and best["vs_baseline"] >= SPEEDUP_GOAL),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="default: all (with --cpu-smoke: " + ", ".join(SMOKE_VARIANTS) + ")")
    parser.add_argument("--seq-len", type=int, default=2048, help="max tokens per example (default 2048)")
    parser.add_argument("--budget", type=int, default=16384,
                        help="tokens per packed row of torch_packed* and hf_scale_best* (default 16384)")
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="examples (baseline) or packed rows of --seq-len tokens (hf_scale*) per step (default 8)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per variant (default 40)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps not measured (default 10)")
    parser.add_argument("--rows", type=int, default=4000, help="synthetic examples (default 4000)")
    parser.add_argument("--variant-timeout", type=float, default=1200,
                        help="seconds one variant may run before it is killed and recorded as failed (default 1200)")
    parser.add_argument("--profile", action="store_true",
                        help="re-run the fastest hf_scale/torch variant under torch.profiler; top kernels to results")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other variants' rows of --output when its setup is the same")
    parser.add_argument("--peak-tflops", type=float,
                        help="device peak for MFU (default: known GPUs, 989 for H100/H200)")
    parser.add_argument("--threads", type=int, default=4, help="OMP threads per process (default 4)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, fp32: check the script runs")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "gpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")

    import torch

    environment = common.environment()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        reason = "no CUDA GPU visible; this benchmark needs one (--cpu-smoke runs a tiny CPU check of the script)"
        _not_run(args.output, environment, reason)
        print(f"gpu.py: error: {reason}; recorded 'not run' in {args.output}", file=sys.stderr)
        return 2
    from hf_scale.train.loops.metrics import device_peak_flops  # imports datasets: only once the run goes ahead

    config = SMOKE_LLAMA if args.cpu_smoke else GPU_LLAMA
    if args.budget > config["max_position_embeddings"]:
        parser.error(f"--budget {args.budget} is above the model's {config['max_position_embeddings']} positions")
    variants = args.variants or list(SMOKE_VARIANTS if args.cpu_smoke else VARIANTS)
    model_dir = common.build_llama(config, args.workdir / ("smoke-llama" if args.cpu_smoke else "llama-1.1b"))
    data_file = write_data(args.workdir / "instructions.jsonl", rows=args.rows, seq_len=args.seq_len)
    lengths = common.token_lengths(model_dir, data_file, args.seq_len)
    mean_attended = sum(n * n for n in lengths) / sum(lengths)
    fpt, matmul_params = flops_per_token(config, mean_attended)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops()
    setup = {
        "model": dict(config, matmul_parameters=matmul_params),
        "data": {"spec": common.INSTRUCTION_LENGTHS, "median_scale": 4.0,
                 "token_lengths": common.length_stats(lengths)},
        "seq_len": args.seq_len, "budget": args.budget, "micro_batch": args.micro_batch, "steps": args.steps,
        "warmup_steps_dropped": args.warmup, "flops_per_token": fpt, "mean_attended_tokens": mean_attended,
        "peak_flops": peak, "smoke_dropped_flags": list(GPU_ONLY_FLAGS) if args.cpu_smoke else [],
    }  # fmt: skip

    rows = _previous_rows(args.output, setup) if args.merge else {}
    for name in variants:
        try:
            row = run_variant(name, args, model_dir, data_file)
        except VariantFailed as error:  # one broken variant must not hide the others' numbers
            rows[name] = _report_failure(name, error)
            continue
        row["mfu"] = row["tokens_per_s"] * fpt / peak if peak else None
        rows[name] = row
        print(f"{name:22s} {row['tokens_per_s']:10.0f} tokens/s", flush=True)
    base = rows.get("baseline", {}).get("tokens_per_s")
    for row in rows.values():
        if "tokens_per_s" in row:
            row["vs_baseline"] = row["tokens_per_s"] / base if base else None
    print()
    print(_table(rows))
    payload = {
        "benchmark": "gpu",
        "status": "cpu smoke (not a measurement)" if args.cpu_smoke else "ok",
        "environment": environment,
        "setup": setup,
        "goals": {"mfu": MFU_GOAL, "vs_baseline": SPEEDUP_GOAL},
        "results": rows,
        "best_hf_scale": _summary(rows),
        "precision": gpu_variants.comparisons(rows),
    }
    if args.profile:
        measured = [v for v in variants if v != "baseline" and "tokens_per_s" in rows.get(v, {})]
        if measured:
            payload["profile"] = _profile(max(measured, key=lambda v: rows[v]["tokens_per_s"]), args, model_dir,
                                          data_file)
    common.write_results(args.output, payload)
    print(f"wrote {args.output}")
    failed = [r for r in rows.values() if "error" in r or ("refused" in r and not args.cpu_smoke)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
