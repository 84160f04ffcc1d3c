"""`python -m hf_scale.commands.ray_train`: a real local Ray instance on 127.0.0.1, 2 workers over gloo, each running
train.py's own train function, gloo pinned to lo (every TCP connection of the workers is checked to be on the
loopback interface). One Ray run, during which one worker is killed (SIGKILL) after the first checkpoint:
Ray restarts the worker group, train.py resumes from the newest complete checkpoint, and every logged step's loss
and the final weights equal a torchrun --nproc_per_node 2 run of the same config and flags. Parsing is tested in
process."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from cluster_helpers import LOOPBACK_ENV, Connections
from safetensors.torch import load_file
from train_helpers import child_env, free_port, launcher_command, read_metrics, run, run_ok

from hf_scale.commands import ray_train
from hf_scale.commands.cli import main
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store

TRAIN = ["--max_steps", "30", "--save_steps", "5", "--seed", "7", "--learning_rate", "1e-3", "--warmup_ratio", "0",
         "--loop", "accelerate"]
SETS = ["topology.processes_per_machine=2", "precision=no", "batch.micro_batch_size=2",
        "batch.gradient_accumulation_steps=2", "optimizer.lr=1e-3", "cluster.max_restarts=2"]


def _generate(root: Path) -> Path:
    sets = [arg for item in SETS for arg in ("--set", item)]
    assert main(["generate", "--preset", "ddp", *sets, "--name", "ray", "--targets", "ray",
                 "--output-dir", str(root)]) == 0
    return root


def test_parse_adds_the_config_output_dir_and_resume(tmp_path):
    root = _generate(tmp_path)
    config = root / "hf_scale_configs" / "ray.yaml"
    ns, cfg, argv = ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "out", "--max_steps", "3"])
    assert cfg.world_size == 2 and ns.max_failures == ray_train.DEFAULT_MAX_FAILURES
    assert argv[-4:] == ["--max_steps", "3", "--resume_from_checkpoint", "auto"]
    assert argv[argv.index("--output_dir") + 1] == str(Path("out").resolve())
    checkpoint = str(tmp_path / "o" / "checkpoint-5")
    (tmp_path / "o" / "checkpoint-5").mkdir(parents=True)  # an explicit checkpoint must exist (check_flags_alone)
    for flag in ("--resume_from_checkpoint", "--resume-from-checkpoint"):  # any spelling train.py takes
        _, _, given = ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "o", flag, checkpoint])
        assert given[-2:] == [flag, checkpoint] and "auto" not in given
    assert ray_train.scaling(cfg, 0) == {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1}}
    assert ray_train.scaling(cfg, 8)["resources_per_worker"] == {"GPU": 1}
    with pytest.raises(UserError, match="world_size=2 needs 2 GPUs"):
        ray_train.scaling(cfg, 1)
    with pytest.raises(UserError, match="--max_failures=-2"):
        ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "o", "--max_failures", "-2"])
    for grace in ("-1", "nan", "inf"):
        with pytest.raises(UserError, match=f"--preemption_grace_s={grace}.* is invalid: allowed 0 or more seconds"):
            ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "o", "--preemption_grace_s", grace])
    with pytest.raises(UserError, match="--hf_scale_config"):
        ray_train.parse(["--output_dir", "o"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max_steps", "0", "--num_train_epochs", "0"],
         "train.py's arguments: --num_train_epochs=0.0: must be > 0 (or set --max_steps)"),
        (["--resume_from_checkpoint", "/nonexistent"],
         "train.py's arguments: --resume_from_checkpoint=/nonexistent: no such directory"),
        (["--output_dir", ""], "--output_dir='' is empty (an unset variable?): give the run's directory"),
        (["--ray_address="], "--ray_address='' is empty (an unset variable?)"),
        (["--ray_address", " "], "--ray_address=' ' is empty"),
    ],
    ids=["no-steps", "resume-missing", "output-dir-empty", "address-empty", "address-blank"],
)
def test_what_train_py_refuses_at_start_is_refused_by_the_driver(argv, fragment, tmp_path):
    """train.py's own prepare-stage refusals (check_flags_alone) and this module's empty values, decided in the driver:
    a worker's refusal would be a traceback per worker, retried max_failures times."""
    config = _generate(tmp_path) / "hf_scale_configs" / "ray.yaml"
    with pytest.raises(UserError) as refused:
        ray_train.parse(["--hf_scale_config", str(config), "--output_dir", str(tmp_path / "out"), *argv])
    assert fragment in str(refused.value)


SP2 = "strategy: deepspeed\nprecision: 'no'\ndeepspeed: {zero_stage: 2}\ntopology: {processes_per_machine: 2}\n" \
      "parallelism: {sp: 2}\nbatch: {micro_batch_size: 4, gradient_accumulation_steps: 2}\n"


def test_sequence_parallel_runs_the_loop_that_resumes_and_refuses_the_trainer(tmp_path):
    """Ray restarts its workers and each start resumes `auto`: under sp > 1 the manual loop, as the generated
    scripts pass; an explicit --loop trainer (every restart would be refused in every worker) is one line."""
    config = tmp_path / "sp2.yaml"
    config.write_text(SP2)
    base = ["--hf_scale_config", str(config), "--output_dir", str(tmp_path / "out"), "--max_steps", "3"]
    _, _, argv = ray_train.parse(base)
    assert argv[argv.index("--loop") + 1] == "accelerate"
    with pytest.raises(UserError) as refused:
        ray_train.parse([*base, "--loop", "trainer"])
    assert "train.py's arguments: sp=2 with --loop trainer in a job that restarts itself" in str(refused.value)
    assert "use --loop accelerate" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_address_where_nothing_listens_is_refused_within_the_connect_timeout():
    port = free_port()  # nothing listens there: refused at once, not ray.init's endless wait
    with pytest.raises(UserError, match=f"nothing answers at 127.0.0.1:{port} within 2 s .*ray start --head"):
        ray_train.reachable(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(UserError, match=f"nothing answers at 127.0.0.1:{port}"):
        ray_train.reachable(f"ray://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(UserError, match="is invalid: allowed local, auto, HOST:PORT"):
        ray_train.reachable("head:99999")
    with socket.socket() as server:  # a listening head is let through (Ray decides the rest)
        server.bind(("127.0.0.1", 0))
        server.listen()
        ray_train.reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=2)
    ray_train.reachable("auto")
    ray_train.reachable("local")


def _refusal(root: Path, *argv: str, config: str = "ray") -> str:
    """The real module in a process of its own on a machine without GPUs, no Ray address: it must refuse before Ray
    starts (the timeout stands for the hang there was: Ray waiting forever for workers it cannot place)."""
    env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    result = run([sys.executable, "-m", "hf_scale.commands.ray_train", "--hf_scale_config",
                  str(root / "hf_scale_configs" / f"{config}.yaml"), "--output_dir", str(root / "out"), *argv],
                 timeout=180, env=env, cwd=root)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{ray_train.PROG}: error: "), result.stderr
    assert not (root / "out").exists()  # nothing started, nothing written
    return result.stderr


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--bogus"], "train.py's arguments: unrecognized arguments: --bogus"),
        (["--per_device_train_batch_size", "4"], "batch.micro_batch_size=2 but --per_device_train_batch_size=4"),
        (["--max_steps", "many"], "invalid int value: 'many'"),
        (["--ray_num_cpus", "0"], "--ray_num_cpus=0 is invalid: allowed 1 or more"),
        (["--ray_num_cpus", "-1"], "--ray_num_cpus=-1 is invalid"),
        (["--ray_node_ip", "not an ip"], "--ray_node_ip='not an ip' is invalid: allowed an IPv4 or IPv6 address"),
        (["--ray_num_cpus", "1"], "world_size=2 needs 2 CPU workers (one CPU each: this machine has no GPU) but the "
                                  "new local Ray instance offers --ray_num_cpus 1: give --ray_num_cpus 2"),
        (["--ray_address", "ray://head:10001", "--ray_node_ip", "127.0.0.1"],
         "--ray_node_ip sets up a new local Ray instance, but --ray_address/RAY_ADDRESS=ray://head:10001"),
        (["--ray_address", f"127.0.0.1:{free_port()}"], "nothing answers at 127.0.0.1:"),
        pytest.param(["--ray_address", "ray://127.0.0.1:10001"], "connects through Ray Client, which needs pip "
                     "install 'ray[client]'", marks=pytest.mark.skipif(importlib.util.find_spec("grpc") is not None,
                                                                        reason="ray[client] is installed here")),
    ],
    ids=["unknown-flag", "contradiction", "bad-value", "cpus-zero", "cpus-negative", "node-ip", "too-few-cpus",
         "local-flag-with-address", "nothing-listens", "ray-client-missing"],
)
def test_bad_input_is_refused_before_ray_starts(argv, fragment, tmp_path):
    assert fragment in _refusal(_generate(tmp_path), *argv)


def test_more_workers_than_this_machines_cpus_are_refused_before_ray_starts(tmp_path):
    """Without --ray_num_cpus the new instance offers Ray's own count of this machine's CPUs."""
    from ray._private.utils import get_num_cpus

    cpus = get_num_cpus()
    machines = cpus // 2 + 1  # x 2 processes: one worker more than the CPUs at least
    root = _generate(tmp_path)
    assert main(["generate", "--preset", "ddp", "--set", "topology.processes_per_machine=2", "--set",
                 f"topology.num_machines={machines}", "--set", "topology.main_process_ip=10.0.0.1", "--name", "big",
                 "--output-dir", str(root)]) == 0
    error = _refusal(root, config="big")
    assert f"needs {2 * machines} CPU workers" in error and f"this machine's {cpus} CPU(s)" in error
    assert f"give --ray_num_cpus {2 * machines}" in error


def test_what_a_local_instance_cannot_place():
    from hf_scale.config.presets import load_preset

    cfg = load_preset("ddp", ["topology.processes_per_machine=4"])
    ray_train.local_placement(cfg, gpus=0, cpus=4, cpus_given=False)
    ray_train.local_placement(cfg, gpus=4, cpus=1, cpus_given=False)  # a GPU each: the CPUs do not count
    with pytest.raises(UserError, match="needs 4 GPUs \\(one per worker\\); this machine has 2"):
        ray_train.local_placement(cfg, gpus=2, cpus=64, cpus_given=False)
    with pytest.raises(UserError, match="precision=fp8 needs a GPU"):
        ray_train.local_placement(load_preset("ddp", ["precision=fp8"]), gpus=0, cpus=64, cpus_given=False)


def test_a_loopback_node_turns_rays_cluster_mode_off():
    """Ray would replace 127.0.0.1 with the machine's network address (and hand that to the workers as MASTER_ADDR)
    unless its cluster mode is off; the two-worker test below proves the traffic then stays on loopback."""
    assert ray_train.local_only_env("local", "127.0.0.1") == {ray_train.LOCAL_ONLY_ENV: "0"}
    assert ray_train.local_only_env("local", "localhost") == {ray_train.LOCAL_ONLY_ENV: "0"}
    assert ray_train.local_only_env("local", "10.0.0.5") == {}
    assert ray_train.local_only_env("local", None) == {}
    assert ray_train.local_only_env("ray://head:10001", "127.0.0.1") == {}  # an existing cluster: its own settings


def _ray_workers() -> list[psutil.Process]:
    """The Ray Train worker processes (their process title names the actor)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "RayTrainWorker" in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.multiprocess
def test_two_ray_workers_train_like_torchrun_and_survive_a_killed_worker(tmp_path):
    root = _generate(tmp_path / "generated")
    config = root / "hf_scale_configs" / "ray.yaml"
    reference = tmp_path / "torchrun"
    run_ok(launcher_command("torchrun") + TRAIN + ["--hf_scale_config", str(config), "--output_dir", str(reference)])

    output = tmp_path / "ray"
    env = child_env()
    env.update(LOOPBACK_ENV, RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    env.pop("RAY_ADDRESS", None)
    # The generated driver script, on a new local Ray instance bound to the loopback address (its MASTER_ADDR).
    driver = subprocess.Popen(
        ["bash", str(root / "launch" / "ray.ray.sh"), "--ray_node_ip", "127.0.0.1", "--ray_num_cpus", "2",
         "--output_dir", str(output), *TRAIN],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not store.complete_checkpoints(output):
            assert driver.poll() is None, driver.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        workers = _ray_workers()
        assert len(workers) == 2
        connections = Connections()
        connections.sample([worker.pid for worker in workers])  # mid-run: the process group is connected
        assert connections.seen and not connections.off_loopback(), connections.seen
        workers[1].send_signal(signal.SIGKILL)  # a lost worker: Ray restarts the whole group
        assert not (output / "model.safetensors").exists()  # killed mid-run, not after the end
        log, _ = driver.communicate(timeout=420)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 0, log[-6000:]
    assert "hf_scale: resuming from" in log, log[-4000:]  # the restarted group resumed from a checkpoint
    want = {r["step"]: r["loss"] for r in read_metrics(reference)}
    assert {r["step"]: r["loss"] for r in read_metrics(output)} == want  # every step, exactly
    got, ref = load_file(output / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
