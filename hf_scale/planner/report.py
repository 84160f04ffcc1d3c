"""A plan as a table, as JSON, or as a stacked-bar chart. Pure functions except :func:`write_plot`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_scale.errors import UserError
from hf_scale.files.writing import save_figure_atomically
from hf_scale.planner.rank import TIE, Assessment, Plan, distributed_config, gib, train_argv, train_flags

CATEGORIES = ("params", "grads", "optimizer", "activations", "logits", "buffers")
_GIB = 2**30


def _fmt(n: int) -> str:
    return f"{n / _GIB:.1f}"


@dataclass(frozen=True)
class Budget:
    """What the run is to train (`plan --tokens N`) and what a GPU-hour costs, for the wall-clock and cost lines."""

    tokens: float | None = None
    price_per_gpu_hour: float | None = None


def run_time(plan: Plan, a: Assessment, budget: Budget) -> dict[str, float] | None:
    """Wall-clock hours, GPU-hours and cost of training ``budget.tokens`` tokens with ``a`` (None without tokens)."""
    if budget.tokens is None:
        return None
    gpus = plan.workload.world_size
    hours = budget.tokens / (a.time.tokens_per_s * gpus) / 3600
    out = {"hours": hours, "gpu_hours": hours * gpus}
    if budget.price_per_gpu_hour is not None:
        out["cost"] = out["gpu_hours"] * budget.price_per_gpu_hour
    return out


def _time_line(plan: Plan, a: Assessment, budget: Budget) -> str:
    t = a.time
    line = (f"{t.step_s:.3g} s/step, {t.tokens_per_s:,.0f} tokens/s per GPU, MFU {t.mfu:.0%}, "
            f"checkpoint save {t.save_s:.0f} s")
    run = run_time(plan, a, budget)
    if run is not None:
        line += f"; {budget.tokens:,.0f} tokens: {run['hours']:,.1f} h wall-clock, {run['gpu_hours']:,.0f} GPU-hours"
        line += f", cost {run['cost']:,.0f}" if "cost" in run else ""
    return line


def _workload_line(plan: Plan) -> str:
    w = plan.workload
    s = w.shapes
    tuning = f"LoRA r={w.lora_r} ({w.trainable_params:,} trainable)" if w.lora_r else "full fine-tune"
    tuning = f"QLoRA (4-bit base), {tuning}" if w.load_in_4bit else tuning
    return (
        f"{s.name}: {s.total_params:,} parameters ({s.model_type}, {s.num_layers} x {s.decoder_layer_class}), "
        f"{tuning}, {w.optimizer}, precision {w.precision}, micro-batch {w.micro_batch_size} x {w.seq_len} tokens\n"
        f"hardware: {w.num_machines} machine(s) x {w.gpus_per_machine} GPU(s) x {gib(plan.gpu_memory)}"
        + (f", {gib(plan.cpu_memory)} CPU RAM per machine" if plan.cpu_memory is not None else ", CPU RAM not checked")
        + f"; usable per GPU {gib(plan.gpu_budget)} ({plan.safety_margin:.0%} safety margin)"
    )


def format_plan_table(plan: Plan, budget: Budget = Budget()) -> str:
    """The human-readable plan: one row per candidate (fastest first), then the verdict."""
    header = ("candidate", "AC", *CATEGORIES, "GPU total", "CPU/machine", "step s", "tok/s/GPU", "MFU", "bound",
              "fits")
    rows = [header]
    for a in plan.assessments:
        e = a.estimate
        mark = "<- best" if a is plan.recommended else ("yes" if a.fits else "no")
        rows.append(
            (
                a.candidate.label,
                "on" if a.candidate.activation_checkpointing else "off",
                *(_fmt(v) for v in e.breakdown().values()),
                _fmt(e.gpu_total),
                _fmt(e.cpu_per_machine) if e.cpu_per_machine else "-",
                f"{a.time.step_s:.3g}",
                f"{a.time.tokens_per_s:,.0f}",
                f"{a.time.mfu:.0%}",
                a.time.dominant,
                mark,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [_workload_line(plan), "memory per GPU in GiB; predicted time of one step (one micro-batch per GPU) on "
             f"{plan.hardware.label if plan.hardware else '?'}{_calibrated(plan)}; bound: its largest term", ""]
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:-2], widths[2:-2], strict=True)]
        lines.append("  ".join(cells + [row[-2].ljust(widths[-2]), row[-1]]).rstrip())
    lines.append("")
    padded = padding_line(plan)
    lines += [padded, ""] if padded else []
    lines += verdict_lines(plan, budget)
    return "\n".join(lines) + "\n"


def padding_line(plan: Plan) -> str | None:
    """Which CP rows are planned at a longer length than --seq-len, and why (None when none is)."""
    w = plan.workload
    padded = sorted({(a.candidate.cp, w.cp_seq_len(a.candidate.cp)) for a in plan.assessments
                     if w.cp_seq_len(a.candidate.cp) != w.seq_len})
    if not padded:
        return None
    rows = ", ".join(f"CP={cp} at {length}" for cp, length in padded)
    return (f"CP rows are planned at the length train.py pads {w.seq_len} tokens to (a multiple of 2 x cp, the chunks "
            f"of ring attention): {rows} tokens")


def plan_warnings(plan: Plan) -> list[str]:
    """What the plan assumes that the run may not do as planned, one line each."""
    w, limit = plan.workload, plan.workload.shapes.max_position_embeddings
    warnings = []
    if limit is not None and w.seq_len > limit:
        warnings.append(
            f"--seq-len {w.seq_len} is beyond the model's max_position_embeddings {limit}: it was not trained on "
            "sequences that long; extend its RoPE first (rope_scaling, and max_position_embeddings, in its "
            f"config.json), or train.py refuses --max_seq_length {w.seq_len}")
    if w.shapes.is_moe and w.lora_r:
        warnings.append(f"a mixture-of-experts model ({w.shapes.num_experts} experts per layer) with LoRA: expert "
                        "parallelism is not planned (train.py refuses --lora_r with parallelism.ep > 1: peft's "
                        "adapters on expert-parallel weights are not proven); the experts are sharded like the rest")
    return warnings


def expert_lines(plan: Plan) -> list[str]:
    """For a mixture-of-experts model: its active share (what tokens/s and MFU count) and why the recommended ep (or
    none) beats the others that fit: the experts a layer gathers, the all-to-all it pays, the predicted throughput."""
    w = plan.workload
    s = w.shapes
    if not s.is_moe:
        return []
    lines = [f"mixture of experts: {s.num_experts} routed experts per layer, {s.experts_per_token} per token: "
             f"{s.active_params:,} of {s.total_params:,} parameters active (FLOPs, tokens/s and MFU count these)"]
    best = plan.recommended
    if best is None or w.lora_r:
        return lines
    from hf_scale.planner.time_model import all_to_all_s

    tokens = w.micro_batch_size * w.seq_len
    peers = [a for a in plan.assessments if a.fits and a is not best and a.candidate.cp == 1 and a.candidate.tp == 1
             and a.candidate.engine == "fsdp" and not a.candidate.hybrid
             and a.candidate.offload_params == best.candidate.offload_params
             and a.candidate.activation_checkpointing == best.candidate.activation_checkpointing]
    others = "; ".join(f"ep={a.candidate.ep}: {a.time.tokens_per_s:,.0f} tokens/s, buffers "
                       f"{gib(a.estimate.buffers)}" for a in sorted(peers, key=lambda a: -a.candidate.ep))
    ep = best.candidate.ep
    if ep > 1:
        a2a = all_to_all_s(w, best.candidate, plan.hardware, tokens) if plan.hardware else 0.0
        rows = tokens * s.experts_per_token // s.num_experts
        lines.append(f"  why ep={ep}: each expert's GEMM gets the tokens routed to it from {ep} GPUs "
                     f"({rows * ep:,} rows instead of {rows:,}), each GPU gathers 1/{ep} of a layer's experts (buffers "
                     f"{gib(best.estimate.buffers)}) and FSDP moves 1/{ep} of the expert weights per micro-batch, for "
                     f"{a2a:.3g} s of all-to-all per micro-batch (it grows with ep); {best.time.tokens_per_s:,.0f} "
                     f"tokens/s per GPU" + (f" (the same layout at other ep: {others})" if others else ""))
        tied = [a.candidate.ep for a in peers if a.candidate.ep > ep and a.time.tokens_per_s > best.time.tokens_per_s]
        if tied:
            lines.append(f"  ep={', '.join(map(str, tied))} predicts within {TIE:.0%} (a tie): the smaller ep, with "
                         "fewer all-to-all peers, is recommended")
        return lines
    fitting = [a for a in plan.assessments if a.candidate.ep > 1 and a.fits]
    if fitting:
        why = (f"the fastest FSDP2 x EP that fits, {fitting[0].candidate.label}"
               f"{' + AC' if fitting[0].candidate.activation_checkpointing else ''}, predicts "
               f"{fitting[0].time.tokens_per_s:,.0f} tokens/s per GPU ({fitting[0].time.dominant}-bound)")
    else:
        smallest = min((a for a in plan.assessments if a.candidate.ep > 1), key=lambda a: a.estimate.gpu_total,
                       default=None)
        why = ("no ep divides the experts inside one machine" if smallest is None else
               f"no FSDP2 x EP fits (the smallest, {smallest.candidate.label}: {smallest.reason})")
    lines.append(f"  no ep: {best.candidate.label} predicts {best.time.tokens_per_s:,.0f} tokens/s per GPU; {why}")
    return lines


def verdict_lines(plan: Plan, budget: Budget = Budget()) -> list[str]:
    """The recommendation with its predicted time, why each faster candidate was rejected, and what makes the next
    slower ones that fit slower."""
    lines = [f"QLoRA: {plan.qlora_because}"] if plan.qlora_because else []
    if plan.recommended is None:
        lines.append("no candidate fits; every one was rejected:")
    else:
        best = plan.recommended
        ac = " with activation checkpointing" if best.candidate.activation_checkpointing else ""
        w = plan.workload
        padded = w.cp_seq_len(best.candidate.cp)
        padding = f" (sequences padded to {padded} tokens for CP)" if padded != w.seq_len else ""
        lines.append(
            f"recommended: {best.candidate.label}{ac} ({best.slug}): {gib(best.estimate.gpu_total)} per GPU "
            f"of {gib(plan.gpu_budget)} usable{padding}"
        )
        lines.append(f"  predicted: {_time_line(plan, best, budget)}")
        lines += expert_lines(plan)
        if plan.rejected_faster:
            lines.append("faster candidates rejected:")
    for a in plan.rejected_faster:
        ac = " + AC" if a.candidate.activation_checkpointing else ""
        lines.append(f"  {a.candidate.label}{ac}: {a.reason}")
    slower = [a for a in plan.assessments[plan.assessments.index(plan.recommended) + 1:] if a.fits][:3] \
        if plan.recommended is not None else []
    if slower:
        lines.append("slower candidates that fit (what their step spends most on):")
    for a in slower:
        ac = " + AC" if a.candidate.activation_checkpointing else ""
        t = a.time
        lines.append(f"  {a.candidate.label}{ac}: {t.tokens_per_s:,.0f} tokens/s per GPU, {t.dominant} "
                     f"(compute {t.compute_s:.3g} s, communication {t.communication_s:.3g} s, optimizer "
                     f"{t.optimizer_s:.3g} s, offload {t.offload_s:.3g} s)")
    if plan.recommended is None:
        lines.append(
            "try more GPUs or machines, a shorter --seq-len, or --cpu-memory if the "
            "machines have more RAM"
        )
    else:
        lines.append(f"pass to train.py (no config field holds them): {' '.join(train_argv(plan))}")
    return lines


def time_dict(plan: Plan, a: Assessment, budget: Budget) -> dict[str, Any]:
    """A candidate's predicted time as JSON: seconds by term, throughput, MFU, the run's hours when --tokens."""
    t = a.time
    out: dict[str, Any] = {
        "step_s": t.step_s, "compute_s": t.compute_s, "communication_s": t.communication_s,
        "optimizer_s": t.optimizer_s, "offload_s": t.offload_s, "save_s": t.save_s, "bound": t.dominant,
        "tokens_per_s_per_gpu": t.tokens_per_s, "mfu": t.mfu,
    }
    run = run_time(plan, a, budget)
    return out | ({"run": run} if run is not None else {})


def _calibrated(plan: Plan) -> str:
    k = plan.hardware.step_correction if plan.hardware else 1.0
    return "" if k == 1.0 else f" (calibrated: x {k:.3f})"


def _sizes(layout) -> dict[str, int]:
    """The layout's mesh sizes, and ep when the experts are split."""
    return layout.sizes() | ({"ep": layout.ep} if layout.ep > 1 else {})


def plan_dict(plan: Plan, budget: Budget = Budget()) -> dict[str, Any]:
    """JSON-ready plan: inputs, model, every candidate with its byte breakdown and time, the recommendation."""
    w, s = plan.workload, plan.workload.shapes
    candidates = []
    for a in plan.assessments:
        e, c = a.estimate, a.candidate
        candidates.append(
            {
                "key": a.slug,
                "label": c.label,
                "activation_checkpointing": c.activation_checkpointing,
                "parallelism": _sizes(distributed_config(plan, a).layout),
                "seq_len": w.cp_seq_len(c.cp),
                "bytes_per_gpu": {**e.breakdown(), "total": e.gpu_total},
                "cpu_bytes_per_machine": e.cpu_per_machine,
                "time": time_dict(plan, a, budget),
                "fits": a.fits,
                "rejected_because": a.reason or None,
            }
        )
    best = plan.recommended
    return {
        "model": {
            "name": s.name,
            "model_type": s.model_type,
            "parameters": s.total_params,
            "trainable_parameters": w.trainable_params,
            "largest_layer_parameters": s.largest_layer_params,
            "decoder_layer_class": s.decoder_layer_class,
            "num_layers": s.num_layers,
        },
        "workload": {
            "num_machines": w.num_machines,
            "gpus_per_machine": w.gpus_per_machine,
            "gpu": plan.hardware.name if plan.hardware else None,
            "gpu_memory_bytes": plan.gpu_memory,
            "tokens": budget.tokens,
            "price_per_gpu_hour": budget.price_per_gpu_hour,
            "cpu_memory_bytes": plan.cpu_memory,
            "safety_margin": plan.safety_margin,
            "seq_len": w.seq_len,
            "micro_batch_size": w.micro_batch_size,
            "precision": w.precision,
            "optimizer": w.optimizer,
            "lora_r": w.lora_r,
            "load_in_4bit": w.load_in_4bit,
        },
        "qlora_because": plan.qlora_because,
        "train_flags": train_flags(plan),
        "candidates": candidates,
        "recommended": best.slug if best else None,
        "recommended_config": distributed_config(plan, best).model_dump(mode="json") if best else None,
        "verdict": verdict_lines(plan, budget),
        "warnings": plan_warnings(plan),
    }


def write_plot(plan: Plan, path: Path) -> None:
    """Stacked bar per candidate (GiB per GPU by category) against the GPU memory and usable lines."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'hf-scale[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    fig = plan_figure(plan)
    try:
        save_figure_atomically(fig, path, dpi=110, format="png")
    finally:
        plt.close(fig)


PLOT_HEADROOM = 1.6
"""The chart's height in GPU memories: candidates that need more are cut at the top edge, labelled."""


def clipped_bars(plan: Plan) -> list[tuple[int, str]]:
    """(bar index, label) of the candidates taller than the chart: their total, written at the top edge."""
    top = plan.gpu_memory * PLOT_HEADROOM
    return [(i, f"{a.estimate.gpu_total / _GIB:.1f} GiB \u2191") for i, a in enumerate(plan.assessments)
            if a.estimate.gpu_total > top]


def plan_figure(plan: Plan):
    """The chart of :func:`write_plot` as a matplotlib Figure (the caller closes it)."""
    import matplotlib.pyplot as plt

    labels = [a.candidate.label + (" +AC" if a.candidate.activation_checkpointing else "") for a in plan.assessments]
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(labels)), 5.5), layout="constrained")
    bottoms = [0.0] * len(labels)
    for category in CATEGORIES:
        values = [a.estimate.breakdown()[category] / _GIB for a in plan.assessments]
        ax.bar(labels, values, bottom=bottoms, label=category)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.axhline(plan.gpu_memory / _GIB, color="black", linewidth=1.5, label=f"GPU memory {gib(plan.gpu_memory)}")
    ax.axhline(plan.gpu_budget / _GIB, color="black", linestyle="--", linewidth=1, label="usable (safety margin)")
    if plan.recommended is not None:
        index = plan.assessments.index(plan.recommended)
        ax.annotate("recommended", (index, bottoms[index]), ha="center", va="bottom", fontsize=9, weight="bold")
    top = max(plan.gpu_memory / _GIB * PLOT_HEADROOM, 1e-9)
    ax.set_ylim(0, top)
    for index, text in clipped_bars(plan):
        ax.annotate(text, (index, top), xytext=(0, -3), textcoords="offset points", rotation=90, ha="center",
                    va="top", fontsize=8, weight="bold",
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    ax.set_ylabel("GiB per GPU")
    s, w = plan.workload.shapes, plan.workload
    ax.set_title(
        f"{s.name} on {w.num_machines}x{w.gpus_per_machine} GPUs, {w.micro_batch_size}x{w.seq_len} tokens, "
        f"{w.precision}"
    )
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right", rotation_mode="anchor")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
