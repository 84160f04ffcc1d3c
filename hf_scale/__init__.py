"""hf_scale: one typed config for multi-GPU / multi-node fine-tuning of Llama-style models."""

__version__ = "0.1.0"
