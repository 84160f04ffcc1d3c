"""The entry script the Kubernetes and SkyPilot targets share (hf_scale.clusters): ``launch/NAME.node.sh``, one
Kubernetes pod or SkyPilot node.

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
    _env_default,
    _generated,
    _preamble,
    restart_loop_args,
)


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
