"""The planner's time model against published training runs: predicted vs published tokens/s per GPU of every row of
hf_scale/planner/data/published_runs.yaml, the error of each, the median absolute error and the share within +-25%;
and out of sample: each source predicted with the efficiencies fitted to the other sources only (leave one source out).

    python benchmarks/planner_time_accuracy.py     # the table, and benchmarks/results/planner_time_accuracy.json
    python benchmarks/planner_time_accuracy.py --plot docs/plan_time_accuracy.png  # and the chart

Pure arithmetic (no GPU, seconds). tests/planner/test_planner_time.py holds the same accuracy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import RESULTS_DIR, environment, format_table, write_results

from hf_scale.planner.published import accuracy, compare, excluded, leave_one_source_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "planner_time_accuracy.json")
    parser.add_argument("--plot", type=Path, help="write a predicted-vs-published PNG (needs matplotlib)")
    args = parser.parse_args()
    comparisons = compare()
    held_out = {id(c.row): c for group in leave_one_source_out().values() for c in group}
    rows = [
        (
            c.row["model"],
            c.row["gpu"],
            c.row["gpus"],
            c.row["seq_len"],
            c.row["micro_batch"],
            c.row["recompute"],
            _layout(c.row),
            round(c.published),
            round(c.predicted),
            f"{c.error:+.0%}",
            f"{held_out[id(c.row)].error:+.0%}" if id(c.row) in held_out else "-",
            c.row["source"],
        )
        for c in comparisons
    ]
    print(
        format_table(
            ("model", "gpu", "gpus", "seq", "mb", "recompute", "layout", "published", "predicted", "error", "held out",
             "source"),  # fmt: skip
            rows,
        )
    )
    median, within = accuracy(comparisons)
    print(f"\n{len(comparisons)} rows: median absolute error {median:.1%}, {within:.0%} within +-25%")
    out_median, out_within = accuracy(list(held_out.values()))
    print(
        f"held out (each source predicted with efficiencies fitted to the others): {len(held_out)} rows, median "
        f"absolute error {out_median:.1%}, {out_within:.0%} within +-25%"
    )
    for name, group in leave_one_source_out().items():
        m, share = accuracy(group)
        print(f"  {name}: {len(group)} rows, median {m:.1%}, {share:.0%} within +-25%")
    print("\nkept out of the fit and the accuracies (published_runs.yaml 'excluded'), predicted all the same:")
    for c in excluded():
        r = c.row
        print(f"  {r['model']} {r['gpus']} x {r['gpu']} {_layout(r)}: published {round(c.published)}, predicted "
              f"{round(c.predicted)} ({c.error:+.0%}), {r['source']}: {r['excluded']}")
    write_results(
        args.output,
        {
            "environment": environment(),
            "median_abs_error": median,
            "within_25": within,
            "held_out_median_abs_error": out_median,
            "held_out_within_25": out_within,
            "rows": [
                {**c.row, "predicted": c.predicted, "error": c.error, "held_out_error": held_out[id(c.row)].error}
                for c in comparisons
            ],
        },
    )
    if args.plot:
        _plot(comparisons, args.plot, median, within)
    return 0


def _layout(row: dict) -> str:
    """The row's layout and options, e.g. fsdp_full_shard+cp2+fp8+compile, fsdp_full_shard+tp2+compile+lora16."""
    extras = [f"{k}{row[k]}" for k in ("tp", "cp") if row.get(k, 1) > 1]
    extras += [k for k in ("fp8", "compile", "offload_params") if row.get(k)]
    extras += [f"{'qlora' if row.get('qlora') else 'lora'}{row['lora_r']}"] if row.get("lora_r") else []
    return "+".join([row["layout"], *extras])


def _plot(comparisons, path: Path, median: float, within: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5), layout="constrained")
    for source in sorted({c.row["source"] for c in comparisons}):
        mine = [c for c in comparisons if c.row["source"] == source]
        ax.scatter([c.published for c in mine], [c.predicted for c in mine], label=source, s=18)
    low = min(min(c.published, c.predicted) for c in comparisons) * 0.8
    high = max(max(c.published, c.predicted) for c in comparisons) * 1.25
    ax.plot([low, high], [low, high], color="black", linewidth=1)
    for factor in (0.75, 1.25):
        ax.plot([low, high], [low * factor, high * factor], color="gray", linewidth=0.8, linestyle="--")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="published tokens/s per GPU",
        ylabel="predicted tokens/s per GPU",
        title=f"hf-scale plan vs published runs: median |error| {median:.1%}, {within:.0%} within ±25%",
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
