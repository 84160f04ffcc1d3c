"""`hf_scale_configs/NAME.yaml`: the DistributedConfig itself, resolved (every field written out, the batch
triple worked out), for train.py's `--hf_scale_config`.

The accelerate YAML and an "auto" DeepSpeed JSON cannot carry the batch, clipping, optimizer values and
activation checkpointing (the HF Trainer fills "auto" from train.py's flags, and accelerate's YAML has no
such keys for DDP), so the launch scripts hand train.py this file and train.py takes those values from it,
refusing any flag that contradicts it (hf_scale.train.setup.reconcile).
"""

from __future__ import annotations

import yaml

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.config.parallelism import ParallelismSettings


def resolved_config(cfg: DistributedConfig) -> dict:
    """Every field, in the schema's order; `load_config` on it gives `cfg` back. The parallelism section only
    when it says something: its left-out sizes are derived from the topology (`DistributedConfig.layout`), so a
    file without TP/CP/SP stays valid when the topology is overridden. The `cluster` section only when it differs
    from its defaults (train.py does not read it; configs without cluster targets stay as they were)."""
    data = cfg.model_dump(mode="json")
    if cfg.parallelism == ParallelismSettings():
        del data["parallelism"]
    if cfg.cluster == type(cfg.cluster)():
        del data["cluster"]
    return data


def resolved_config_yaml(cfg: DistributedConfig, *, header: str) -> str:
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.safe_dump(resolved_config(cfg), sort_keys=False, default_flow_style=False)
