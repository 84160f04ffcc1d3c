"""Launch scripts for a generated config: pure functions from config to file text.

Every script runs from any directory: it finds the generated files relative to itself (the parent of
``launch/``), runs ``python -m hf_scale.train`` (train.py of the installed hf_scale; ``$TRAIN_SCRIPT``
names another script) and leaves the working directory alone, so relative paths among its arguments mean
what they mean where it is started. It passes ``--hf_scale_config hf_scale_configs/NAME.yaml`` (the resolved
DistributedConfig: batch, precision, clipping, optimizer values, activation checkpointing reach the run
through it), then its own arguments (``"$@"``). Per-machine values come from environment variables so one
file serves every node; nothing secret is ever written.

* ``NAME.accelerate.sh`` - ``accelerate launch --config_file accelerate_configs/NAME.yaml`` on one machine
  (every strategy; the cluster targets' scripts run it on each node: hf_scale.clusters).
* ``NAME.torchrun.sh`` - plain ``torchrun`` (not for FSDP: accelerate's FSDP plugin is configured by the
  YAML that only ``accelerate launch`` reads; under bare torchrun the model would not be sharded).
* ``NAME.deepspeed.sh`` + ``NAME.hostfile`` - the ``deepspeed`` launcher (DeepSpeed strategies).
"""

from __future__ import annotations

import shlex

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.config.value_types import host_problem, name_problem
from hf_scale.contract.launch_values import launchers
from hf_scale.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_PREEMPTED,
    HOLD_START_S,
    PREEMPTED_MARKER_ENV,
    REFUSED_MARKER_ENV,
    STARTED_MARKER_ENV,
    TERMINAL_ENV,
)
from hf_scale.generators import output_paths
from hf_scale.knowledge import rules

# The signals torchrun's agent may still handle itself (its default list less SIGTERM: see _supervised).
LAUNCHER_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# How often a stop request is repeated until the launcher has ended (a process still starting may not
# listen yet).
STOP_REPEAT_S = 10

q = shlex.quote


def _check_name(name: str) -> None:
    # The config and `hf-scale generate` validate everything; the generators refuse what would still break
    # a script or a hostfile line, whoever calls them.
    problem = name_problem(name)
    if problem:
        raise ValueError(f"name {name!r} {problem}")


def _comment(header: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())


def _preamble(header: str, name: str) -> str:
    return (
        "#!/usr/bin/env bash\n"
        + _comment(header)
        + "set -euo pipefail\n"
        + f"""# Runs from any directory. The generated files are found relative to this script (the parent of launch/);
# the training is `python -m {output_paths.TRAINING_MODULE}` (train.py of the installed hf_scale) unless TRAIN_SCRIPT
# names another script; relative paths among your arguments are relative to the directory you start it in.
# The training gets --hf_scale_config {output_paths.hf_scale_config(name)} first, then your arguments: the
# config's batch, precision, clipping, optimizer values and activation checkpointing reach the run through it
# (a flag that contradicts the config is an error; change the config and regenerate instead).
generated_dir=$(CDPATH='' cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")/.." && pwd)
"""
    )


def _generated(rel_path: str) -> str:
    """A generated file as a shell word: the script's own generated directory + the (quoted) relative path."""
    return f'"$generated_dir"/{q(rel_path)}'


def _env_default(variable: str, environment: str, value: object) -> str:
    """``variable`` = $environment, else the literal ``value`` quoted for the shell (a separate assignment:
    inside ``${VAR:-...}`` quoting rules differ between bash's contexts)."""
    return f"{variable}=${{{environment}:-}}\n" + f'[ -n "${variable}" ] || {variable}={q(str(value))}\n'


def _supervised(launch: str, train_args: str) -> str:
    """Run ``launch`` (a bash array holding the launcher command) on the training script, pass stop
    requests on to the training processes, and exit EXIT_PREEMPTED when train.py saved a checkpoint."""
    return f"""# accelerate launch, torchrun and deepspeed all take --module NAME in place of a script path.
if [ -n "${{TRAIN_SCRIPT:-}}" ]; then
  train=("$TRAIN_SCRIPT")
else
  train=(--module {output_paths.TRAINING_MODULE})
fi

# Stop requests: SIGTERM (preemption, `kill`) or SIGUSR1 (SLURM's --signal, `kill -USR1`) to this script
# mean "save a checkpoint and stop". Both are passed on as SIGUSR1 (train.py treats the two alike) to
# every process the launcher started, and repeated every {STOP_REPEAT_S} s until the launcher has ended
# (a process still loading the model may not listen yet). The launcher itself must not act on them: on
# SIGTERM torchrun and the deepspeed launcher stop the training processes themselves, kill them 30 s later
# (possibly while they write the checkpoint) and exit 1, even when the training had already finished. And
# SLURM signals every process of a job step, the launcher included (a preemption, `scontrol requeue`,
# `scancel --signal=TERM`, --signal). So the launcher starts with SIGUSR1 and SIGTERM ignored (set below,
# inherited by its children until train.py installs its handlers), and torchrun's agent (accelerate launch
# runs it in-process) is told by PET_SIGNALS_TO_HANDLE not to install a SIGTERM handler of its own (read by
# torch >= 2.9; an older agent still acts on SIGTERM).
# SIGINT (Ctrl-C) goes to the launcher: stop without saving.
# train.py creates ${PREEMPTED_MARKER_ENV} after saving on a stop request; every launcher reports that
# exit as a failure, so this script exits {EXIT_PREEMPTED} instead, and the SLURM script requeues the job.
status_dir=$(mktemp -d "${{TMPDIR:-/tmp}}/hf-scale.XXXXXX")
export {PREEMPTED_MARKER_ENV}="$status_dir/preempted"
# A refusal (bad flags, config, machine) ends every training process with exit 2 and the same line; the launcher
# adds its own traceback (ChildFailedError) and exits 1. So the first process to refuse writes its line to
# ${REFUSED_MARKER_ENV} instead, the launcher's output passes through a filter that holds back what comes
# after that file exists, and this script prints the line once and exits {EXIT_BAD_INPUT}, as `python train.py` does.
export {REFUSED_MARKER_ENV}="$status_dir/refused"
# The launchers print their own start-up lines before train.py has judged its flags: the filter also holds the output
# back until train.py's start checks have passed (it creates ${STARTED_MARKER_ENV}), {HOLD_START_S} s at most, so that
# a refusal at start is its one line alone (no preflight process: train.py's checks need its parser, i.e. transformers).
export {STARTED_MARKER_ENV}="$status_dir/started"
if [ -t 2 ]; then export {TERMINAL_ENV}=1; fi  # progress bars still drawn on a terminal behind the filter
mkfifo "$status_dir/out" "$status_dir/err"
# The filter ignores stop requests (SLURM signals every process of the step): it ends when the launcher's
# processes have all closed their output.
until_refused() {{
  "$(command -v python3 || echo python)" -c '
import os, select, signal, sys, time
for stop in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(stop, signal.SIG_IGN)
refused, started, hold_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = os.fdopen(1, "wb", buffering=0)
held, deadline = [], time.monotonic() + hold_s
def write(data):
    try:
        out.write(data)
    except OSError:
        pass  # the terminal is gone: keep draining so the launcher never blocks
while True:
    if held and os.path.exists(refused):
        held = []  # the start-up lines of the launcher go too: the script prints the refusal alone
    if held is not None and (os.path.exists(started) or time.monotonic() > deadline):
        write(b"".join(held))
        held = None
    if held is not None and not select.select([0], [], [], 0.2)[0]:
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        break
    if os.path.exists(refused):
        continue
    if held is not None:
        held.append(chunk)
    else:
        write(chunk)
if held and not os.path.exists(refused):
    write(b"".join(held))  # the launcher ended before train.py started (its own error): show all it said
' "${REFUSED_MARKER_ENV}" "${STARTED_MARKER_ENV}" {HOLD_START_S}
}}
until_refused <"$status_dir/out" &
out_filter=$!
until_refused <"$status_dir/err" >&2 &
err_filter=$!
launcher=""
repeater=""
stop_requested=0
trap 'if [ -n "$repeater" ]; then kill "$repeater" 2>/dev/null || true; fi; rm -rf -- "$status_dir"' EXIT
# Every process with its parent, "PID PPID" per line: read from /proc on Linux (no procps needed: slim and
# CUDA base images ship without pgrep/ps), from POSIX ps elsewhere (macOS). One snapshot per stop request.
process_table() {{
  local stat line pid rest
  if [ -r /proc/self/stat ]; then
    for stat in /proc/[0-9]*/stat; do
      {{ read -r line <"$stat"; }} 2>/dev/null || continue  # the process may have ended meanwhile
      pid=${{stat#/proc/}}
      rest=${{line##*) }}  # after "PID (COMM) ": COMM may itself hold spaces and parentheses
      rest=${{rest#* }}    # after the state letter: the parent's PID comes first
      echo "${{pid%/stat}} ${{rest%% *}}"
    done
  else
    ps -A -o pid= -o ppid= 2>/dev/null || true
  fi
}}
# Every descendant of $1 (children, grandchildren, ...): torchrun's workers run in sessions of their own, so a
# signal to a process group would miss them; walking the parent links finds them all.
descendants() {{
  local table pid ppid found=" $1 " added=1
  table=$(process_table)
  while [ "$added" -eq 1 ]; do
    added=0
    while read -r pid ppid; do
      case "$found" in
        *" $pid "*) ;;
        *" $ppid "*) found+="$pid "; echo "$pid"; added=1 ;;
      esac
    done <<<"$table"
  done
}}
forward_stop() {{
  local pids
  pids=$(descendants "$launcher")
  # shellcheck disable=SC2086  # one PID per word
  if [ -n "$pids" ]; then kill -USR1 $pids 2>/dev/null || true; fi
}}
repeat_stop() {{
  local sleeper=""
  trap - USR1
  trap 'if [ -n "$sleeper" ]; then kill "$sleeper" 2>/dev/null || true; fi; exit 0' TERM
  while :; do
    forward_stop
    sleep {STOP_REPEAT_S} &
    sleeper=$!
    wait "$sleeper" || true
  done
}}
request_stop() {{
  stop_requested=1
  if [ -n "$launcher" ] && [ -z "$repeater" ]; then
    repeat_stop >/dev/null 2>&1 &
    repeater=$!
  fi
}}
trap request_stop TERM USR1
trap 'if [ -n "$launcher" ]; then kill -INT "$launcher" 2>/dev/null || true; fi' INT
if [ ! -r /proc/self/stat ] && ! command -v ps >/dev/null; then
  echo "hf-scale: warning: neither /proc nor ps: stop requests cannot reach the training processes" >&2
fi
(trap '' USR1 TERM; export PET_SIGNALS_TO_HANDLE={LAUNCHER_SIGNALS}
  exec "${{{launch}[@]}}" "${{train[@]}}" {train_args}"$@" >"$status_dir/out" 2>"$status_dir/err") &
launcher=$!
if [ "$stop_requested" -eq 1 ]; then request_stop; fi
status=0
while :; do
  status=0
  wait "$launcher" || status=$?
  # A trapped signal interrupts `wait`: keep waiting until the launcher itself has ended.
  kill -0 "$launcher" 2>/dev/null || break
done
# All the launcher wrote is out once its processes have closed their output; one that outlives the launcher
# (a stray grandchild) holds the script up for 10 s at most.
for _ in $(seq 100); do
  kill -0 "$out_filter" 2>/dev/null || kill -0 "$err_filter" 2>/dev/null || break
  sleep 0.1
done
kill -KILL "$out_filter" "$err_filter" 2>/dev/null || true
if [ -e "${PREEMPTED_MARKER_ENV}" ]; then
  exit {EXIT_PREEMPTED}
fi
if [ -e "${REFUSED_MARKER_ENV}" ]; then
  cat -- "${REFUSED_MARKER_ENV}" >&2
  exit {EXIT_BAD_INPUT}
fi
exit "$status"
"""


def _train_args(cfg: DistributedConfig, name: str, *, with_deepspeed_flag: bool) -> str:
    """What every launch script passes to the training before the user's arguments."""
    args = f"--hf_scale_config {_generated(output_paths.hf_scale_config(name))} "
    if with_deepspeed_flag and cfg.strategy == "deepspeed":
        args += f"--deepspeed {_generated(output_paths.deepspeed_config(name))} "
    return args


def accelerate_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``accelerate launch`` on one machine. SIGTERM or SIGUSR1 (SLURM ``--signal``, ``kill -USR1``) asks
    the training to checkpoint and stop; the script then exits 75 so a scheduler can requeue."""
    _check_name(name)
    topo = cfg.topology
    body = f"launch=(accelerate launch --config_file {_generated(output_paths.accelerate_config(name))})\n"
    if cfg.strategy == "deepspeed":
        # The YAML names the JSON relative to the directory accelerate runs in; this script runs anywhere.
        body += f"launch+=(--deepspeed_config_file {_generated(output_paths.deepspeed_config(name))})\n"
    if topo.num_machines > 1:
        body += (
            "# This machine's rank and the rank-0 address: set them per node (the sbatch script does).\n"
            "machine_rank=${MACHINE_RANK:-${SLURM_NODEID:-0}}\n"
            + _env_default("main_process_ip", "MAIN_PROCESS_IP", _host(topo.main_process_ip))
            + 'launch+=(--machine_rank "$machine_rank" --main_process_ip "$main_process_ip")\n'
        )
    if cfg.strategy != "single":
        body += _env_default("main_process_port", "MAIN_PROCESS_PORT", topo.main_process_port)
        body += 'launch+=(--main_process_port "$main_process_port")\n'
    train_args = _train_args(cfg, name, with_deepspeed_flag=False)  # the YAML names the JSON
    return _preamble(header, name) + "\n" + body + _supervised("launch", train_args)


def _host(value: str | None) -> str:
    problem = host_problem(value) if value is not None else "is missing"
    if problem:
        raise ValueError(f"host {value!r} {problem}")
    return value


def torchrun_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """``torchrun`` on one machine (run it on every machine for multi-node). DeepSpeed strategies pass the
    JSON with ``--deepspeed`` (the HF Trainer flag)."""
    if cfg.strategy == "fsdp":
        raise ValueError("FSDP is configured through accelerate: use the accelerate launch script")
    _check_name(name)
    topo = cfg.topology
    body = ""
    if topo.num_machines > 1:
        last = topo.num_machines - 1
        body += f"# Run on every machine with NODE_RANK=0..{last} and MASTER_ADDR=<rank-0 address>.\n"
    body += _env_default("master_addr", "MASTER_ADDR", _host(topo.main_process_ip or "127.0.0.1"))
    body += _env_default("master_port", "MASTER_PORT", topo.main_process_port)
    body += f"launch=(torchrun --nnodes {topo.num_machines} --nproc_per_node {topo.processes_per_machine})\n"
    if topo.rdzv_backend == "c10d":
        body += _env_default("rdzv_id", "RDZV_ID", name)
        body += 'launch+=(--rdzv_backend c10d --rdzv_endpoint "$master_addr:$master_port" --rdzv_id "$rdzv_id")\n'
    else:
        body += "node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}\n"
        body += 'launch+=(--node_rank "$node_rank" --master_addr "$master_addr" --master_port "$master_port")\n'
    train_args = _train_args(cfg, name, with_deepspeed_flag=True)
    return _preamble(header, name) + "\n" + body + _supervised("launch", train_args)


def deepspeed_script(cfg: DistributedConfig, name: str, *, header: str) -> str:
    """The ``deepspeed`` launcher. Multi-node: started once, on the rank-0 machine; it reaches the others
    over passwordless ssh (pdsh) using ``launch/NAME.hostfile`` and takes the first host as master."""
    if cfg.strategy != "deepspeed":
        raise ValueError("the deepspeed launcher script is for strategy deepspeed")
    _check_name(name)
    topo = cfg.topology
    body = "launch=(deepspeed)\n"
    if topo.num_machines > 1:
        hosts = _generated(output_paths.launch_file(f"{name}.hostfile"))
        body += f"launch+=(--hostfile {hosts} --num_nodes {topo.num_machines})\n"
    body += _env_default("master_port", "MASTER_PORT", topo.main_process_port)
    body += f'launch+=(--num_gpus {topo.processes_per_machine} --master_port "$master_port")\n'
    train_args = _train_args(cfg, name, with_deepspeed_flag=True)
    return _preamble(header, name) + "\n" + body + _supervised("launch", train_args)


def hostfile(cfg: DistributedConfig, name: str) -> str:
    """DeepSpeed hostfile with placeholder host names (multi-node DeepSpeed only)."""
    _check_name(name)
    topo = cfg.topology
    hosts = [_host(topo.main_process_ip or "node-0")] + [f"node-{rank}" for rank in range(1, topo.num_machines)]
    if any(len(host.split()) != 1 or host != host.strip() or "#" in host for host in hosts):
        # The file's structure does not rest on host validation: a host never adds a line or a field.
        raise ValueError(f"hostfile: a host name must be one word without '#', got {hosts!r}")
    return (
        f"# DeepSpeed hostfile for {name}: one line per machine, `HOSTNAME slots=GPUS`.\n"
        "# Replace the placeholder names with your machines (reachable by passwordless ssh: the deepspeed\n"
        "# launcher uses pdsh). The first host is the rank-0 machine.\n"
        + "".join(f"{host} slots={topo.processes_per_machine}\n" for host in hosts)
    )


def restart_loop_args(cfg: DistributedConfig) -> tuple[str, str]:
    """The flags a job that restarts itself passes before the user's (rules.restart_loop_flags), as shell words, and
    the comment line saying why (both empty when there are none)."""
    flags = rules.restart_loop_flags(cfg.layout.sp)
    if not flags:
        return "", ""
    return (" ".join(flags) + " ",
            f"\n# {' '.join(flags)}: sp={cfg.layout.sp} resumes only in the manual loop (the Trainer path does not "
            "resume\n# sequence-parallel runs); train.py refuses --loop trainer in a job that restarts itself.")




_SCRIPTS = {"accelerate": accelerate_script, "torchrun": torchrun_script, "deepspeed": deepspeed_script}


def launch_files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """File name (inside ``launch/``) -> text, for every one-machine launch file that applies to the config (the
    cluster targets' files, SLURM's sbatch script included, are hf_scale.clusters')."""
    files = {f"{name}.{launcher}.sh": _SCRIPTS[launcher](cfg, name, header=header)
             for launcher in launchers(cfg.strategy)}
    if cfg.strategy == "deepspeed" and cfg.topology.num_machines > 1:
        files[f"{name}.hostfile"] = hostfile(cfg, name)
    return files
