"""Packing to a token budget vs pad-to-longest (goal: >= 2x effective tokens/s).

    python benchmarks/packing.py
    python benchmarks/packing.py --reps 5 --steps 20 --micro-batch 16 --packed-rows 2

Both variants are ``train.py --loop accelerate`` on the same model and the same synthetic instruction data
(``common.INSTRUCTION_LENGTHS``: log-normal prompt and response lengths, most examples short, a long tail; the
actual token-length statistics are written to the results), examples cut at 1,024 tokens:

* ``padded``: --micro-batch examples per step, padded to the longest of them;
* ``packed``: ``--packing``: --packed-rows rows per step, each filled with whole examples up to 1,024 tokens
  (best-fit decreasing), position ids restarting per example.

Effective tokens/s = non-padding tokens (metrics.jsonl ``tokens``) / step time, over the steps after the warm-up;
median over alternating runs. The two variants see different batches (a packed row holds ~7 examples of this
data), so their per-step losses are not comparable; that packing leaves the per-token loss of the same examples
unchanged is proven by tests/train/data/test_packing.py and
tests/train/loops/test_loops_equivalence.py. Both mean step losses are
reported.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "packing.json"
GOAL = 2.0
MAX_SEQ_LEN = 1024
VARIANTS = ("packed", "padded")
MODELS = {"small": common.SMALL_LLAMA, "wide": common.WIDE_LLAMA}


def padding_factor(lengths: list[int], micro_batch: int, seed: int = 0) -> float:
    """Tokens computed when padding to the longest of each micro-batch, per real token (shuffled batches)."""
    order = list(lengths)
    random.Random(seed).shuffle(order)
    batches = [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
    return sum(max(b) * len(b) for b in batches) / sum(order)


def run_variant(variant: str, args, model_dir: Path, data_file: Path, run_dir: Path) -> dict:
    flags = [
        "--loop",
        "accelerate",
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(data_file),
        "--max_seq_length",
        str(MAX_SEQ_LEN),
        "--gradient_accumulation_steps",
        "1",
        "--max_steps",
        str(args.steps),
        "--learning_rate",
        "1e-4",
        "--warmup_steps",
        "0",
        "--seed",
        "0",
        "--save_strategy",
        "no",
        "--output_dir",
        str(run_dir),
    ]
    if variant == "packed":
        flags += ["--packing", "--per_device_train_batch_size", str(args.packed_rows)]
    else:
        flags += ["--per_device_train_batch_size", str(args.micro_batch)]
    common.run_checked(common.train_command(flags), env=common.child_env(args.threads))
    records = common.read_metrics(run_dir)
    measured = common.steady(records, args.warmup)
    tokens = sum(r["tokens"] for r in measured)
    seconds = sum(r["step_time_s"] for r in measured)
    return {
        "effective_tokens_per_s": tokens / seconds,
        "measured_tokens": tokens,
        "measured_seconds": seconds,
        "losses": [r["loss"] for r in records],
        "tokens_per_step": [r["tokens"] for r in records],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="runs per variant (default 5)")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run (default 24)")
    parser.add_argument("--warmup", type=int, default=4, help="first steps not measured (default 4)")
    parser.add_argument("--micro-batch", type=int, default=8, help="padded: examples per micro-batch (default 8)")
    parser.add_argument("--packed-rows", type=int, default=1,
                        help=f"packed: rows of {MAX_SEQ_LEN} tokens per micro-batch (default 1)")
    parser.add_argument("--rows", type=int, default=2000, help="synthetic examples (default 2000)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process (default 1)")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "packing")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="small",
        help="small: 3.0M, 256 wide (attention over the packed row dominates); wide: 38M, 1536 wide (the "
        "FLOP balance of a real fine-tune)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")

    environment = common.environment()
    model_dir = common.build_llama(MODELS[args.model], args.workdir / f"{args.model}-llama")
    data_file = common.write_instruction_data(args.workdir / "instructions.jsonl", rows=args.rows)
    lengths = common.token_lengths(model_dir, data_file, MAX_SEQ_LEN)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in common.alternating(VARIANTS, rep):
            with common.failures_recorded(args.output, "packing"):
                result = run_variant(variant, args, model_dir, data_file, args.workdir / f"{variant}-{rep}")
            runs[variant].append(result)
            print(f"rep {rep} {variant:6s} {result['effective_tokens_per_s']:9.0f} effective tokens/s", flush=True)

    tps = {v: common.median([r["effective_tokens_per_s"] for r in runs[v]]) for v in VARIANTS}
    speedup = tps["packed"] / tps["padded"]
    mean_loss = {v: common.median([sum(r["losses"]) / len(r["losses"]) for r in runs[v]]) for v in VARIANTS}
    stats = common.length_stats(lengths)
    factor = padding_factor(lengths, args.micro_batch)
    print()
    print(f"example lengths (tokens): {stats}; pad-to-longest computes {factor:.2f}x the real tokens")
    print(
        common.format_table(
            ["variant", "effective tokens/s", "mean step loss", "peak RSS MiB"],
            [[v, tps[v], mean_loss[v], max(r["peak_memory_bytes"] for r in runs[v]) / 2**20] for v in VARIANTS],
        )
    )
    print(f"speedup {speedup:.2f}x (goal >= {GOAL}x: {'met' if speedup >= GOAL else 'NOT met'})")
    payload = {
        "benchmark": "packing",
        "environment": environment,
        "setup": {
            "model": dict(MODELS[args.model], name=args.model),
            "loop": "train.py --loop accelerate",
            "length_distribution": {
                "spec": common.INSTRUCTION_LENGTHS,
                "note": "prompt and response lengths drawn log-normal (median, sigma) in characters = byte tokens; "
                "tokens = bos + prompt + response + eos, loss on the response only, cut at max_seq_length",
                "token_lengths": stats,
            },
            "max_seq_length": MAX_SEQ_LEN,
            "micro_batch": args.micro_batch,
            "packed_rows": args.packed_rows,
            "steps": args.steps,
            "warmup_steps_dropped": args.warmup,
            "reps": args.reps,
            "threads_per_process": args.threads,
            "precision": "fp32",
            "attention": "sdpa",
        },
        "goal": f"packed/padded effective tokens/s >= {GOAL}",
        "results": {
            "effective_tokens_per_s": tps,
            "speedup": speedup,
            "meets_goal": speedup >= GOAL,
            "padding_factor_simulated": factor,
            "mean_step_loss": mean_loss,
        },
        "runs": runs,
    }
    common.write_results(args.output, payload)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
