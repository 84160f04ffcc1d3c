"""The ``slurm`` target: ``launch/NAME.sbatch``, a SLURM batch script, one task per node, each running
``NAME.accelerate.sh``; USR1 before the time limit, requeue on exit 75. Every `hf-scale generate` writes it (no
--targets needed: it needs nothing beyond the config)."""

from __future__ import annotations

from hf_scale.clusters.target import NODES, PER_NODE, ClusterTarget
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.exit_codes import EXIT_BAD_INPUT, EXIT_PREEMPTED, RESUME_DEFAULT_ENV
from hf_scale.generators import output_paths
from hf_scale.generators.launch import _check_name, _comment, _env_default, q, restart_loop_args

NAME = "slurm"


def sbatch_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """SLURM batch script: one task per node running ``launch/NAME.accelerate.sh``; rank from
    ``$SLURM_NODEID``, rank-0 address = first host of the allocation; requeues on exit 75."""
    _check_name(name)
    topo = cfg.topology
    directives = [
        f"--job-name=hf-scale-{name}",
        f"--nodes={topo.num_machines}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={topo.processes_per_machine}",
        f"--signal=USR1@{cfg.cluster.preempt_signal_lead_s}",
        "--requeue",
        "--open-mode=append",
        "--output=%x-%j.out",
    ]
    port = _env_default("main_process_port", "MAIN_PROCESS_PORT", topo.main_process_port)
    restart_loop, restart_note = restart_loop_args(cfg)
    return (
        "#!/usr/bin/env bash\n"
        + "".join(f"#SBATCH {directive}\n" for directive in directives)
        + _comment(header)
        + f"""# Submit from any directory:
#   sbatch [SBATCH OPTIONS] path/to/launch/{name}.sbatch [TRAINING ARGS...]
# The job runs in the directory it was submitted from (relative paths among the training arguments mean
# what they mean there); each node runs launch/{name}.accelerate.sh, found next to this file.
#
# --signal=USR1@{cfg.cluster.preempt_signal_lead_s} (not B:USR1): without "B:" SLURM sends the signal to every
# process of the job steps, i.e. to the training processes that srun started, {cfg.cluster.preempt_signal_lead_s} s
# before the time limit (cluster.preempt_signal_lead_s: a step plus a save, predicted by
# `generate --strategy auto`); "B:" would signal only this batch shell, which cannot forward it into
# srun's tasks in time. The training saves a checkpoint and exits {EXIT_PREEMPTED}; then this script
# requeues the job, which resumes from that checkpoint.
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-.}}"

if [ "${{SLURM_JOB_NUM_NODES:-{topo.num_machines}}}" -ne {topo.num_machines} ]; then
  echo "hf-scale: error: accelerate_configs/{name}.yaml expects {topo.num_machines} nodes," \\
    "the allocation has $SLURM_JOB_NUM_NODES" >&2
  exit 2
fi
# The folder of this file. sbatch runs a copy of it from a spool directory, so the submitted file's place
# comes from SLURM (`scontrol show job`: Command=, the script's path followed by its arguments, if any);
# run with bash, it is this file's own folder; last, launch/ under the submit directory.
accelerate_script={q(f"{name}.accelerate.sh")}
submitted=""
if [ -n "${{SLURM_JOB_ID:-}}" ]; then
  submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null \\
    | awk '{{ if (sub(/^[[:space:]]*Command=/, "")) {{ sub(/\\.sbatch[[:space:]].*$/, ".sbatch"); print }} }}' || true)
fi
launch_dir=""
for candidate in "$(dirname -- "${{BASH_SOURCE[0]}}")" "$(dirname -- "${{submitted:-.}}")" launch; do
  if [ -f "$candidate/$accelerate_script" ]; then
    launch_dir=$candidate
    break
  fi
done
if [ -z "$launch_dir" ]; then
  echo "hf-scale: error: cannot find $accelerate_script next to this script; submit it by its path in" \\
    "the generated launch/ folder: sbatch path/to/launch/{name}.sbatch" >&2
  exit 2
fi
# Rank-0 address: the first host of the allocation; each node's rank is its $SLURM_NODEID.
# (awk reads every line: `head -n 1` would close the pipe early, scontrol would die of SIGPIPE on a long
# host list, and with pipefail the script would stop here.)
MAIN_PROCESS_IP="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')"
export MAIN_PROCESS_IP
{port}export MAIN_PROCESS_PORT="$main_process_port"
unset MACHINE_RANK  # a value exported at submission would give every node the same rank

# Each node runs: accelerate launch --config_file accelerate_configs/{name}.yaml \\
#   --machine_rank $SLURM_NODEID --main_process_ip $MAIN_PROCESS_IP ... \\
#   -m {output_paths.TRAINING_MODULE} --hf_scale_config {output_paths.hf_scale_config(name)} "$@"
# A requeued job continues from the newest complete checkpoint (a fresh start when there is none), unless
# train.py's flags say where to resume from, in any spelling: train.py decides, having read them.{restart_note}
export {RESUME_DEFAULT_ENV}=auto
# Every node refuses the same bad input with the same line: the job's log holds each refusal once. srun's
# stderr passes a filter that prints a repeated "PROG: error: ..." line once and, once a refusal was printed,
# drops srun's "task N: Exited with exit code {EXIT_BAD_INPUT}" lines (the refusal is the reason). The filter
# ignores stop requests (a preemption signals every process of the job): it ends when srun's output does.
once_per_job() {{
  trap '' TERM USR1 INT
  exec awk '
    /^[^ ]+: error: / && !/^srun: / {{ if (seen[$0]++) next; refused = 1 }}
    refused && /^srun: error: .*: Exited with exit code {EXIT_BAD_INPUT}$/ {{ next }}
    {{ print; fflush() }}'
}}
exec 3>&1
# No --kill-on-bad-exit: every node must finish writing its checkpoint shard before the step ends.
status=0
srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash "$launch_dir/$accelerate_script" {restart_loop}"$@" 2>&1 >&3 \
  | once_per_job >&2 || status=${{PIPESTATUS[0]}}
if [ "$status" -eq {EXIT_PREEMPTED} ]; then
  echo "hf-scale: checkpoint saved before the time limit; requeueing job $SLURM_JOB_ID" >&2
  # A controller that does not answer must not turn the preemption's 75 into scontrol's exit code (set -e):
  # the checkpoint is saved either way, and a new submission resumes from it.
  scontrol requeue "$SLURM_JOB_ID" || echo "hf-scale: error: scontrol requeue $SLURM_JOB_ID failed; the checkpoint" \\
    "is saved: submit the job again (sbatch) to resume from it" >&2
fi
exit "$status"
"""
    )


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """``launch/NAME.sbatch``."""
    return {output_paths.launch_file(f"{name}.sbatch"): sbatch_script(cfg, name, header=header)}


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/launch/NAME.sbatch",
    summary="SLURM: one task per node, USR1 before the time limit, requeue",
    files=files,
    doc_anchor="slurm",
    always=True,
    engine="SLURM",
    node_variables=(("SLURM_NNODES", NODES), ("SLURM_JOB_NUM_NODES", NODES), ("SLURM_GPUS_ON_NODE", PER_NODE)),
)
