"""Entry scripts of the cluster targets: ``launch/NAME.node.sh`` (one Kubernetes pod / SkyPilot node) and
``launch/NAME.ray.sh`` (the Ray Train driver).

``NAME.node.sh`` is the container command of the TrainJob and PyTorchJob manifests and the ``run`` of the SkyPilot
task. Each platform tells a node who it is in its own variables; the script maps them onto the variables of
``NAME.accelerate.sh`` (MACHINE_RANK, MAIN_PROCESS_IP, MAIN_PROCESS_PORT), refuses a node count or processes per
node that disagree with the config (exit 2, one line), asks train.py to resume ``auto`` unless its flags name a
checkpoint (RESUME_DEFAULT_ENV) and then *becomes*
``NAME.accelerate.sh`` (exec): SIGTERM from the kubelet or the cloud reaches that script's handler, the training
saves a checkpoint and the pod exits 75; the restarted pod resumes from the volume.

==========================  ==================================================================================
platform                    variables (what each sets, per node)
==========================  ==================================================================================
Kubeflow Trainer TrainJob   PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
PyTorchJob (operator 1.7+)  the same PET_* (plus pod-level MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
PyTorchJob (older)          MASTER_ADDR, MASTER_PORT, RANK (the pod's rank), WORLD_SIZE (pods)
SkyPilot                    SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (rank 0 first),
                            SKYPILOT_NUM_GPUS_PER_NODE
==========================  ==================================================================================
"""

from __future__ import annotations

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.exit_codes import RESUME_DEFAULT_ENV
from hf_scale.generators import output_paths
from hf_scale.generators.launch import (
    _check_name,
    _comment,
    _env_default,
    _generated,
    _preamble,
    q,
    restart_loop_args,
)

NODE_VARIABLES = {
    "kubeflow": ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
    "pytorchjob-legacy": ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"),
    "skypilot": ("SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE"),
}
"""The variables each platform sets on a node that NAME.node.sh reads (the table above)."""


def node_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``launch/NAME.node.sh``: one node of the run on Kubernetes or SkyPilot (see the module docstring)."""
    _check_name(name)
    topo = cfg.topology
    nodes, procs = topo.num_machines, topo.processes_per_machine
    restart_loop, restart_note = restart_loop_args(cfg)
    body = f"""
# One node (a Kubernetes pod, a SkyPilot node) of {nodes} x {procs} processes: the platform's variables become
# launch/{name}.accelerate.sh's, which this script then becomes (exec), so SIGTERM reaches its handler: the
# training saves a checkpoint and the node exits 75; the restarted node resumes from the newest complete one.
fail() {{
  echo "hf-scale: error: $*" >&2
  exit 2
}}
if [ -n "${{SKYPILOT_NODE_RANK:-}}" ]; then
  platform=SkyPilot
  nodes=${{SKYPILOT_NUM_NODES:-}}
  node_procs=${{SKYPILOT_NUM_GPUS_PER_NODE:-}}
  rank=$SKYPILOT_NODE_RANK
  master=$(printf '%s\\n' "${{SKYPILOT_NODE_IPS:-}}" | awk 'NR == 1')
  port=""
elif [ -n "${{PET_NODE_RANK:-}}" ]; then
  platform="Kubeflow (PET_* variables)"
  nodes=${{PET_NNODES:-}}
  node_procs=${{PET_NPROC_PER_NODE:-}}
  rank=$PET_NODE_RANK
  master=${{PET_MASTER_ADDR:-}}
  port=${{PET_MASTER_PORT:-}}
elif [ -n "${{RANK:-}}" ] && [ -n "${{MASTER_ADDR:-}}" ]; then
  # Training Operators before 1.7: RANK is this pod's rank, WORLD_SIZE the number of pods.
  platform="PyTorchJob (RANK/WORLD_SIZE per pod)"
  nodes=${{WORLD_SIZE:-}}
  node_procs=""
  rank=$RANK
  master=$MASTER_ADDR
  port=${{MASTER_PORT:-}}
else
  fail "no node variables found (PET_NODE_RANK from Kubeflow, SKYPILOT_NODE_RANK from SkyPilot, RANK and" \\
    "MASTER_ADDR from a PyTorchJob); on one machine run launch/{name}.accelerate.sh instead"
fi
if [ "$nodes" != {nodes} ]; then
  fail "$platform runs ${{nodes:-?}} node(s) but hf_scale_configs/{name}.yaml has topology.num_machines={nodes};" \\
    "regenerate the manifest or fix the job's node count"
fi
case "$node_procs" in
  "" | auto | gpu | {procs}) ;;
  *) fail "$platform starts $node_procs process(es)/GPU(s) per node but hf_scale_configs/{name}.yaml has" \\
    "topology.processes_per_machine={procs}" ;;
esac
case "$rank" in
  '' | *[!0-9]*) fail "$platform gave this node the rank '$rank': expected 0..{nodes - 1}" ;;
esac
if [ "$rank" -ge {nodes} ]; then
  fail "$platform gave this node the rank $rank: expected 0..{nodes - 1}"
fi
{_env_default("default_port", "MAIN_PROCESS_PORT", topo.main_process_port)}\
export MACHINE_RANK="$rank" MAIN_PROCESS_IP="${{master:-127.0.0.1}}" MAIN_PROCESS_PORT="${{port:-$default_port}}"
# The pod-level RANK/WORLD_SIZE and the PET_* defaults would mislead the launcher's own processes: accelerate
# launch sets every process's RANK, LOCAL_RANK and WORLD_SIZE itself.
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT PET_NNODES PET_NPROC_PER_NODE PET_NODE_RANK \\
  PET_MASTER_ADDR PET_MASTER_PORT
# A restarted node continues from the newest complete checkpoint in --output_dir (a fresh start when there is
# none), unless train.py's flags name one, in any spelling: train.py decides, having read them.{restart_note}
export {RESUME_DEFAULT_ENV}=auto
exec bash {_generated(output_paths.launch_file(f"{name}.accelerate.sh"))} {restart_loop}"$@"
"""
    return _preamble(header, name) + body


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
