"""Launch scripts for a generated config: pure functions from config to file text.

All scripts run from the directory that holds ``accelerate_configs/`` (they ``cd`` to the parent of
``launch/``), pass their own arguments through to the training script (``"$@"``) and take the training
script from ``$TRAIN_SCRIPT`` (default ``train.py``). Per-machine values come from environment variables
so one file serves every node; nothing secret is ever written.

* ``NAME.accelerate.sh`` - ``accelerate launch --config_file accelerate_configs/NAME.yaml`` on one machine
  (every strategy; the sbatch script runs it on each node).
* ``NAME.torchrun.sh`` - plain ``torchrun`` (not for FSDP: accelerate's FSDP plugin is configured by the
  YAML that only ``accelerate launch`` reads; under bare torchrun the model would not be sharded).
* ``NAME.deepspeed.sh`` + ``NAME.hostfile`` - the ``deepspeed`` launcher (DeepSpeed strategies).
* ``NAME.sbatch`` - SLURM, one task per node, each running ``NAME.accelerate.sh``.
"""

from __future__ import annotations

from hf_scale.config import DistributedConfig
from hf_scale.train.checkpoint import EXIT_PREEMPTED  # train.py's "checkpoint saved, run me again"

# Seconds before the SLURM time limit at which the training processes are asked to checkpoint and stop.
PREEMPT_SIGNAL_LEAD_S = 120


def _comment(header: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())


def _preamble(header: str) -> str:
    return (
        "#!/usr/bin/env bash\n"
        + _comment(header)
        + "set -euo pipefail\n"
        + "# Paths are relative to the directory holding accelerate_configs/ (the parent of launch/).\n"
        + 'cd "$(dirname "$0")/.."\n'
    )


def _train_command(cfg: DistributedConfig, name: str, *, with_deepspeed_flag: bool) -> str:
    command = '"${TRAIN_SCRIPT:-train.py}"'
    if with_deepspeed_flag and cfg.strategy == "deepspeed":
        command += f" --deepspeed ds_configs/{name}.json"
    return command + ' "$@"'


def accelerate_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``accelerate launch`` on one machine. SIGUSR1 (SLURM ``--signal``, or ``kill -USR1``) asks the
    training to checkpoint and stop; the script then exits 75 so a scheduler can requeue."""
    topo = cfg.topology
    lines = [f"launch=(accelerate launch --config_file accelerate_configs/{name}.yaml)"]
    if topo.num_machines > 1:
        lines.append(
            "# This machine's rank and the rank-0 address: set them per node (the sbatch script does).\n"
            'launch+=(--machine_rank "${MACHINE_RANK:-${SLURM_NODEID:-0}}")\n'
            f'launch+=(--main_process_ip "${{MAIN_PROCESS_IP:-{topo.main_process_ip}}}")'
        )
    if cfg.strategy != "single":
        lines.append(f'launch+=(--main_process_port "${{MAIN_PROCESS_PORT:-{topo.main_process_port}}}")')
    body = "\n".join(lines) + "\n"
    body += f"""
# SIGUSR1 means "save a checkpoint and stop". The launcher must survive it: torchrun (inside accelerate
# launch) handles only TERM/INT/HUP/QUIT and USR1's default action would kill it and orphan the workers.
# So the launcher ignores USR1, its training processes inherit that until train.py installs its handler,
# and this shell remembers that the stop was requested. TERM and INT are passed on to the launcher.
signals=0
trap 'signals=$((signals + 1))' USR1
trap 'kill -TERM "$launcher" 2>/dev/null || true' TERM
trap 'kill -INT "$launcher" 2>/dev/null || true' INT
( trap '' USR1; exec "${{launch[@]}}" {_train_command(cfg, name, with_deepspeed_flag=False)} ) &
launcher=$!
status=0
# A trapped signal interrupts `wait`; keep waiting until the launcher itself has ended.
while :; do
  status=0
  wait "$launcher" || status=$?
  kill -0 "$launcher" 2>/dev/null || break
done
if [ "$status" -ne 0 ] && [ "$signals" -gt 0 ]; then
  # train.py exits {EXIT_PREEMPTED} after checkpointing, but torchrun reports any worker exit != 0 as its own
  # failure (1): after a stop request the non-zero status means "stopped, resume from the checkpoint".
  exit {EXIT_PREEMPTED}
fi
exit "$status"
"""
    return _preamble(header) + "\n" + body


def torchrun_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``torchrun`` on one machine (run it on every machine for multi-node). DeepSpeed strategies pass the
    JSON with ``--deepspeed`` (the HF Trainer flag)."""
    if cfg.strategy == "fsdp":
        raise ValueError("FSDP is configured through accelerate: use the accelerate launch script")
    topo = cfg.topology
    args = [f"--nnodes {topo.num_machines}", f"--nproc_per_node {topo.processes_per_machine}"]
    if topo.rdzv_backend == "c10d":
        args += [
            "--rdzv_backend c10d",
            f'--rdzv_endpoint "${{MASTER_ADDR:-{topo.main_process_ip or "127.0.0.1"}}}:'
            f'${{MASTER_PORT:-{topo.main_process_port}}}"',
            f'--rdzv_id "${{RDZV_ID:-{name}}}"',
        ]
    else:
        args += [
            '--node_rank "${NODE_RANK:-${SLURM_NODEID:-0}}"',
            f'--master_addr "${{MASTER_ADDR:-{topo.main_process_ip or "127.0.0.1"}}}"',
            f'--master_port "${{MASTER_PORT:-{topo.main_process_port}}}"',
        ]
    note = ""
    if topo.num_machines > 1:
        last = topo.num_machines - 1
        note = f"# Run on every machine with NODE_RANK=0..{last} and MASTER_ADDR=<rank-0 address>.\n"
    command = " \\\n  ".join(["exec torchrun", *args, _train_command(cfg, name, with_deepspeed_flag=True)])
    return _preamble(header) + "\n" + note + command + "\n"


def deepspeed_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """The ``deepspeed`` launcher. Multi-node: started once, on the rank-0 machine; it reaches the others
    over passwordless ssh (pdsh) using ``launch/NAME.hostfile`` and takes the first host as master."""
    if cfg.strategy != "deepspeed":
        raise ValueError("the deepspeed launcher script is for strategy deepspeed")
    topo = cfg.topology
    args = []
    if topo.num_machines > 1:
        args += [f"--hostfile launch/{name}.hostfile", f"--num_nodes {topo.num_machines}"]
    args += [
        f"--num_gpus {topo.processes_per_machine}",
        f'--master_port "${{MASTER_PORT:-{topo.main_process_port}}}"',
    ]
    command = " \\\n  ".join(["exec deepspeed", *args, _train_command(cfg, name, with_deepspeed_flag=True)])
    return _preamble(header) + "\n" + command + "\n"


def hostfile(cfg: DistributedConfig, name: str) -> str:
    """DeepSpeed hostfile with placeholder host names (multi-node DeepSpeed only)."""
    topo = cfg.topology
    hosts = [topo.main_process_ip or "node-0"] + [f"node-{rank}" for rank in range(1, topo.num_machines)]
    return (
        f"# DeepSpeed hostfile for {name}: one line per machine, `HOSTNAME slots=GPUS`.\n"
        "# Replace the placeholder names with your machines (reachable by passwordless ssh: the deepspeed\n"
        "# launcher uses pdsh). The first host is the rank-0 machine.\n"
        + "".join(f"{host} slots={topo.processes_per_machine}\n" for host in hosts)
    )


def sbatch_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """SLURM batch script: one task per node running ``launch/NAME.accelerate.sh``; rank from
    ``$SLURM_NODEID``, rank-0 address = first host of the allocation; requeues on exit 75."""
    topo = cfg.topology
    directives = [
        f"--job-name=hf-scale-{name}",
        f"--nodes={topo.num_machines}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={topo.processes_per_machine}",
        f"--signal=USR1@{PREEMPT_SIGNAL_LEAD_S}",
        "--requeue",
        "--open-mode=append",
        "--output=%x-%j.out",
    ]
    return (
        "#!/usr/bin/env bash\n"
        + "".join(f"#SBATCH {directive}\n" for directive in directives)
        + _comment(header)
        + f"""# Submit from the directory holding accelerate_configs/:
#   sbatch launch/{name}.sbatch [TRAINING ARGS...]
#
# --signal=USR1@{PREEMPT_SIGNAL_LEAD_S} (not B:USR1): without "B:" SLURM sends the signal to every
# process of the job steps, i.e. to the training processes that srun started, {PREEMPT_SIGNAL_LEAD_S} s
# before the time limit; "B:" would signal only this batch shell, which cannot forward it into
# srun's tasks in time. The training saves a checkpoint and exits {EXIT_PREEMPTED}; then this script
# requeues the job, which resumes from that checkpoint.
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-.}}"

if [ "${{SLURM_JOB_NUM_NODES:-{topo.num_machines}}}" -ne {topo.num_machines} ]; then
  echo "hf-scale: error: accelerate_configs/{name}.yaml expects {topo.num_machines} nodes," \\
    "the allocation has $SLURM_JOB_NUM_NODES" >&2
  exit 2
fi
# Rank-0 address: the first host of the allocation; each node's rank is its $SLURM_NODEID.
# (awk reads every line: `head -n 1` would close the pipe early, scontrol would die of SIGPIPE on a long
# host list, and with pipefail the script would stop here.)
MAIN_PROCESS_IP="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')"
export MAIN_PROCESS_IP
export MAIN_PROCESS_PORT="${{MAIN_PROCESS_PORT:-{topo.main_process_port}}}"
unset MACHINE_RANK  # a value exported at submission would give every node the same rank

# Each node runs: accelerate launch --config_file accelerate_configs/{name}.yaml \\
#   --machine_rank $SLURM_NODEID --main_process_ip $MAIN_PROCESS_IP ... train.py "$@"
# A requeued job continues from the newest complete checkpoint (a fresh start when there is none),
# unless the arguments already say where to resume from.
args=("$@")
case " $* " in
  *" --resume_from_checkpoint"*) ;;
  *) args+=(--resume_from_checkpoint auto) ;;
esac
# No --kill-on-bad-exit: every node must finish writing its checkpoint shard before the step ends.
status=0
srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash launch/{name}.accelerate.sh "${{args[@]}}" || status=$?
if [ "$status" -eq {EXIT_PREEMPTED} ]; then
  echo "hf-scale: checkpoint saved before the time limit; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""
    )


def launch_files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """File name (inside ``launch/``) -> text, for every launch file that applies to the config."""
    files = {f"{name}.accelerate.sh": accelerate_script(cfg, name, header=header)}
    if cfg.strategy != "fsdp":
        files[f"{name}.torchrun.sh"] = torchrun_script(cfg, name, header=header)
    if cfg.strategy == "deepspeed":
        files[f"{name}.deepspeed.sh"] = deepspeed_script(cfg, name, header=header)
        if cfg.topology.num_machines > 1:
            files[f"{name}.hostfile"] = hostfile(cfg, name)
    files[f"{name}.sbatch"] = sbatch_script(cfg, name, header=header)
    return files
