"""How long `python train.py --help` takes, against the interpreter's own start and `import torch`.

Every command is a fresh process, run `--reps` times in alternating order (common.alternating), and the median
wall time is kept. The variants:

- `python`: `python -c pass`, the floor any command pays;
- `import_torch`: `python -c "import torch"`, what any command that loads the training stack pays at least;
- `help`: `python train.py --help` (rendered from the parser's snapshot, hf_scale.contract.help_snapshot);
- `help_live_parser`: the same help from the live parser (`build_parser().print_help()`), which imports
  transformers' TrainingArguments: what `train.py --help` cost before the snapshot.

Goal: `help` under 2 s on the reference machine, i.e. no heavier than the interpreter plus hf_scale's own light
modules; the ratios to `python` and `import_torch` say the same on a loaded machine, where seconds do not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import common

RESULTS = common.RESULTS_DIR / "train_help.json"
VARIANTS = {
    "python": [sys.executable, "-c", "pass"],
    "import_torch": [sys.executable, "-c", "import torch"],
    "help": [sys.executable, str(common.TRAIN_PY), "--help"],
    "help_live_parser": [sys.executable, "-c",
                         "from hf_scale.contract.parser import build_parser; build_parser().print_help()"],
}
GOAL_SECONDS = 2.0


def wall_time(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=common.REPO, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="runs of each command; the median is kept (default 7)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    environment = common.environment()
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        for name in common.alternating(list(VARIANTS), rep):
            runs[name].append(wall_time(VARIANTS[name]))
    medians = {name: common.median(times) for name, times in runs.items()}
    results = {
        name: {"median_s": medians[name], "runs_s": runs[name], "vs_python": medians[name] / medians["python"],
               "vs_import_torch": medians[name] / medians["import_torch"]}
        for name in VARIANTS
    }
    summary = {"help_s": medians["help"], "goal_s": GOAL_SECONDS, "under_goal": medians["help"] < GOAL_SECONDS,
               "help_vs_import_torch": results["help"]["vs_import_torch"],
               "speedup_vs_live_parser": medians["help_live_parser"] / medians["help"]}
    print(common.format_table(["command", "median s", "x python", "x import torch"],
                              [[name, r["median_s"], r["vs_python"], r["vs_import_torch"]]
                               for name, r in results.items()]))
    print(f"train.py --help: {summary['help_s']:.2f} s (goal < {GOAL_SECONDS:g} s), "
          f"{summary['speedup_vs_live_parser']:.1f}x faster than building the live parser")
    path = common.write_results(args.output, {"environment": environment, "reps": args.reps, "results": results,
                                              "summary": summary})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
