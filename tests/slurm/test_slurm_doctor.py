"""`hf-scale doctor --slurm FILE.sbatch` reading the real test cluster (tests/slurm/conftest.py): its `debug`
partition takes the generated job but has no GPU GRES; its `tight` partition breaks the job's promises (MaxTime
under the --signal lead, PreemptMode=CANCEL, no GraceTime); the cluster's JobRequeue=0 leaves an sbatch without
--requeue unrequeued. The parsers the findings rest on are pure and tested without a cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_scale.commands.cli import main
from hf_scale.doctor.slurm_cluster import node_gpus, sbatch_directives, slurm_seconds

GRES = ("finding: partition {p}: nodes n1,n2 have fewer than 1 GPUs in their GRES (Gres=(null)), job.sbatch asks "
        "--gpus-per-node=1: sbatch refuses the job; fix: GresTypes=gpu and Gres=gpu:N on the nodes in slurm.conf, "
        "or a partition with GPU nodes")


@pytest.fixture(scope="module")
def sbatch(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doctor")
    assert main(["generate", "--preset", "ddp", "--set", "topology.num_machines=2", "--set",
                 "topology.processes_per_machine=1", "--set", "topology.main_process_ip=n1", "--name", "job",
                 "--output-dir", str(root)]) == 0
    return root / "launch" / "job.sbatch"


def _doctor(slurm, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_scale", "doctor", *args], env=slurm.env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slurm
def test_each_mismatch_with_the_real_cluster_is_one_finding_with_its_fix(slurm, sbatch, tmp_path):
    debug = _doctor(slurm, "--slurm", str(sbatch))  # the default partition
    assert debug.returncode == 1, debug.stderr
    head, *findings = debug.stdout.splitlines()
    assert head.startswith(f"hf-scale doctor --slurm {sbatch}: SLURM ") and head.endswith(", partition debug")
    assert findings == [GRES.format(p="debug")]

    tight = _doctor(slurm, "--slurm", str(sbatch), "--partition", "tight").stdout.splitlines()
    assert tight[1:] == [
        "finding: partition tight: the job's time limit (MaxTime 120 s) is not longer than the --signal lead of 120 "
        "s in job.sbatch: the stop request comes before training starts; fix: submit with --time longer than 120 s "
        "(a partition whose MaxTime allows it)",
        GRES.format(p="tight"),
        "finding: partition tight: PreemptMode=CANCEL: a preempted job is cancelled, not requeued; fix: "
        "PreemptMode=REQUEUE",
        "finding: partition tight: PreemptMode=CANCEL with GraceTime=0 (+ KillWait 30 s): a preempted job has 30 s "
        "to save, less than the 120 s the --signal lead of job.sbatch gives a save; fix: GraceTime=90 or more on "
        "partition tight",
    ]

    unrequeued = tmp_path / "launch" / "job.sbatch"  # a user's copy without --requeue, on a JobRequeue=0 cluster
    unrequeued.parent.mkdir()
    unrequeued.write_text(sbatch.read_text().replace("#SBATCH --requeue\n", ""))
    result = _doctor(slurm, "--slurm", str(unrequeued), "--json")
    assert result.returncode == 1
    assert ("JobRequeue = 0 and job.sbatch has no #SBATCH --requeue: a job that stops for its time limit or a "
            "preemption is not requeued; fix: add #SBATCH --requeue (hf-scale generate writes it)") in result.stdout

    wrong = _doctor(slurm, "--slurm", str(sbatch), "--partition", "gpu")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr == ("hf-scale: error: --partition gpu: no such partition on this cluster (partitions: debug, "
                            "spare, urgent, tight)\n")


def test_without_scontrol_the_slurm_check_says_where_to_run_it(sbatch, tmp_path):
    result = subprocess.run([sys.executable, "-m", "hf_scale", "doctor", "--slurm", str(sbatch)],
                            env={"PATH": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == ("hf-scale: error: --slurm: scontrol is not on PATH: run hf-scale doctor --slurm on a "
                             "node of the cluster (a login node) with the SLURM commands\n")


@pytest.mark.parametrize(("value", "seconds"), [("UNLIMITED", None), ("2", 120), ("3:30", 210), ("01:02:03", 3723),
                                                ("1-00:00:00", 86400), ("2-3", 183600), ("1-1:30", 91800)])
def test_slurm_times_in_seconds(value, seconds):
    assert slurm_seconds(value) == seconds


@pytest.mark.parametrize(("gres", "gpus"), [("(null)", 0), ("gpu:4", 4), ("gpu:h100:8(S:0-1)", 8),
                                            ("gpu:a100:2,gpu:t4:1,nvme:1", 3), ("shard:gpu:4", 0)])
def test_gpus_in_a_nodes_gres(gres, gpus):
    assert node_gpus(gres) == gpus


def test_sbatch_directives_in_both_spellings():
    assert sbatch_directives("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --time 10\n#SBATCH --requeue\necho\n") == {
        "--nodes": "2", "--time": "10", "--requeue": ""}
