"""`python -m hf_scale.ray_train`: a real local Ray instance on 127.0.0.1, 2 workers over gloo, each running
train.py's own train function, gloo pinned to lo (every TCP connection of the workers is checked to be on the
loopback interface). One Ray run, during which one worker is killed (SIGKILL) after the first checkpoint:
Ray restarts the worker group, train.py resumes from the newest complete checkpoint, and every logged step's loss
and the final weights equal a torchrun --nproc_per_node 2 run of the same config and flags. Parsing is tested in
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from cluster_helpers import LOOPBACK_ENV, Connections
from safetensors.torch import load_file
from train_helpers import child_env, launcher_command, read_metrics, run_ok

from hf_scale import ray_train
from hf_scale.cli import main
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import store as checkpoint

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
    _, _, given = ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "o", "--resume_from_checkpoint",
                                   "o/checkpoint-5"])
    assert given.count("--resume_from_checkpoint") == 1
    assert ray_train.scaling(cfg, 0) == {"num_workers": 2, "use_gpu": False, "resources_per_worker": {"CPU": 1}}
    assert ray_train.scaling(cfg, 8)["resources_per_worker"] == {"GPU": 1}
    with pytest.raises(UserError, match="world_size=2 needs 2 GPUs"):
        ray_train.scaling(cfg, 1)
    with pytest.raises(UserError, match="--max_failures=-2"):
        ray_train.parse(["--hf_scale_config", str(config), "--output_dir", "o", "--max_failures", "-2"])
    with pytest.raises(UserError, match="--hf_scale_config"):
        ray_train.parse(["--output_dir", "o"])


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
        while not checkpoint.complete_checkpoints(output):
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
