"""What hf_scale knows about the libraries it drives (accelerate, DeepSpeed, transformers, torch): pure rules and
tables, one home per fact, read by the config, the generators, the checks, the planner and the runtime."""
