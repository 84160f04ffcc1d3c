"""The two training loops (the HF Trainer, the manual Accelerator loop) and what both feed: per-step metrics,
evaluation, the divergence stop, the profiler, the live read-back of the first step."""
