"""launch/NAME.node.sh and launch/NAME.ray.sh: bash -n and shellcheck clean, and every platform's node variables
(Kubeflow's PET_*, a legacy PyTorchJob's RANK/WORLD_SIZE, SkyPilot's SKYPILOT_*) reach `accelerate launch` as
NAME.accelerate.sh's machine rank, rank-0 address and port. A stand-in `accelerate` on PATH records what it got
(the real two-node runs are in test_cluster_launch.py); a disagreeing node count or processes per node is refused
with one line and exit 2 before anything starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import generate_all
from test_launch_injection import shellcheck_binary

STANDIN = """#!/usr/bin/env bash
# Records its arguments and the rendezvous variables instead of launching anything.
printf '%s\\n' "$@" > "$ARGV_LOG"
echo "RANK=${RANK:-} WORLD_SIZE=${WORLD_SIZE:-} PET_NODE_RANK=${PET_NODE_RANK:-} HF_SCALE_RESUME=${HF_SCALE_RESUME:-}" \
  >> "$ARGV_LOG"
"""

PLATFORMS = {
    # platform: (the variables node 2 of 4 gets, the address the node must use)
    "trainjob": ({"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2",
                  "PET_MASTER_ADDR": "multi-node-0-0.multi", "PET_MASTER_PORT": "29400"}, "multi-node-0-0.multi",
                 "29400"),
    "pytorchjob": ({"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2", "RANK": "2",
                    "WORLD_SIZE": "32", "MASTER_ADDR": "multi-master-0", "MASTER_PORT": "29500",
                    "PET_MASTER_ADDR": "multi-master-0", "PET_MASTER_PORT": "29500"}, "multi-master-0", "29500"),
    "pytorchjob-legacy": ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "multi-master-0", "MASTER_PORT": "23456"},
                          "multi-master-0", "23456"),
    "skypilot": ({"SKYPILOT_NUM_NODES": "4", "SKYPILOT_NODE_RANK": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8",
                  "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7\n10.0.0.8"}, "10.0.0.5", "29500"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = generate_all(tmp_path_factory.mktemp("node"), "multi", "kubeflow,ray")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text(STANDIN)
    (bin_dir / "accelerate").chmod(0o755)
    return root


def _run(root: Path, tmp_path: Path, variables: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / "argv.log"
    env = {"PATH": f"{root / 'bin'}:{os.environ['PATH']}", "ARGV_LOG": str(log), "TMPDIR": str(tmp_path), **variables}
    result = subprocess.run(["bash", str(root / "launch" / "multi.node.sh"), "--output_dir", "/output/multi", *args],
                            env=env, capture_output=True, text=True, timeout=60)
    return result, log.read_text() if log.exists() else ""


def test_the_scripts_pass_bash_n_and_shellcheck(root):
    for name in ("multi.node.sh", "multi.ray.sh"):
        script = root / "launch" / name
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
        lint = subprocess.run([shellcheck_binary(), "--shell=bash", "--severity=info", str(script)],
                              capture_output=True, text=True)
        assert lint.returncode == 0, f"{name}:\n{lint.stdout}"


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
def test_each_platform_reaches_accelerate_launch(platform, root, tmp_path):
    variables, address, port = PLATFORMS[platform]
    result, recorded = _run(root, tmp_path, variables)
    assert result.returncode == 0, result.stderr
    *argv, pod_env = recorded.splitlines()
    assert argv[argv.index("--machine_rank") + 1] == "2"
    assert argv[argv.index("--main_process_ip") + 1] == address
    assert argv[argv.index("--main_process_port") + 1] == port
    assert argv[argv.index("--output_dir") + 1] == "/output/multi"
    assert argv[-2:] == ["--output_dir", "/output/multi"]  # train.py's flags as given: it decides the resume
    # The pod-level values are gone: accelerate launch sets each process's own.
    assert pod_env == "RANK= WORLD_SIZE= PET_NODE_RANK= HF_SCALE_RESUME=auto"


@pytest.mark.parametrize("given", [[], ["--resume_from_checkpoint", "/output/x"],
                                   ["--resume-from-checkpoint=/output/x"], ["--resume-from-checkpoint", "/output/x"]],
                         ids=["none", "underscore", "dashed=", "dashed"])
def test_a_restarted_node_resumes_auto_unless_train_py_reads_an_explicit_resume(root, tmp_path, monkeypatch, given):
    """What the node passes on, read as train.py reads it (its parser, then the resume default the script sets)."""
    from hf_scale.contract.parser import parse_flags, resume_default

    result, recorded = _run(root, tmp_path, PLATFORMS["skypilot"][0], *given)
    assert result.returncode == 0, result.stderr
    *argv, pod_env = recorded.splitlines()
    train_args = argv[argv.index("--hf_scale_config"):]
    train_args[1] = str(root / train_args[1])
    monkeypatch.setenv("HF_SCALE_RESUME", pod_env.rsplit("HF_SCALE_RESUME=", 1)[1])
    namespace, flags_given, _ = parse_flags(train_args)
    resume_default(namespace, flags_given)
    assert namespace.resume_from_checkpoint == ("/output/x" if given else "auto")


@pytest.mark.parametrize(("variables", "message"), [
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "h"}, "runs 2 node(s) but"),
    ({"SKYPILOT_NUM_NODES": "4", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_GPUS_PER_NODE": "4",
      "SKYPILOT_NODE_IPS": "h"}, "starts 4 process(es)/GPU(s) per node"),
    ({"PET_NNODES": "4", "PET_NODE_RANK": "7", "PET_MASTER_ADDR": "h"}, "the rank 7: expected 0..3"),
    ({}, "no node variables found"),
])
def test_a_node_that_disagrees_is_refused(variables, message, root, tmp_path):
    result, recorded = _run(root, tmp_path, variables)
    assert result.returncode == 2 and recorded == ""
    assert result.stderr.startswith("hf-scale: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_sp_node_runs_the_loop_that_resumes_it_and_train_py_refuses_the_other(tmp_path, monkeypatch):
    """parallelism.sp=2: the node script and the sbatch pass --loop accelerate before the user's flags (the Trainer
    path does not resume sp runs, so every restart of a preempted job would be refused); a --loop trainer given
    after it wins in train.py's parser, and train.py's start in a job that restarts itself refuses it (the same
    rule generate applies to cluster.train_args). The real preempt -> restart run: tests/train/model/
    test_sequence_parallel_train.py::test_a_generated_sp_cluster_node_survives_a_preemption_and_resumes."""
    from hf_scale.commands.cli import main
    from hf_scale.contract.parser import parse_flags
    from hf_scale.knowledge import rules

    sets = ["topology.processes_per_machine=2", "parallelism.sp=2", "cluster.image=registry.example.com/x:1"]
    assert main(["generate", "--preset", "zero2", *[a for s in sets for a in ("--set", s)], "--name", "sp",
                 "--targets", "skypilot", "--output-dir", str(tmp_path)]) == 0
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "accelerate").write_text(STANDIN)
    (tmp_path / "bin" / "accelerate").chmod(0o755)
    variables = {"SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_GPUS_PER_NODE": "2",
                 "SKYPILOT_NODE_IPS": "10.0.0.5"}
    for given, loop in (([], "accelerate"), (["--loop", "trainer"], "trainer")):
        log = tmp_path / "argv.log"
        env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "ARGV_LOG": str(log), "TMPDIR": str(tmp_path),
               **variables}
        result = subprocess.run(["bash", str(tmp_path / "launch" / "sp.node.sh"), "--output_dir", "/o", *given],
                                env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        *argv, _ = log.read_text().splitlines()
        train_args = argv[argv.index("--hf_scale_config") + 2:]
        assert parse_flags(train_args)[0].loop == loop
        assert (rules.restart_loop_problem(2, loop) is None) == (loop == "accelerate")
    sbatch = (tmp_path / "launch" / "sp.sbatch").read_text()
    assert 'bash "$launch_dir/$accelerate_script" --loop accelerate "$@"' in sbatch
