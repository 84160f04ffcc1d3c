"""`hf-scale doctor --slurm FILE.sbatch`: read the SLURM cluster the job will be queued on and say where it
breaks the sbatch file's promises (a stop request before the time limit, a checkpoint, a requeue).

The cluster is read with `scontrol show config`, `scontrol show partition` and `scontrol show node` (the
SLURM commands of this login node, so `SLURM_CONF` is honoured); the findings themselves are
:func:`slurm_findings`, pure: the cluster's and the file's facts are its arguments. Each mismatch is one
finding that names the setting, its value and the fix.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.files.reading import read_text

_SBATCH = re.compile(r"^#SBATCH[ \t]+(--[\w-]+)(?:[= \t][ \t]*(\S+))?", re.MULTILINE)
_SIGNAL_LEAD = re.compile(r"^(?:[BR]:)*\w+@(\d+)$")
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


def sbatch_directives(text: str) -> dict[str, str]:
    """`#SBATCH --name=value` lines (also `--name value`, and bare flags as "") of an sbatch file."""
    return {name: value or "" for name, value in _SBATCH.findall(text)}


def slurm_seconds(value: str) -> int | None:
    """A SLURM time (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH[:MM[:SS]]`, as sbatch --time and scontrol write it) in
    seconds; None for no limit (UNLIMITED, INFINITE, NONE)."""
    if value.upper() in {"UNLIMITED", "INFINITE", "NONE", ""}:
        return None
    days, _, clock = value.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:  # MM, MM:SS, HH:MM:SS
        hours, minutes, seconds = ([0, 0] + parts)[-3:] if len(parts) == 3 else (0, parts[0], (parts + [0])[1])
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def node_gpus(gres: str) -> int:
    """GPUs in a node's `Gres=` (gpu:4, gpu:h100:8(S:0-1), several entries comma-separated; (null): 0)."""
    return sum(int(count) for count in _GPU_GRES.findall(gres))


def slurm_findings(file: str, directives: dict[str, str], config: dict[str, str], partition: dict[str, str],
                   nodes: dict[str, dict[str, str]]) -> list[str]:
    """One line per mismatch between the sbatch file (`directives`) and the cluster: `config` is `scontrol show
    config`, `partition` the job's partition and `nodes` its nodes (`scontrol show ...` KEY=VALUE)."""
    findings = []
    name = partition["PartitionName"]
    requeue = "--requeue" in directives or ("--no-requeue" not in directives and config.get("JobRequeue") == "1")
    if not requeue:
        findings.append(f"JobRequeue = {config.get('JobRequeue')} and {file} has no #SBATCH --requeue: a job that "
                        "stops for its time limit or a preemption is not requeued; fix: add #SBATCH --requeue "
                        "(hf-scale generate writes it)")
    match = _SIGNAL_LEAD.match(directives.get("--signal", ""))
    lead = int(match.group(1)) if match else None
    if lead is None:
        findings.append(f"{file} has no #SBATCH --signal=USR1@SECONDS: no stop request comes before the time "
                        "limit, the job is killed without a checkpoint; fix: add #SBATCH --signal=USR1@120")
    limit_name = "DefaultTime" if slurm_seconds(partition.get("DefaultTime", "NONE")) else "MaxTime"
    limit = slurm_seconds(directives.get("--time") or partition.get(limit_name, "UNLIMITED"))
    if "--time" in directives:
        limit_name = "--time"
    if lead is not None and limit is not None and limit <= lead:
        findings.append(f"partition {name}: the job's time limit ({limit_name} {limit} s) is not longer than the "
                        f"--signal lead of {lead} s in {file}: the stop request comes before training starts; fix: "
                        f"submit with --time longer than {lead} s (a partition whose MaxTime allows it)")
    gpus = int(directives.get("--gpus-per-node", "0") or 0)
    short = sorted(node for node, facts in nodes.items() if node_gpus(facts.get("Gres", "(null)")) < gpus)
    if gpus and short:
        gres = nodes[short[0]].get("Gres", "(null)")
        findings.append(f"partition {name}: nodes {','.join(short)} have fewer than {gpus} GPUs in their GRES "
                        f"(Gres={gres}), {file} asks --gpus-per-node={gpus}: sbatch refuses the job; fix: "
                        "GresTypes=gpu and Gres=gpu:N on the nodes in slurm.conf, or a partition with GPU nodes")
    mode = partition.get("PreemptMode") or config.get("PreemptMode", "OFF")
    preemptible = config.get("PreemptType", "preempt/none") != "preempt/none" and "OFF" not in mode.upper()
    if preemptible and "CANCEL" in mode.upper():
        findings.append(f"partition {name}: PreemptMode={mode}: a preempted job is cancelled, not requeued; "
                        "fix: PreemptMode=REQUEUE")
    if preemptible and lead is not None and ("REQUEUE" in mode.upper() or "CANCEL" in mode.upper()):
        grace = int(partition.get("GraceTime", "0") or 0)
        kill_wait = int((config.get("KillWait") or "30").split()[0])
        if grace + kill_wait < lead:
            findings.append(f"partition {name}: PreemptMode={mode} with GraceTime={grace} (+ KillWait {kill_wait} "
                            f"s): a preempted job has {grace + kill_wait} s to save, less than the {lead} s the "
                            f"--signal lead of {file} gives a save; fix: GraceTime={lead - kill_wait} or more on "
                            f"partition {name}")
    return findings


def _scontrol(*args: str) -> str:
    result = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise UserError(f"--slurm: scontrol {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _pairs(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


def read_cluster(partition: str | None) -> tuple[dict[str, str], dict[str, str], dict[str, dict[str, str]]]:
    """(`scontrol show config`, the partition — the default one when None —, its nodes by name)."""
    if shutil.which("scontrol") is None:
        raise UserError("--slurm: scontrol is not on PATH: run hf-scale doctor --slurm on a node of the cluster "
                        "(a login node) with the SLURM commands")
    config = dict(re.findall(r"^(\w+)\s+=\s+(.*?)\s*$", _scontrol("show", "config"), re.MULTILINE))
    partitions = [_pairs(line) for line in _scontrol("show", "partition", "-o").splitlines() if line.strip()]
    wanted = [p for p in partitions if p["PartitionName"] == partition or (partition is None and p["Default"] == "YES")]
    if not wanted:
        names = ", ".join(p["PartitionName"] for p in partitions) or "none"
        raise UserError(f"--partition {partition}: no such partition on this cluster (partitions: {names})"
                        if partition else f"--slurm: the cluster has no default partition; give --partition "
                        f"(partitions: {names})")
    node_names = _scontrol("show", "hostnames", wanted[0]["Nodes"]).split()
    nodes = {}
    for line in _scontrol("show", "node", "-o", ",".join(node_names)).splitlines():
        if line.strip():
            facts = _pairs(line)
            nodes[facts["NodeName"]] = facts
    return config, wanted[0], nodes


def slurm_report(sbatch: str, partition: str | None) -> dict:
    """What `--slurm` prints: the SLURM version, the partition and the findings."""
    directives = sbatch_directives(read_text(sbatch, "--slurm", expected="a generated launch/NAME.sbatch file"))
    config, part, nodes = read_cluster(partition)
    return {"file": sbatch, "slurm_version": config.get("SLURM_VERSION"), "partition": part["PartitionName"],
            "findings": slurm_findings(Path(sbatch).name, directives, config, part, nodes)}


def format_slurm(report: dict) -> str:
    lines = [f"hf-scale doctor --slurm {report['file']}: SLURM {report['slurm_version']}, "
             f"partition {report['partition']}"]
    lines += [f"finding: {finding}" for finding in report["findings"]] or ["no mismatch found"]
    return "\n".join(lines) + "\n"
