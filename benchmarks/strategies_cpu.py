"""Step time and per-rank memory of DDP, ZeRO-1/2/3 and ZeRO-3 offload with 2 CPU processes, as ratios to DDP.

    python benchmarks/strategies_cpu.py
    python benchmarks/strategies_cpu.py --strategies ddp zero3 --reps 3 --steps 12

A sanity table for the machinery, not a GPU claim: every strategy is a real 2-process job. Its configs come
from ``hf-scale generate --preset NAME`` (2 processes, fp32, DeepSpeed's torch AdamW), and it is started with
the generated ``launch/NAME.torchrun.sh`` running ``train.py --loop accelerate`` over gloo. Model: an 11.9M
parameter Llama (``common.MEDIUM_LLAMA``), so the model states (16 bytes per parameter under DDP: fp32
weights, gradients and two Adam moments, 190 MB) are visible next to the ~0.5 GB every Python + torch +
DeepSpeed process holds anyway.

* Step time: median optimizer-step time (metrics.jsonl step_time_s) after the warm-up, median over runs;
  strategies run round-robin, in reverse order every other repetition.
* Memory: peak resident memory (RSS) of rank 0 up to the last step (metrics.jsonl peak_memory_bytes; on CPU
  there is no separate device memory), next to the planner's estimate of the model states held per rank
  (for offload: the rank's share of the offloaded states too, since "device" and "host" are the same RAM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "strategies_cpu.json"
SEQ_LEN = 128
WORLD = 2
# name -> hf-scale preset
STRATEGIES = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "zero3_offload": "zero3_offload",
}


def generate(config_dir: Path, name: str, micro_batch: int) -> Path:
    sets = [
        f"topology.processes_per_machine={WORLD}",
        "precision='no'",
        "deepspeed.torch_adam=true",
        f"batch.micro_batch_size={micro_batch}",
        "batch.gradient_accumulation_steps=1",
        "optimizer.lr=1e-4",  # the launch script passes the config (--hf_scale_config): its values are the run's
    ]
    command = [
        sys.executable,
        "-m",
        "hf_scale.commands.cli",
        "generate",
        "--preset",
        STRATEGIES[name],
        "--name",
        name,
        "--output-dir",
        str(config_dir),
        "--force",
    ]
    for item in sets:
        command += ["--set", item]
    common.run_checked(command, env=common.child_env(1))
    return config_dir / "launch" / f"{name}.torchrun.sh"


def planned_model_states(micro_batch: int) -> dict[str, int]:
    """The planner's per-rank model-state bytes (device + this rank's share of offloaded states)."""
    from transformers import LlamaConfig

    from hf_scale.planner import Workload, make_plan, model_shapes

    shapes = model_shapes(LlamaConfig(**common.MEDIUM_LLAMA), name="bench-llama-11.9m")
    workload = Workload(
        shapes, gpus_per_machine=WORLD, num_machines=1, seq_len=SEQ_LEN, micro_batch_size=micro_batch, precision="no"
    )
    plan = make_plan(workload, gpu_memory=10**15)
    by_key = {a.candidate.key: a.estimate for a in plan.assessments if not a.candidate.activation_checkpointing}
    # one catalogue (hf_scale.config.presets): the preset's name is the planner's candidate key
    return {name: by_key[key].model_states + by_key[key].cpu_per_machine // WORLD for name, key in STRATEGIES.items()}


def run_strategy(script: Path, args, model_dir: Path, data_file: Path, run_dir: Path) -> dict:
    env = common.child_env(1)  # 2 ranks on 2 cores
    env.update(TRAIN_SCRIPT=str(common.TRAIN_PY), MASTER_PORT=str(common.free_port()))
    train_args = [
        "--loop",
        "accelerate",
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(data_file),
        "--max_seq_length",
        str(SEQ_LEN + 8),
        "--per_device_train_batch_size",
        str(args.micro_batch),
        "--max_steps",
        str(args.steps),
        "--learning_rate",
        "1e-4",
        "--seed",
        "0",
        "--save_strategy",
        "no",
        "--output_dir",
        str(run_dir),
    ]
    common.run_checked(["bash", str(script), *train_args], env=env)
    records = common.read_metrics(run_dir)
    measured = common.steady(records, args.warmup)
    return {
        "median_step_s": common.median([r["step_time_s"] for r in measured]),
        "tokens_per_s": sum(r["tokens"] for r in measured) / sum(r["step_time_s"] for r in measured),
        "peak_rss_rank0_bytes": max(r["peak_memory_bytes"] for r in records),
        "losses": [r["loss"] for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", choices=tuple(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--reps", type=int, default=2, help="runs per strategy (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not timed (default 2)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "strategies_cpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    if "ddp" not in args.strategies:
        parser.error("--strategies must include ddp (the reference of the ratios)")

    environment = common.environment()
    model_dir = common.build_llama(common.MEDIUM_LLAMA, args.workdir / "medium-llama")
    data_file = common.write_fixed_length_text(
        args.workdir / "data.jsonl", rows=max(256, args.steps * args.micro_batch * WORLD), length=SEQ_LEN
    )
    scripts = {name: generate(args.workdir / "configs", name, args.micro_batch) for name in args.strategies}
    runs: dict[str, list[dict]] = {name: [] for name in args.strategies}
    for rep in range(args.reps):
        for name in common.alternating(args.strategies, rep):
            with common.failures_recorded(args.output, "strategies_cpu"):
                result = run_strategy(scripts[name], args, model_dir, data_file, args.workdir / f"{name}-{rep}")
            runs[name].append(result)
            print(
                f"rep {rep} {name:14s} {result['median_step_s'] * 1e3:8.1f} ms/step  "
                f"peak RSS {result['peak_rss_rank0_bytes'] / 2**20:6.0f} MiB",
                flush=True,
            )

    planned = planned_model_states(args.micro_batch)
    rows = {}
    for name in args.strategies:
        rows[name] = {
            "median_step_s": common.median([r["median_step_s"] for r in runs[name]]),
            "tokens_per_s": common.median([r["tokens_per_s"] for r in runs[name]]),
            "peak_rss_rank0_bytes": common.median([r["peak_rss_rank0_bytes"] for r in runs[name]]),
            "planned_model_states_per_rank_bytes": planned[name],
        }
    ddp = rows["ddp"]
    for row in rows.values():
        row["step_time_vs_ddp"] = row["median_step_s"] / ddp["median_step_s"]
        row["peak_rss_vs_ddp"] = row["peak_rss_rank0_bytes"] / ddp["peak_rss_rank0_bytes"]
        row["peak_rss_minus_ddp_bytes"] = row["peak_rss_rank0_bytes"] - ddp["peak_rss_rank0_bytes"]
        row["planned_model_states_vs_ddp"] = (
            row["planned_model_states_per_rank_bytes"] / ddp["planned_model_states_per_rank_bytes"]
        )
    print()
    print(
        common.format_table(
            [
                "strategy",
                "ms/step",
                "x DDP",
                "tokens/s",
                "peak RSS MiB",
                "x DDP",
                "- DDP MiB",
                "planned states MiB",
                "x DDP",
            ],
            [
                [
                    name,
                    r["median_step_s"] * 1e3,
                    r["step_time_vs_ddp"],
                    r["tokens_per_s"],
                    r["peak_rss_rank0_bytes"] / 2**20,
                    r["peak_rss_vs_ddp"],
                    r["peak_rss_minus_ddp_bytes"] / 2**20,
                    r["planned_model_states_per_rank_bytes"] / 2**20,
                    r["planned_model_states_vs_ddp"],
                ]
                for name, r in rows.items()
            ],
        )
    )
    payload = {
        "benchmark": "strategies_cpu",
        "environment": environment,
        "setup": {
            "model": dict(common.MEDIUM_LLAMA, parameters="11.9M"),
            "processes": WORLD,
            "launcher": "launch/NAME.torchrun.sh from hf-scale generate --preset NAME; train.py --loop accelerate",
            "backend": "gloo (CPU)",
            "data": f"plain-text rows of exactly {SEQ_LEN} characters (byte tokens)",
            "micro_batch_per_rank": args.micro_batch,
            "gradient_accumulation_steps": 1,
            "steps": args.steps,
            "warmup_steps_dropped": args.warmup,
            "reps": args.reps,
            "threads_per_process": 1,
            "precision": "fp32",
            "memory": "peak RSS of rank 0 up to the last step (includes the ~0.5 GB Python/torch/DeepSpeed runtime)",
        },
        "note": "CPU sanity table, not a GPU claim: on CPU, offload moves states between two names for the same RAM",
        "results": rows,
        "runs": runs,
    }
    common.write_results(args.output, payload)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
