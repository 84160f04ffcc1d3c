"""The Kubernetes and SkyPilot manifests' node command, run here as two "nodes" on 127.0.0.1.

Each node is the manifest's own command (read from the generated TrainJob / SkyPilot YAML) started with exactly
the variables its pod or node gets from the platform (Kubeflow Trainer's PET_* for a TrainJob; the Training
Operator's RANK/WORLD_SIZE/MASTER_* and PET_* for a PyTorchJob's Master and Worker; SKYPILOT_* for a SkyPilot
task), one training process per node. The 2-node run trains exactly like one 2-process torchrun run;
SIGTERM to one simulated pod (what the kubelet sends before the grace period ends) saves a checkpoint, both nodes
exit 75, and the same commands started again resume and end bit-identical to the uninterrupted run.
The mapping of every platform's variables (PyTorchJob's too) is covered fast in tests/generators/test_node_entry.py.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from train_helpers import child_env, free_port, launcher_command, read_metrics, run_ok

from hf_scale.cli import main
from hf_scale.cluster_config import DEFAULT_IMAGE_HOME
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.train.checkpoint import store as checkpoint

pytestmark = pytest.mark.multiprocess

TRAIN = ["--max_steps", "30", "--save_steps", "5", "--seed", "5", "--learning_rate", "1e-3", "--warmup_ratio", "0",
         "--loop", "accelerate"]
SETS = ["strategy=ddp", "precision=no", "topology.num_machines=2", "topology.processes_per_machine=1",
        "topology.main_process_ip=127.0.0.1", "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2",
        "optimizer.lr=1e-3", "cluster.image=registry.example.com/hf-scale:0.1.0", "cluster.output_dir=/output"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster")
    sets = [arg for item in SETS for arg in ("--set", item)]
    assert main(["generate", "--preset", "ddp", *sets, "--name", "job", "--targets", "kubeflow,pytorchjob,skypilot",
                 "--output-dir", str(root)]) == 0
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory, generated) -> Path:
    """The uninterrupted run: torchrun with 2 processes on one machine, the same config and flags."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_ok(launcher_command("torchrun") + TRAIN + ["--hf_scale_config", str(generated / "hf_scale_configs/job.yaml"),
                                                   "--output_dir", str(out)])
    return out


def _command(manifest: dict, kind: str, generated: Path, output: Path) -> list[str]:
    """The manifest's container command with the image's paths mapped onto this machine's."""
    if kind == "trainjob":
        trainer = manifest["spec"]["trainer"]
        command = trainer["command"] + trainer["args"] + TRAIN
    elif kind == "pytorchjob":  # Master and Worker run the same container command
        master, worker = (manifest["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
                          for role in ("Master", "Worker"))
        assert master["command"] + master.get("args", []) == worker["command"] + worker.get("args", [])
        command = master["command"] + master.get("args", []) + TRAIN
    else:  # SkyPilot runs `run` with bash in the synced workdir; the flags stand for the config's train_args
        command = ["bash", "-c", f"{manifest['run']} {shlex.join(TRAIN)}"]
    return [part.replace(DEFAULT_IMAGE_HOME, str(generated)).replace("/output/job", str(output)) for part in command]


def _node_env(kind: str, rank: int, port: int, tmp: Path) -> dict[str, str]:
    env = child_env()
    env.update(TMPDIR=str(tmp), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    if kind == "trainjob":  # what Kubeflow Trainer's torch plugin sets in every trainer pod
        env.update(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
                   PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    elif kind == "pytorchjob":  # what the Training Operator sets in the Master (rank 0) and Worker pods
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PET_NNODES="2",
                   PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1",
                   PET_MASTER_PORT=str(port))
    else:  # what SkyPilot sets on every node of a 2-node task (IPs one per line, rank 0 first)
        env.update(SKYPILOT_NUM_NODES="2", SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
                   SKYPILOT_NUM_GPUS_PER_NODE="1", MAIN_PROCESS_PORT=str(port))
    return env


def _start_nodes(kind: str, generated: Path, output: Path, tmp: Path) -> list[subprocess.Popen]:
    manifest = yaml.safe_load((generated / "launch" / f"job.{'sky' if kind == 'skypilot' else kind}.yaml").read_text())
    command = _command(manifest, kind, generated, output)
    port = free_port()
    return [subprocess.Popen(command, cwd=generated, env=_node_env(kind, rank, port, tmp), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True) for rank in (0, 1)]


def _finish(nodes: list[subprocess.Popen], timeout: float = 420) -> list[tuple[int, str]]:
    results = []
    try:
        for node in nodes:
            _, stderr = node.communicate(timeout=timeout)
            results.append((node.returncode, stderr))
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    return results


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_kubernetes_nodes_train_like_one_two_process_run(kind, generated, reference, tmp_path):
    output = tmp_path / "volume"
    results = _finish(_start_nodes(kind, generated, output, tmp_path))
    for code, stderr in results:
        assert code == 0, stderr[-4000:]
    got = [(r["step"], r["loss"]) for r in read_metrics(output)]
    assert got == [(r["step"], r["loss"]) for r in read_metrics(reference)]  # exact: the same training
    assert len(got) == 30


def test_sigterm_to_a_skypilot_node_checkpoints_exits_75_and_resumes_bit_identically(generated, reference, tmp_path):
    output = tmp_path / "bucket"
    nodes = _start_nodes("skypilot", generated, output, tmp_path)
    deadline = time.monotonic() + 300
    while not checkpoint.complete_checkpoints(output):
        assert all(node.poll() is None for node in nodes), [node.communicate()[1][-3000:] for node in nodes]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    nodes[1].send_signal(signal.SIGTERM)  # the node's own PID: what a preempted node's process gets
    results = _finish(nodes)
    if all(code == 0 for code, _ in results):
        pytest.fail("the run finished before the stop request; nothing was resumed")
    for code, stderr in results:
        assert code == EXIT_PREEMPTED, stderr[-4000:]
    saved = checkpoint.complete_checkpoints(output)
    assert saved and checkpoint.step_of(saved[-1]) < 30
    assert not (output / "model.safetensors").exists()  # stopped, not finished

    for code, stderr in _finish(_start_nodes("skypilot", generated, output, tmp_path)):  # the recovered job
        assert code == 0, stderr[-4000:]
    got, want = load_file(output / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)  # bit-identical final weights
    want_losses = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert {r["step"]: r["loss"] for r in read_metrics(output)} == want_losses
