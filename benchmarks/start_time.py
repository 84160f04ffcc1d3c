"""How long train.py takes to its first optimizer step, against a bare `import torch, transformers, accelerate`.

Every command is a fresh process, run `--reps` times in alternating order (common.alternating); the medians are
kept. The variants:

- `bare_import`: `python -c "import torch, transformers, accelerate"`, what any script on this stack pays;
- `first_step`: `python train.py --max_steps 1` on the embedded tiny Llama (no LoRA, QLoRA or FP8), timed from the
  launch to the moment its first metrics record (written when step 1 ends) appears in `metrics.jsonl`; the run
  then finishes (save and save check) untimed.

It also records which optional libraries importing train.py's runtime (`hf_scale.train.main`) loads although such
a run uses none of them (issue 32, "fast start": the goal is none). The ratio `first_step / bare_import` is what
docs/benchmarks.md quotes; seconds depend on how busy the machine is, the ratio much less.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "start_time.json"
BARE_IMPORT = [sys.executable, "-c", "import torch, transformers, accelerate"]
OPTIONAL = ("peft", "bitsandbytes", "torchao", "liger_kernel", "ray", "tensorboard", "deepspeed", "trl", "wandb")
LOADED = [sys.executable, "-c", "import sys, json, hf_scale.train.main; "
          f"print(json.dumps([m for m in {list(OPTIONAL)!r} if m in sys.modules]))"]
POLL_S = 0.02


def bare_import(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(BARE_IMPORT, cwd=common.REPO, env=env, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def first_step(env: dict, out: Path) -> float:
    """Seconds from launching train.py to its first metrics record; the run is then waited for (exit 0)."""
    shutil.rmtree(out, ignore_errors=True)
    command = common.train_command(["--max_steps", "1", "--output_dir", str(out), "--report_to", "none"])
    metrics = out / "metrics.jsonl"
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    seconds = None
    while seconds is None and process.poll() is None:
        if metrics.is_file() and metrics.read_text().strip():
            seconds = time.perf_counter() - start
        else:
            time.sleep(POLL_S)
    stdout, stderr = process.communicate(timeout=600)
    if process.returncode != 0 or seconds is None:
        raise common.CommandFailed(command, process.returncode, stdout, stderr)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="runs of each command; the median is kept (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process (default 1)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    environment, env = common.environment(), common.child_env(args.threads)
    out = common.WORK_DIR / "start_time"
    runs: dict[str, list[float]] = {"bare_import": [], "first_step": []}
    with common.failures_recorded(args.output, "start_time"):
        loaded = json.loads(common.run_checked(LOADED, env=env).strip().splitlines()[-1])
        for rep in range(args.reps):
            for name in common.alternating(list(runs), rep):
                runs[name].append(bare_import(env) if name == "bare_import" else first_step(env, out))
    medians = {name: common.median(times) for name, times in runs.items()}
    summary = {"first_step_s": medians["first_step"], "bare_import_s": medians["bare_import"],
               "first_step_vs_bare_import": medians["first_step"] / medians["bare_import"],
               "optional_libraries_loaded_by_the_runtime": loaded}
    print(common.format_table(["command", "median s", "runs s"],
                              [[name, medians[name], " ".join(f"{t:.2f}" for t in runs[name])] for name in runs]))
    print(f"time to first step: {summary['first_step_vs_bare_import']:.2f}x a bare import of torch, transformers and "
          f"accelerate; optional libraries the runtime loads without using them: {', '.join(loaded) or 'none'}")
    path = common.write_results(args.output, {"environment": environment, "reps": args.reps,
                                              "threads": args.threads, "runs_s": runs, "summary": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
