"""A real 2-node SLURM cluster on this machine for the tests marked `slurm`, from Debian's `slurm-wlm` and
`munge` packages (`.ci/run` installs them): one `munged` with its own key, one `slurmctld` and two `slurmd`
(nodes n1 to n4, all on localhost, each on its own port), their config, sockets, logs and state all in one
temporary directory, on free ports, so that two pytest-xdist workers can each run a cluster of their own.
The node names must resolve (`127.0.0.1 n1 n2 n3 n4` in /etc/hosts, which `.ci/run` adds): the sbatch script takes
the allocation's first host as the rendezvous address.

Besides the compute partition `debug` (n1, n2; the default) the cluster has `spare` (n3, n4: a job that nothing
preempts), `urgent`, a higher PriorityTier over debug's nodes, so that a job there preempts one in `debug`
(SIGTERM to its steps, then GraceTime), and `tight` (debug's nodes), where
`hf-scale doctor --slurm` finds what breaks a job (a time limit under the --signal lead, preemption that cancels,
no grace time). JobRequeue=0: the generated sbatch's own `--requeue` is what makes its job requeueable.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from train_helpers import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
NODES = ("n1", "n2", "n3", "n4")
GRACE_TIME_S = 90
OWNER = "pytest.pid"
"""The file, in a cluster's folder, naming the pytest process that started it."""
CONFIG = """\
ClusterName=hfscale{ctld_port}
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmdSpoolDir={dir}/spool-%n
StateSaveLocation={dir}/state
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=0
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace}
PartitionName=spare Nodes=n3,n4 MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=urgent Nodes=n1,n2 MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
PartitionName=tight Nodes=n1,n2 MaxTime=2 State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=0
"""
NODE = "NodeName={name} NodeHostname=localhost Port={port} CPUs=2 RealMemory=4000 State=UNKNOWN"


class Cluster:
    """The running cluster: `env` for the SLURM commands (SLURM_CONF), and what the tests ask of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check:
            assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stderr}"
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as KEY=VALUE (accounting is off: finished jobs are known for MinJobAge, set to an hour:
        a job that finished early is still looked at when the test that reads it comes)."""
        text = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, states: set[str], timeout: float = 420) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            assert time.monotonic() < deadline, f"job {job_id} still {job['JobState']}, not in {states}{self.logs()}"
            time.sleep(0.5)
        return job

    def logs(self, tail: int = 4000) -> str:
        """The daemons' logs (their ends), for an assertion's message: why SLURM did what it did to a job. On a
        failed test the cluster's folder is kept as well (see `slurm`)."""
        parts = [f"\n--- cluster kept in {self.root} on failure"]
        for name in ("slurmctld", *(f"slurmd-{node}" for node in NODES)):
            with contextlib.suppress(OSError):
                parts.append(f"--- {name}.log:\n{(self.root / f'{name}.log').read_text()[-tail:]}")
        return "\n".join(parts)

    def start(self) -> None:
        ports = {"ctld_port": free_port(), **{name: free_port() for name in NODES}}
        nodes = "\n".join(NODE.format(name=name, port=ports[name]) for name in NODES)
        self.conf.write_text(CONFIG.format(dir=self.root, ctld_port=ports["ctld_port"], nodes=nodes,
                                           grace=GRACE_TIME_S))
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "state").mkdir()
        # munged wants its socket's folder searchable by all and its key readable by its user alone.
        self.root.chmod(0o755)
        self._daemon("munged", f"--key-file={key}", f"--socket={self.root / 'munge.sock'}",
                     f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                     f"--seed-file={self.root / 'munged.seed'}")
        self._daemon("slurmctld", "-f", str(self.conf))
        for name in NODES:
            self._daemon("slurmd", "-N", name, "-f", str(self.conf))
        deadline = time.monotonic() + 60
        while sorted(set(self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split())) != list(
            NODES
        ):
            assert time.monotonic() < deadline, (self.root / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)

    def _daemon(self, *command: str) -> None:
        """Start a daemon (it forks and returns at once)."""
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stderr}"

    def stop(self) -> None:
        """Cancel what is left (while the controller runs), then end the daemons by their pid files."""
        if self._daemon_pid("slurmctld.pid"):
            self.run("scancel", "--full", "--user", "root", check=False)
            deadline = time.monotonic() + 60  # the slurmds end the jobs' processes; then nothing is left behind
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        pid_files = [f"slurmd-{name}.pid" for name in NODES] + ["slurmctld.pid", "munged.pid"]
        for pid in filter(None, map(self._daemon_pid, pid_files)):
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _daemon_pid(self, pid_file: str) -> int | None:
        """The pid in this cluster's pid file while that process runs and is still its daemon (its command names
        this folder; not a process that reuses the pid)."""
        try:
            pid = int((self.root / pid_file).read_text())
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            return None
        return pid if str(self.root) in command else None


def _stop_orphans() -> None:
    """Stop the clusters that a killed pytest left running (their owner, written at start, is gone): their daemons
    and jobs would compete with this run's for the machine's CPUs."""
    for root in Path(tempfile.gettempdir()).glob("hf-scale-slurm-*"):
        try:
            owner = int((root / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not started by this conftest, or being started
        if not Path(f"/proc/{owner}").exists():
            Cluster(root).stop()
            (root / OWNER).unlink(missing_ok=True)  # folder kept: its logs may be wanted


def _unavailable() -> str | None:
    missing = [daemon for daemon in DAEMONS if not shutil.which(daemon)]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a SLURM test cluster runs its slurmd as root"
    try:
        for name in NODES:
            socket.gethostbyname(name)
    except OSError:
        return f"the test nodes' names do not resolve: add '127.0.0.1 {' '.join(NODES)}' to /etc/hosts"
    return None


@pytest.fixture(scope="session")
def slurm(request) -> Cluster:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    # Not under pytest's base temp (0700): munged wants every folder above its socket searchable by all.
    _stop_orphans()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="hf-scale-slurm-")))
    (cluster.root / OWNER).write_text(str(os.getpid()))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        # A failed test keeps the cluster's folder (config, daemons' logs, state) to be read after the run.
        if not request.session.testsfailed:
            shutil.rmtree(cluster.root, ignore_errors=True)
