"""Optional torch.profiler over a few optimizer steps of train.py, for either loop.

``HF_SCALE_PROFILE=DIR python train.py …`` profiles the main process: it skips the first
``HF_SCALE_PROFILE_WAIT`` optimizer steps (default 5: compilation, allocator warm-up), warms up one more,
records ``HF_SCALE_PROFILE_STEPS`` (default 3), and at the end of training writes ``DIR/top_kernels.txt``
(``key_averages()`` sorted by self device time on GPU, self CPU time otherwise) and a Chrome trace
``DIR/trace.json`` (open it in https://ui.perfetto.dev). ``benchmarks/gpu.py --profile`` uses it for the
fastest variant. Steps are counted by hf_scale.train.loops.metrics.StepMetrics, which both loops feed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ENV_DIR, ENV_WAIT, ENV_STEPS = "HF_SCALE_PROFILE", "HF_SCALE_PROFILE_WAIT", "HF_SCALE_PROFILE_STEPS"
TOP_KERNELS = "top_kernels.txt"


class StepProfiler:
    def __init__(self, directory: Path, *, wait: int, active: int):
        self.directory = directory
        self.cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1),
        )
        self._profiler.start()

    def step(self) -> None:
        self._profiler.step()

    def finish(self) -> Path | None:
        """Stop and write the table and the trace; None when training ended before the recorded steps."""
        self._profiler.stop()
        try:
            events = self._profiler.key_averages()
        except (AssertionError, RuntimeError):  # nothing was recorded
            return None
        if not events:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = self.directory / TOP_KERNELS
        table.write_text(events.table(sort_by=sort_by, row_limit=30) + "\n")
        self._profiler.export_chrome_trace(str(self.directory / "trace.json"))
        return table


def from_env(is_main: bool) -> StepProfiler | None:
    directory = os.environ.get(ENV_DIR)
    if not directory or not is_main:
        return None
    return StepProfiler(
        Path(directory), wait=int(os.environ.get(ENV_WAIT, "5")), active=int(os.environ.get(ENV_STEPS, "3"))
    )
