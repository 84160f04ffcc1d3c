"""Per-step training metrics: `OUTPUT_DIR/metrics.jsonl`, the progress bar and the end-of-run summary.

Both loops feed :class:`StepMetrics` with already globally-reduced values; only the main process
writes. Evaluations (hf_scale.train.loops.evaluation) add records with `eval_loss` and `eval_perplexity` in
place of `loss`. MFU uses the usual dense-transformer count (6·N + 12·L·H·T FLOPs per token: N parameters taking
part in matmuls — all but an untied input embedding, which is a lookup —, L layers, H hidden size, T the
mean example length, over which each token attends) and is reported only when the device's peak FLOP/s
is known.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_scale.knowledge.partitioned import full_numel
from hf_scale.train.data.packing import REAL_TOKEN_MASK
from hf_scale.train.loops import torch_profiler

# Dense bf16/fp16 tensor-core peaks (no sparsity), by substring of torch.cuda.get_device_name().
_PEAK_FLOPS_BY_DEVICE = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_FLOPS_BY_DEVICE.items() if key in name), None)


def matmul_parameters(model) -> int:
    """Parameters used in a matmul for every token (ZeRO-3 partitions counted at their full size)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = sum(full_numel(p) for p in model.parameters())
    embedding = base.get_input_embeddings().weight
    output = base.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    return total if tied else total - full_numel(embedding)


def mean_example_length(dataset, sample: int = 10_000) -> float:
    lengths = [len(ids) for ids in dataset.select(range(min(len(dataset), sample)))["input_ids"]]
    return sum(lengths) / max(1, len(lengths))


def flops_per_token(model_config, num_parameters: int, seq_len: float) -> float:
    layers = getattr(model_config, "num_hidden_layers", 0)
    hidden = getattr(model_config, "hidden_size", 0)
    return 6.0 * num_parameters + 12.0 * layers * hidden * seq_len


def real_tokens(batch) -> torch.Tensor:
    """Non-padding tokens of a micro-batch (a packed batch marks them, see hf_scale.train.data.packing), a 0-dim
    tensor where the batch is, so that counting every micro-batch does not wait for the device."""
    if REAL_TOKEN_MASK in batch:
        return batch[REAL_TOKEN_MASK].sum()
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)


def count_real_tokens(batch) -> int:
    """:func:`real_tokens` as a Python int."""
    return int(real_tokens(batch))


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far; growth after the first step is a
    recompilation (a new shape or a failed guard), which metrics.jsonl makes visible."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def peak_memory_bytes() -> int:
    """Peak accelerator memory of this process; peak resident memory on CPU-only runs."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # Linux reports KiB


def continue_metrics_file(path: Path, first_step: int):
    """metrics.jsonl opened for the steps after `first_step`: a fresh run (0) starts it anew; a run resumed
    from checkpoint-K keeps the history up to step K and drops the lines a crashed run wrote after its last
    checkpoint (steps > K, and a line cut short by the crash), so every step appears once."""
    if not first_step or not path.is_file():
        return path.open("w")
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and step <= first_step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    return path.open("a")


class StepMetrics:
    """Writes one JSON object per optimizer step and drives the progress bar (main process only)."""

    def __init__(
        self,
        output_dir: str,
        *,
        is_main: bool,
        total_steps: int,
        world_size: int,
        flops_per_token: float | None,
        progress_bar: bool = True,
        first_step: int = 0,
        track_compilations: bool = False,
    ):
        self.is_main = is_main
        self.total_steps = total_steps
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.track_compilations = track_compilations
        self.peak_flops = device_peak_flops()
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._file = None
        self._bar = None
        self._profiler = torch_profiler.from_env(is_main)  # HF_SCALE_PROFILE=DIR: a few steps under torch.profiler
        self._start = time.perf_counter()
        self._last = self._start
        self._last_cpu = time.process_time()
        if is_main:
            path = Path(output_dir)
            path.mkdir(parents=True, exist_ok=True)
            self._file = continue_metrics_file(path / "metrics.jsonl", first_step)
            if progress_bar:
                self._bar = tqdm(total=total_steps, initial=first_step, desc="training", unit="step",
                                 dynamic_ncols=True)

    def log_step(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        tokens: int,
        epoch: float,
        data_wait_s: float | None = None,
        aux_loss: float | None = None,
    ) -> dict:
        now, cpu_now = time.perf_counter(), time.process_time()
        elapsed = max(now - self._last, 1e-9)
        # CPU seconds of this process (all its threads) in the step: unlike step_time_s, hardly changed by other
        # jobs on the machine, so benchmarks/overhead.py can compare loops on a shared CPU.
        cpu_s = cpu_now - self._last_cpu
        self._last, self._last_cpu = now, cpu_now
        record = {
            "step": step,
            "epoch": round(epoch, 4),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_sec": tokens / elapsed,
            "step_time_s": elapsed,
            "step_cpu_s": cpu_s,
            "peak_memory_bytes": peak_memory_bytes(),
        }
        if data_wait_s is not None:
            record["data_wait_s"] = data_wait_s
        if aux_loss is not None:  # an MoE router's load-balancing loss, mean over the step's micro-batches
            record["aux_loss"] = aux_loss
        if self.track_compilations:
            record["compilations"] = compiled_graphs()
        if self.peak_flops and self.flops_per_token:
            achieved = record["tokens_per_sec"] * self.flops_per_token
            record["mfu"] = achieved / (self.peak_flops * self.world_size)
        self.history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._profiler is not None:
            self._profiler.step()
        if self._bar is not None:
            # The postfix waits for update's refresh, which tqdm rate-limits (mininterval); set_postfix's own
            # refresh would redraw the bar at every step (profiled: the largest per-step cost of this method).
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            self._bar.update(1)
            if step >= self.total_steps:
                # Finished: closed before the final save, whose own bars would otherwise print below it and
                # the finished bar once more after them.
                self._bar.close()
        return record

    def log_eval(self, *, step: int, epoch: float, result) -> dict:
        """One eval record (an `hf_scale.train.loops.evaluation.EvalResult`) in metrics.jsonl, told apart from the
        step records by `eval_loss` in place of `loss`."""
        record = {"step": step, "epoch": round(epoch, 4), **result.metrics("eval")}
        self.eval_history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._bar is not None:
            perplexity = record["eval_perplexity"]
            self._bar.write(f"step {step}: eval_loss {result.loss:.4f}, eval_perplexity "
                            + (f"{perplexity:.4g}" if perplexity is not None else "overflow"))
        return record

    @property
    def last_eval_step(self) -> int | None:
        return self.eval_history[-1]["step"] if self.eval_history else None

    def summary(self) -> dict:
        elapsed = time.perf_counter() - self._start
        tokens = sum(r["tokens"] for r in self.history)
        summary = {
            "steps": len(self.history),
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "tokens": tokens,
            "tokens_per_sec": tokens / elapsed if elapsed > 0 else 0.0,
            "peak_memory_bytes": peak_memory_bytes(),
            "train_time_s": elapsed,
        }
        if self.eval_history:
            summary["eval_loss"] = self.eval_history[-1]["eval_loss"]
            summary["eval_perplexity"] = self.eval_history[-1]["eval_perplexity"]
        if self.peak_flops and self.flops_per_token:
            summary["mfu"] = (
                summary["tokens_per_sec"] * self.flops_per_token / (self.peak_flops * self.world_size)
            )
        return summary

    def close(self) -> None:
        if self._profiler is not None:
            table = self._profiler.finish()
            self._profiler = None
            print(f"hf_scale: profile: {table or 'training ended before the profiled steps'}", file=sys.stderr)
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
