"""The Kubernetes and SkyPilot manifests' node command, run here as two "nodes" on 127.0.0.1.

Each node is the manifest's own command (read from the generated TrainJob / PyTorchJob / SkyPilot YAML) started
with exactly the variables its pod or node gets: the manifest's own env (TrainJob trainer.env, the PyTorchJob
container's env, the SkyPilot task's envs) plus what the platform sets (Kubeflow Trainer's PET_* for a TrainJob;
the Training Operator's RANK/WORLD_SIZE/MASTER_* and PET_* for a PyTorchJob's Master and Worker; SKYPILOT_* for a
SkyPilot task), one training process per node, the image's paths and the volume mapped onto this machine. The
2-node run trains exactly like one 2-process torchrun run, and every TCP connection seen while it runs is on the
loopback interface (gloo is pinned to lo). SIGTERM to one simulated pod or node (what the kubelet or a preempted
cloud node sends) saves a checkpoint, both nodes exit 75, and the same commands started again resume and end
bit-identical to the uninterrupted run (for a TrainJob that stopped and resumed run is its 2-node run: every
step's loss and the final weights equal the reference's). The mapping of every platform's variables (PyTorchJob's
too) is covered fast in tests/generators/test_node_entry.py.
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
from cluster_helpers import LOOPBACK_ENV, Connections
from safetensors.torch import load_file
from train_helpers import child_env, free_port, launcher_command, read_metrics, run_ok

from hf_scale.commands.cli import main
from hf_scale.config.cluster_section import DEFAULT_IMAGE_HOME
from hf_scale.contract import checkpoint_layout
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.train.checkpoint import store

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
                                                   "--output_dir", str(out)], env={**child_env(), **LOOPBACK_ENV})
    return out


def _container(manifest: dict, kind: str) -> dict:
    """What a node runs: the TrainJob's trainer, the PyTorchJob's container (Master and Worker run the same)."""
    if kind == "trainjob":
        return manifest["spec"]["trainer"]
    master, worker = (manifest["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
                      for role in ("Master", "Worker"))
    assert master["command"] + master["args"] == worker["command"] + worker["args"] and master["env"] == worker["env"]
    return master


def _here(value: str, generated: Path, volume: Path) -> str:
    """A path of the image or the cluster mapped onto this machine: the generated directory, the output volume."""
    return value.replace(DEFAULT_IMAGE_HOME, str(generated)).replace("/output/", f"{volume}/")


def _command(manifest: dict, kind: str, generated: Path, volume: Path) -> list[str]:
    """The manifest's node command (the config's train_args stand in as TRAIN), its paths mapped onto this machine."""
    if kind == "skypilot":  # SkyPilot runs `run` with bash in the synced workdir
        return ["bash", "-c", f"{_here(manifest['run'], generated, volume)} {shlex.join(TRAIN)}"]
    container = _container(manifest, kind)
    return [_here(part, generated, volume) for part in container["command"] + container["args"]] + TRAIN


def _manifest_env(manifest: dict, kind: str, generated: Path, volume: Path) -> dict[str, str]:
    """The env the manifest itself gives every node (HF_HOME on the volume, cluster.env)."""
    if kind == "skypilot":
        pairs = (manifest.get("envs") or {}).items()
    else:
        pairs = ((item["name"], item["value"]) for item in _container(manifest, kind)["env"])
    return {name: _here(str(value), generated, volume) for name, value in pairs}


def _node_env(kind: str, rank: int, port: int, tmp: Path, manifest_env: dict[str, str]) -> dict[str, str]:
    env = child_env()
    env.update(manifest_env)
    env.update(LOOPBACK_ENV, TMPDIR=str(tmp), PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
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


class Nodes:
    """The two simulated nodes of one start, their output in files (nothing blocks on a full pipe while the test
    samples their connections)."""

    def __init__(self, kind: str, generated: Path, volume: Path, tmp: Path) -> None:
        manifest = yaml.safe_load((generated / "launch" / f"job.{'sky' if kind == 'skypilot' else kind}.yaml")
                                  .read_text())
        command = _command(manifest, kind, generated, volume)
        manifest_env = _manifest_env(manifest, kind, generated, volume)
        if kind != "skypilot":
            assert manifest_env["HF_HOME"] == f"{volume}/.cache/huggingface"  # the model cache on the volume
        port = free_port()
        self.logs = [tmp / f"node{rank}-{time.monotonic_ns()}.log" for rank in (0, 1)]
        self.processes = []
        for rank, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.processes.append(subprocess.Popen(
                    command, cwd=generated, env=_node_env(kind, rank, port, tmp, manifest_env), stdout=out,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True))
        self.connections = Connections()

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def sample(self) -> None:
        self.connections.sample([p.pid for p in self.processes if p.poll() is None])

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)

    def finish(self, timeout: float = 420) -> list[tuple[int, str]]:
        """Wait for both nodes (sampling their connections); (exit code, output) of each."""
        deadline = time.monotonic() + timeout
        try:
            while self.running():
                assert time.monotonic() < deadline, "the nodes did not end in time"
                self.sample()
                time.sleep(0.2)
        finally:
            self.kill()
        return [(process.returncode, log.read_text()) for process, log in zip(self.processes, self.logs, strict=True)]


@pytest.mark.parametrize("kind", ["pytorchjob"])  # a TrainJob's run: the SIGTERM test below, from start to end
def test_kubernetes_nodes_train_like_one_two_process_run(kind, generated, reference, tmp_path):
    volume = tmp_path / "volume"
    nodes = Nodes(kind, generated, volume, tmp_path)
    for code, log in nodes.finish():
        assert code == 0, log[-4000:]
    got = [(r["step"], r["loss"]) for r in read_metrics(volume / "job")]
    assert got == [(r["step"], r["loss"]) for r in read_metrics(reference)]  # exact: the same training
    assert len(got) == 30
    assert nodes.connections.seen and not nodes.connections.off_loopback()  # gloo and the rendezvous stayed on lo


@pytest.mark.parametrize("kind", ["skypilot", "trainjob"])
def test_sigterm_to_a_node_checkpoints_exits_75_and_resumes_bit_identically(kind, generated, reference, tmp_path):
    """SkyPilot (a preempted spot node, then the managed job's recovery) and a TrainJob pod (the kubelet's SIGTERM
    before the grace period ends, then the restarted pods with the same PET_* variables)."""
    volume = tmp_path / "volume"
    output = volume / "job"
    nodes = Nodes(kind, generated, volume, tmp_path)
    deadline = time.monotonic() + 300
    try:
        while not store.complete_checkpoints(output):
            assert nodes.running(), [log.read_text()[-3000:] for log in nodes.logs]
            assert time.monotonic() < deadline, "no checkpoint in time"
            nodes.sample()
            time.sleep(0.05)
    except BaseException:
        nodes.kill()
        raise
    nodes.processes[1].send_signal(signal.SIGTERM)  # the node's own PID: what a preempted node's process gets
    results = nodes.finish()
    if all(code == 0 for code, _ in results):
        pytest.fail("the run finished before the stop request; nothing was resumed")
    for code, log in results:
        assert code == EXIT_PREEMPTED, log[-4000:]
    saved = store.complete_checkpoints(output)
    assert saved and checkpoint_layout.step_of(saved[-1]) < 30
    assert not (output / "model.safetensors").exists()  # stopped, not finished

    restarted = Nodes(kind, generated, volume, tmp_path)  # the recovered job / the restarted pods
    logs = []
    for code, log in restarted.finish():
        assert code == 0, log[-4000:]
        logs.append(log)
    assert any("hf_scale: resuming from" in log for log in logs), logs[0][-3000:]
    got, want = load_file(output / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)  # bit-identical final weights
    want_losses = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert {r["step"]: r["loss"] for r in read_metrics(output)} == want_losses
    assert not (nodes.connections.off_loopback() + restarted.connections.off_loopback())
