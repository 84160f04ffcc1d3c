"""Overhead of hf_scale's training loops against the loops users would otherwise write (goal: ratio <= 1.02).

    python benchmarks/overhead.py                         # both paths, 10 pairs of runs each
    python benchmarks/overhead.py --paths accelerate --reps 16 --steps 40

Two comparisons, each on the same model, data, micro-batch, accumulation, optimizer and schedule:

* ``accelerate``: ``train.py --loop accelerate`` (hf_scale's manual loop: token-normalised accumulation, runtime
  guard, per-step metrics) vs the textbook ``with accelerator.accumulate(model):`` loop.
* ``trainer``: ``train.py --loop trainer`` (HF Trainer + hf_scale's guard/metrics callbacks) vs a plain
  ``Trainer`` given the very same TrainingArguments flags.

Every run is a fresh process. A pair is one run of hf_scale and one of the baseline, back to back; pairs alternate
their order (ABBA), so a slow period of the shared machine does not always hit the same side. Startup,
tokenisation and saving are excluded: a run's cost is the median of its optimizer-step times (the interval between
consecutive optimizer steps, as metrics.jsonl's step_time_s and step_cpu_s; the baseline times its steps the same
way) after dropping the warm-up steps, both as process CPU time and as wall time. CPU time decides the verdict: on a
machine shared with other jobs the wall clock also counts the time they held the cores, the CPU time hardly. The
result is the median of the paired ratios hf_scale / baseline, with its bootstrap 90% interval, the quartiles and
the number of pairs; the goal is "met" when the whole interval is <= 1.02, "not met" when it is all above, else
"undecided" (run more pairs). Both sides get the same tokenised dataset and collator (hf_scale's data pipeline);
only the training loop differs. The data are fixed-length rows, so every step does the same work whatever order
the samplers pick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "overhead.json"
SEQ_LEN = 128
GOAL = 1.02


BOOTSTRAP = 2000  # resamples for the interval of the median paired ratio


def paired_statistics(ratios: list[float]) -> dict:
    """The median of the paired ratios, its bootstrap 90% interval (fixed seed: the same runs give the same
    interval), the quartiles, the number of pairs, and the verdict: "met" when the whole interval is at or
    below GOAL, "not met" when it is all above, else "undecided" (more pairs needed)."""
    import random

    rng = random.Random(0)
    resampled = sorted(common.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    low, high = resampled[int(0.05 * BOOTSTRAP)], resampled[int(0.95 * BOOTSTRAP) - 1]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    verdict = "met" if high <= GOAL else "not met" if low > GOAL else "undecided"
    return {
        "median_paired_ratio": common.median(ratios),
        "interval_90": [low, high],
        "quartiles": [quartiles[0], quartiles[2]],
        "pairs": len(ratios),
        "paired_ratios": ratios,
        "verdict": verdict,
    }


def training_flags(args: argparse.Namespace) -> list[str]:
    """TrainingArguments flags given identically to train.py and to the baselines."""
    return [
        "--per_device_train_batch_size",
        str(args.micro_batch),
        "--gradient_accumulation_steps",
        str(args.grad_accum),
        "--max_steps",
        str(args.steps),
        "--learning_rate",
        "1e-4",
        "--lr_scheduler_type",
        "linear",
        "--warmup_steps",
        "0",
        "--max_grad_norm",
        "1.0",
        "--optim",
        "adamw_torch",  # the textbook loop's torch.optim.AdamW (not the fused default)
        "--seed",
        "0",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
    ]


# ---------------------------------------------------------------------------------------------- baselines
def _load_data(model_dir: str, data_file: str, max_seq_length: int):
    from transformers import AutoTokenizer

    from hf_scale.contract.data_arguments import DataArguments
    from hf_scale.train.data.batches import make_collator
    from hf_scale.train.data.pipeline import load_raw_datasets, tokenize_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_args = DataArguments(train_file=data_file, max_seq_length=max_seq_length)
    dataset = tokenize_dataset(load_raw_datasets(data_args)["train"], tokenizer, data_args)
    return tokenizer, dataset, make_collator(tokenizer, packing=False)


def _load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    model.config.use_cache = False  # as train.py loads it
    return model


def baseline_accelerate(args, model_dir: str, data_file: str, max_seq_length: int) -> dict:
    """The textbook accelerate loop (https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader
    from transformers import get_scheduler, set_seed

    set_seed(args.seed)
    tokenizer, dataset, collator = _load_data(model_dir, data_file, max_seq_length)
    model = _load_model(model_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    dataloader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collator)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_steps
    )
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    model.train()
    step_times, step_cpu, losses = [], [], []
    window_loss = torch.zeros(())
    step = 0
    last, last_cpu = time.perf_counter(), time.process_time()
    while step < args.max_steps:
        for batch in dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window_loss += loss.detach() / args.gradient_accumulation_steps
            if accelerator.sync_gradients:
                step += 1
                losses.append(window_loss.item())
                window_loss.zero_()
                now, cpu_now = time.perf_counter(), time.process_time()
                step_times.append(now - last)
                step_cpu.append(cpu_now - last_cpu)
                last, last_cpu = now, cpu_now
                if step == args.max_steps:
                    break
    return {"step_times": step_times, "step_cpu": step_cpu, "losses": losses}


def baseline_trainer(args, model_dir: str, data_file: str, max_seq_length: int) -> dict:
    """A plain transformers Trainer; a callback only reads the clocks at every optimizer step."""
    from transformers import Trainer, TrainerCallback, set_seed

    class StepClock(TrainerCallback):
        def __init__(self):
            self.step_times: list[float] = []
            self.step_cpu: list[float] = []
            self.last, self.last_cpu = 0.0, 0.0

        def on_train_begin(self, *_, **__):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            now, cpu_now = time.perf_counter(), time.process_time()
            self.step_times.append(now - self.last)
            self.step_cpu.append(cpu_now - self.last_cpu)
            self.last, self.last_cpu = now, cpu_now

    set_seed(args.seed)
    tokenizer, dataset, collator = _load_data(model_dir, data_file, max_seq_length)
    model = _load_model(model_dir)
    clock = StepClock()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"step_times": clock.step_times, "step_cpu": clock.step_cpu, "losses": losses}


def _worker(argv: list[str]) -> int:
    """`overhead.py --worker KIND --model DIR --data FILE --max-seq-length N --out FILE -- TRAINING FLAGS`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("accelerate", "trainer"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-seq-length", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    split = argv.index("--")
    ns = parser.parse_args(argv[:split])
    from transformers import HfArgumentParser, TrainingArguments

    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv[split + 1 :])
    run = baseline_accelerate if ns.worker == "accelerate" else baseline_trainer
    ns.out.write_text(json.dumps(run(training_args, ns.model, ns.data, ns.max_seq_length)))
    return 0


# ---------------------------------------------------------------------------------------------- driver
def _run_variant(variant: str, path: str, args, model_dir: Path, data_file: Path, run_dir: Path) -> dict:
    flags = training_flags(args)
    env = common.child_env(args.threads)
    if variant == "hf_scale":
        common.run_checked(
            common.train_command(
                [
                    "--loop",
                    path,
                    "--model_name_or_path",
                    str(model_dir),
                    "--train_file",
                    str(data_file),
                    "--max_seq_length",
                    str(SEQ_LEN + 8),
                    "--output_dir",
                    str(run_dir),
                    *flags,
                ]
            ),
            env=env,
        )
        records = common.read_metrics(run_dir)
        step_times, step_cpu = [r["step_time_s"] for r in records], [r["step_cpu_s"] for r in records]
        losses = [r["loss"] for r in records]
    else:
        out = run_dir / "baseline.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        common.run_checked(
            [
                sys.executable,
                __file__,
                "--worker",
                path,
                "--model",
                str(model_dir),
                "--data",
                str(data_file),
                "--max-seq-length",
                str(SEQ_LEN + 8),
                "--out",
                str(out),
                "--",
                "--output_dir",
                str(run_dir),
                *flags,
            ],
            env=env,
        )
        result = json.loads(out.read_text())
        step_times, step_cpu, losses = result["step_times"], result["step_cpu"], result["losses"]
    if len(step_times) != args.steps:
        raise RuntimeError(f"{variant}/{path}: {len(step_times)} steps timed, expected {args.steps}")
    return {
        "median_step_s": common.median(step_times[args.warmup :]),
        "median_step_cpu_s": common.median(step_cpu[args.warmup :]),
        "step_times_s": step_times,
        "step_cpu_s": step_cpu,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return _worker(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", nargs="+", choices=("accelerate", "trainer"), default=["accelerate", "trainer"])
    parser.add_argument("--reps", type=int, default=10, help="pairs of runs per path (default 10)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process (default 1)")
    parser.add_argument("--workdir", type=Path, default=common.WORK_DIR / "overhead")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")

    environment = common.environment()
    model_dir = common.build_llama(common.SMALL_LLAMA, args.workdir / "small-llama")
    rows_needed = args.steps * args.micro_batch * args.grad_accum
    data_file = common.write_fixed_length_text(args.workdir / "data.jsonl", rows=max(256, rows_needed), length=SEQ_LEN)
    variants = ["hf_scale", "baseline"]
    runs: dict[str, dict[str, list[dict]]] = {p: {v: [] for v in variants} for p in args.paths}
    for rep in range(args.reps):
        for path in args.paths:
            for variant in common.alternating(variants, rep):
                run_dir = args.workdir / f"{path}-{variant}-{rep}"
                with common.failures_recorded(args.output, "overhead"):
                    result = _run_variant(variant, path, args, model_dir, data_file, run_dir)
                runs[path][variant].append(result)
                print(
                    f"rep {rep} {path:10s} {variant:8s} median step {result['median_step_s'] * 1e3:8.2f} ms wall, "
                    f"{result['median_step_cpu_s'] * 1e3:8.2f} ms CPU",
                    flush=True,
                )

    summary, table = {}, []
    for path in args.paths:
        pairs = list(zip(runs[path]["hf_scale"], runs[path]["baseline"], strict=True))
        loss_diff = max(abs(a - b) for h, b_run in pairs for a, b in zip(h["losses"], b_run["losses"], strict=True))
        summary[path] = {"max_abs_loss_diff": loss_diff}
        for clock, key in (("cpu", "median_step_cpu_s"), ("wall", "median_step_s")):
            stats = paired_statistics([h[key] / b[key] for h, b in pairs])
            summary[path][clock] = {
                "hf_scale_median_step_s": common.median([h[key] for h, _ in pairs]),
                "baseline_median_step_s": common.median([b[key] for _, b in pairs]),
                **stats,
            }
            table.append(
                [
                    path,
                    clock,
                    summary[path][clock]["hf_scale_median_step_s"] * 1e3,
                    summary[path][clock]["baseline_median_step_s"] * 1e3,
                    stats["median_paired_ratio"],
                    f"{stats['interval_90'][0]:.3f}-{stats['interval_90'][1]:.3f}",
                    f"{stats['quartiles'][0]:.3f}-{stats['quartiles'][1]:.3f}",
                    stats["pairs"],
                    stats["verdict"],
                    loss_diff,
                ]
            )
        # CPU time decides: the wall clock also counts the time other jobs held the shared cores.
        summary[path]["verdict"] = summary[path]["cpu"]["verdict"]
    print()
    print(
        common.format_table(
            [
                "path",
                "clock",
                "hf_scale ms/step",
                "baseline ms/step",
                "median paired",
                "90% interval",
                "quartiles",
                "pairs",
                f"<= {GOAL}",
                "max |dloss|",
            ],
            table,
        )
    )
    payload = {
        "benchmark": "overhead",
        "environment": environment,
        "setup": {
            "model": dict(common.SMALL_LLAMA, parameters="3.0M"),
            "data": f"{max(256, rows_needed)} plain-text rows of exactly {SEQ_LEN} characters (byte tokens)",
            "micro_batch": args.micro_batch,
            "gradient_accumulation_steps": args.grad_accum,
            "steps": args.steps,
            "warmup_steps_dropped": args.warmup,
            "reps": args.reps,
            "threads_per_process": args.threads,
            "precision": "fp32",
            "training_flags": training_flags(args),
            "statistic": (
                "per run: median step time after warm-up (process CPU time and wall time); per pair (one run of "
                "each, back to back, ABBA order): hf_scale / baseline; reported: median of the paired ratios, "
                f"its {BOOTSTRAP} bootstrap 90% interval and the quartiles; verdict from the CPU-time interval"
            ),
        },
        "goal": f"ratio <= {GOAL}",
        "results": summary,
        "runs": runs,
    }
    common.write_results(args.output, payload)
    for path in args.paths:
        cpu = summary[path]["cpu"]
        print(
            f"{path}: goal (<= {GOAL}) {cpu['verdict']}: CPU-time paired ratio {cpu['median_paired_ratio']:.3f}, "
            f"90% interval {cpu['interval_90'][0]:.3f}-{cpu['interval_90'][1]:.3f}, {cpu['pairs']} pairs"
        )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
