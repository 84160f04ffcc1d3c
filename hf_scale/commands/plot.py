"""`hf-scale plot`: loss curves from train.py's metrics.jsonl, and tokens/s per run or per strategy.

Reading and summarising the inputs (:func:`load_plot_data`) is pure and separate from drawing
(:func:`write_figure`), so what a plot shows can be checked without looking at pixels.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.files.reading import load_json, read_text
from hf_scale.files.writing import check_output_file, save_figure_atomically

MAX_METRICS_BYTES = 2**30
"""A metrics.jsonl line is ~300 bytes: a GiB is millions of steps."""

PLOT_EPILOG = """\
inputs:
  metrics.jsonl          train.py's per-step metrics (OUTPUT_DIR/metrics.jsonl): loss curve; with several files,
                         one curve each plus a bar chart of their tokens/s
  RESULTS.json           a benchmark results file with tokens/s per strategy
                         (benchmarks/results/strategies_cpu.json): bar chart, ratios to DDP

examples:
  hf-scale plot outputs/hf_scale-run/metrics.jsonl -o loss.png
  hf-scale plot runs/ddp/metrics.jsonl runs/zero3/metrics.jsonl --labels DDP ZeRO-3 -o compare.png
  hf-scale plot benchmarks/results/strategies_cpu.json -o strategies.png
"""


@dataclass
class Run:
    """One metrics.jsonl: the loss of every optimizer step and the run's typical throughput."""

    label: str
    steps: list[int]
    losses: list[float]
    tokens_per_sec: float | None
    """Median over the steps after the first (the first pays for warm-up); None if not recorded."""


@dataclass
class PlotData:
    runs: list[Run] = field(default_factory=list)
    strategies: dict[str, float] = field(default_factory=dict)
    """Strategy -> tokens/s, from a benchmark results JSON."""
    source: str = ""


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; one-line errors naming the file (and line) for anything unusable."""
    text = read_text(path, "metrics file", max_bytes=MAX_METRICS_BYTES,
                     expected="the metrics.jsonl train.py writes in its --output_dir")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(
                f"{path}:{number}: not a JSON object ({error.msg}); expected train.py's metrics.jsonl"
            ) from None
        if isinstance(record, dict) and "eval_loss" in record and "loss" not in record:
            continue  # an evaluation record (--eval_strategy); the curve is the training loss
        if not isinstance(record, dict) or "step" not in record or "loss" not in record:
            raise UserError(
                f"{path}:{number}: a metrics record needs 'step' and 'loss'; expected train.py's metrics.jsonl"
            )
        problem = _record_problem(record)
        if problem:
            raise UserError(f"{path}:{number}: {problem}; expected train.py's metrics.jsonl")
        records.append(record)
    if not records:
        raise UserError(f"{path}: no metrics records (the run logged no optimizer step)")
    return records


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _record_problem(record: dict) -> str | None:
    # A NaN loss is plotted (as a gap): a diverged run is worth seeing.
    if not isinstance(record["step"], int) or isinstance(record["step"], bool) or record["step"] < 0:
        return f"step={record['step']!r} is not a step number"
    if not _is_number(record["loss"]):
        return f"loss={record['loss']!r} is not a number"
    rate = record.get("tokens_per_sec")
    if rate is not None and not (_is_number(rate) and math.isfinite(rate) and rate >= 0):
        return f"tokens_per_sec={rate!r} is not a number >= 0"
    return None


def summarise_run(records: list[dict], label: str) -> Run:
    rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec") is not None]
    steady = rates[1:] or rates
    return Run(
        label=label,
        steps=[int(r["step"]) for r in records],
        losses=[float(r["loss"]) for r in records],
        tokens_per_sec=statistics.median(steady) if steady else None,
    )


def read_strategy_results(path: Path) -> dict[str, float]:
    """Strategy -> tokens/s from a benchmark results JSON (``{"results": {NAME: {"tokens_per_s": X}}}``)."""
    data = load_json(read_text(path, "results file", expected="a benchmark results JSON"), f"results file {path}")
    results = data.get("results") if isinstance(data, dict) else None
    if (
        not isinstance(results, dict)
        or not results
        or not all(
            isinstance(row, dict) and _is_number(row.get("tokens_per_s")) and row["tokens_per_s"] >= 0
            for row in results.values()
        )
    ):
        raise UserError(
            f"{path}: expected a benchmark results file with tokens_per_s per strategy under 'results' "
            "(benchmarks/results/strategies_cpu.json)"
        )
    return {name: float(row["tokens_per_s"]) for name, row in results.items()}


def load_plot_data(inputs: list[Path], labels: list[str] | None = None) -> PlotData:
    """What the figure will show. A `.json` input is a results file (alone); anything else is a metrics.jsonl."""
    results = [p for p in inputs if p.suffix == ".json"]
    if results:
        if len(inputs) > 1:
            raise UserError(
                f"{results[0]}: a results JSON is plotted on its own; got {len(inputs)} inputs "
                "(pass either one results .json or metrics.jsonl files)"
            )
        if labels:
            raise UserError("--labels applies to metrics.jsonl inputs; a results JSON names its strategies")
        return PlotData(strategies=read_strategy_results(results[0]), source=str(results[0]))
    if labels is not None and len(labels) != len(inputs):
        raise UserError(f"--labels: {len(labels)} label(s) for {len(inputs)} metrics file(s); give one per file")
    names = labels or [_default_label(p) for p in inputs]
    return PlotData(runs=[summarise_run(read_metrics(p), name) for p, name in zip(inputs, names, strict=True)])


def _default_label(path: Path) -> str:
    # train.py always writes OUTPUT_DIR/metrics.jsonl: the run's directory names it.
    return (path.resolve().parent.name or path.stem) if path.name == "metrics.jsonl" else path.stem


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise UserError("hf-scale plot needs matplotlib: pip install 'hf-scale[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def check_output(path: Path) -> str:
    """The image format from the file name, refused before any work if matplotlib cannot write it."""
    check_output_file(path, "-o")
    plt = _matplotlib()
    fmt = path.suffix.lstrip(".").lower()
    supported = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if fmt not in supported:
        raise UserError(f"-o {path}: unsupported image type {fmt!r}; allowed: {', '.join(sorted(supported))}")
    return fmt


def write_figure(data: PlotData, path: Path, fmt: str, title: str | None = None) -> None:
    plt = _matplotlib()
    if data.strategies:
        fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
        _strategy_bars(ax, data.strategies)
        ax.set_title(title or f"tokens/s per strategy ({Path(data.source).name})")
    elif len(data.runs) == 1:
        fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
        _loss_curves(ax, data.runs)
        ax.set_title(title or f"training loss ({data.runs[0].label})")
    else:
        fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
        _loss_curves(ax_loss, data.runs)
        ax_loss.set_title("training loss")
        _run_bars(ax_rate, data.runs)
        if title:
            fig.suptitle(title)
    try:
        save_figure_atomically(fig, path, dpi=110, format=fmt)
    finally:
        plt.close(fig)


def _loss_curves(ax, runs: list[Run]) -> None:
    for run in runs:
        ax.plot(run.steps, run.losses, marker="." if len(run.steps) <= 50 else None, label=run.label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token-weighted mean)")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=9)


def _run_bars(ax, runs: list[Run]) -> None:
    measured = [r for r in runs if r.tokens_per_sec is not None]
    bars = ax.bar([r.label for r in measured], [r.tokens_per_sec for r in measured])
    ax.bar_label(bars, fmt="%.0f", fontsize=9)
    ax.set_ylabel("tokens/s (median over steps after the first)")
    ax.set_title("throughput")


def _strategy_bars(ax, rates: dict[str, float]) -> None:
    names = list(rates)
    bars = ax.bar(names, [rates[n] for n in names])
    reference = rates.get("ddp")
    labels = [f"{rates[n]:.0f}" + (f"\n{rates[n] / reference:.2f}x DDP" if reference else "") for n in names]
    ax.bar_label(bars, labels=labels, fontsize=9)
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_ylim(0, max(rates.values()) * 1.25)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the plot sub-command."""
    parser = subparsers.add_parser(
        "plot",
        description="Plot the loss curve of one or more train.py runs (their metrics.jsonl) with the tokens/s "
        "of each, or the tokens/s per strategy of a benchmark results JSON.",
        epilog=PLOT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "inputs", nargs="+", type=Path, metavar="FILE", help="metrics.jsonl file(s) or one results .json"
    )
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="PLOT.png", help="image to write")
    parser.add_argument(
        "--labels", nargs="+", metavar="LABEL", help="one label per metrics file (default: file/dir name)"
    )
    parser.add_argument("--title", help="figure title")
    parser.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    # Every input and the output type are checked before anything is written.
    fmt = check_output(args.output)
    data = load_plot_data(args.inputs, args.labels)
    write_figure(data, args.output, fmt, args.title)
    print(f"wrote {args.output}")
    return 0
