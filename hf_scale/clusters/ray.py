"""The ``ray`` target: ``launch/NAME.ray.sh``, the Ray Train driver (``python -m hf_scale.commands.ray_train``, a
TorchTrainer running train.py's own train function on every worker)."""

from __future__ import annotations

from hf_scale.clusters.target import ClusterTarget
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths
from hf_scale.generators.launch import _check_name, _comment, _generated, q

NAME = "ray"


def ray_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``launch/NAME.ray.sh``: ``python -m hf_scale.commands.ray_train`` with this config (workers = world size) and the
    config's restart budget; run it where the Ray driver runs (the head node, or `ray job submit`)."""
    _check_name(name)
    return (
        "#!/usr/bin/env bash\n"
        + _comment(header)
        + f"""set -euo pipefail
# Ray Train: {cfg.world_size} workers (one per process of hf_scale_configs/{name}.yaml), each running train.py's own
# train function; a lost worker restarts the group (at most cluster.max_restarts={cfg.cluster.max_restarts} times),
# which resumes from the newest complete checkpoint in --output_dir (storage every Ray node sees).
# A stop must finish the step in progress and write a checkpoint: a preempted node's group may keep running
# {cfg.cluster.preempt_signal_lead_s} s past the node's drain deadline (FailureConfig.preemption_grace_s from
# cluster.preempt_signal_lead_s, a step plus a save predicted by `hf-scale plan`); the drain window itself is the
# cloud's or the autoscaler's: Ray Train has no setting that lengthens it.
#   bash launch/{name}.ray.sh --output_dir /shared/runs/{name} [train.py flags]
#   ray job submit --working-dir . -- bash launch/{name}.ray.sh --output_dir /shared/runs/{name} [train.py flags]
generated_dir=$(CDPATH='' cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")/.." && pwd)
exec python -m hf_scale.commands.ray_train --hf_scale_config {_generated(output_paths.hf_scale_config(name))} \\
  --max_failures {q(str(cfg.cluster.max_restarts))} \\
  --preemption_grace_s {q(str(cfg.cluster.preempt_signal_lead_s))} "$@"
"""
    )


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """``launch/NAME.ray.sh``."""
    return {output_paths.launch_file(f"{name}.ray.sh"): ray_script(cfg, name, header=header)}


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.ray.sh",
    summary="python -m hf_scale.commands.ray_train (Ray Train TorchTrainer)",
    files=files,
    doc_anchor="ray-train",
)
