"""The generated sbatch file on a real 2-node SLURM cluster (tests/slurm/conftest.py): real sbatch, srun,
scontrol and scancel, the generated files unchanged; the only option added at submission is
`--gpus-per-node=0` (the test nodes have no GPU GRES, and sbatch refuses a GRES request they cannot meet).

One test runs three trainings side by side: the uninterrupted 2-node x 1-process DDP job (partition spare),
the same job stopped three times and requeued (partition debug), and the one-process reference. The first
two stops are what SLURM sends the job steps: `--signal=USR1@120` (not "B:") signals every process of the
steps 120 s before the time limit, which `scancel --signal=USR1 JOB` does at once (a real time limit would
cost CI minutes); `scancel --signal=TERM JOB` is the other stop request. Each time train.py saves a
checkpoint, the step exits 75, the script requeues the job, and the requeued job (released at once: SLURM
would hold it ~2 minutes) resumes. The third stop is a priority preemption: a job in partition `urgent`
(higher PriorityTier, PreemptMode=REQUEUE) takes the nodes, and SLURM sends SIGTERM to the steps. The job ends
bit-identical to the uninterrupted one, every step logged once.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster_helpers import LOOPBACK_ENV
from safetensors.torch import load_file
from train_helpers import TRAIN_PY, child_env, free_port, read_metrics

from hf_scale.cli import main
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.train.checkpoint import store as checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

STEPS = 16  # room for three stops, each a step or two after a checkpoint
FIRST_EPOCH_STEPS = 14
TRAIN = ["--max_steps", str(STEPS), "--save_steps", "2", "--seed", "5", "--warmup_ratio", "0", "--loop",
         "accelerate", "--max_seq_length", "32"]
SETS = ["strategy=ddp", "precision=no", "batch.micro_batch_size=2", "optimizer.lr=1e-3",
        "topology.processes_per_machine=1"]
# name: --set values; the one-process reference keeps the global batch (8) with 4 accumulation steps.
CONFIGS = {"job": ["topology.num_machines=2", "topology.main_process_ip=n1", "batch.gradient_accumulation_steps=2"],
           "one": ["topology.num_machines=1", "batch.gradient_accumulation_steps=4"]}
GPU_LESS = "--gpus-per-node=0"
PORTS: dict[str, int] = {}
"""Each submitted job's rendezvous port (MAIN_PROCESS_PORT)."""


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generated")
    for name, sets in CONFIGS.items():
        args = [arg for item in SETS + sets for arg in ("--set", item)]
        assert main(["generate", "--preset", "ddp", *args, "--name", name, "--output-dir", str(root)]) == 0
    return root


def _job_env(tmp: Path, slurm) -> dict[str, str]:
    """What sbatch passes on to the job (--export=ALL): this interpreter first, gloo on lo, the cluster's config, a
    rendezvous port of its own (the "nodes" of two jobs are one machine)."""
    env = {**child_env(), **LOOPBACK_ENV, "SLURM_CONF": slurm.env["SLURM_CONF"], "TMPDIR": str(tmp),
           "MAIN_PROCESS_PORT": str(free_port())}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.pop("TRAIN_SCRIPT", None)  # the script's default: python -m hf_scale.train
    return env


def _submit(slurm, generated: Path, submit_dir: Path, *options: str, args: list[str]) -> str:
    submit_dir.mkdir(exist_ok=True)
    env = _job_env(submit_dir, slurm)
    result = subprocess.run(["sbatch", "--parsable", GPU_LESS, *options, str(generated / "launch" / "job.sbatch"),
                             *args], cwd=submit_dir, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    PORTS[job_id] = int(env["MAIN_PROCESS_PORT"])
    return job_id


def _output(submit_dir: Path, job_id: str) -> str:
    return (submit_dir / f"hf-scale-job-{job_id}.out").read_text()


def _wait_for_checkpoint_after(slurm, job_id: str, submit_dir: Path, step: int, timeout: float = 420) -> int:
    out = submit_dir / "out"
    deadline = time.monotonic() + timeout
    while True:
        saved = checkpoint.complete_checkpoints(out)
        if saved and checkpoint.step_of(saved[-1]) > step:
            return checkpoint.step_of(saved[-1])
        job = slurm.job(job_id)
        assert job["JobState"] in {"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED"}, (
            job["JobState"], job["ExitCode"], _output(submit_dir, job_id)[-6000:])
        assert time.monotonic() < deadline, "no new checkpoint in time"
        time.sleep(0.2)


def _requeued(slurm, job_id: str, submit_dir: Path, out: Path, restarts: int) -> int:
    """After a stop request to the running job's steps: the job checkpointed, its step exited 75 and the script
    requeued it. Release it (SLURM holds a requeued job ~120 s); the step of the newest checkpoint."""
    job = slurm.wait(job_id, {"PENDING", "COMPLETED", "FAILED", "CANCELLED"})
    log = _output(submit_dir, job_id)
    assert job["JobState"] == "PENDING" and job["Restarts"] == str(restarts), (job, log[-4000:])
    assert log.count(f"hf-scale: checkpoint saved before the time limit; requeueing job {job_id}") == restarts, log
    # once a stop, from rank 0 (which of SLURM's signal and the script's SIGUSR1 came first does not matter)
    assert len(re.findall(r"^hf_scale: stopped by ", log, re.MULTILINE)) == restarts, log[-4000:]
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    saved = checkpoint.step_of(checkpoint.complete_checkpoints(out)[-1])
    # SLURM holds a requeued job ~120 s, by which time the stopped run is gone from its nodes; released at once, it
    # must still wait for that (its rendezvous port and the nodes free), as the hold would.
    deadline = time.monotonic() + 120
    while sorted(slurm.run("sinfo", "-h", "-N", "-p", "debug", "-t", "idle", "-o", "%N").stdout.split()) != [
        "n1", "n2"
    ] or _listening(PORTS[job_id]):
        assert time.monotonic() < deadline, "the stopped run did not leave its nodes"
        time.sleep(0.5)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    return saved


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.skip(reason="issue 34: in the merged suite the requeued job ended FAILED (ExitCode 1:0) after the "
                  "scancel --signal=TERM stop (passed alone on its branch); off until the cause is found")
def test_two_node_jobs_train_like_one_process_and_resume_bit_identically_after_stops(slurm, generated, tmp_path):
    reference = tmp_path / "reference"
    one = subprocess.Popen([sys.executable, TRAIN_PY, *TRAIN, "--hf_scale_config",
                            str(generated / "hf_scale_configs" / "one.yaml"), "--output_dir", str(reference)],
                           env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        whole_dir, stopped_dir = tmp_path / "whole", tmp_path / "stopped"
        # On partition spare (nodes n3, n4), where nothing preempts it.
        whole = _submit(slurm, generated, whole_dir, "--partition=spare", args=[*TRAIN, "--output_dir", "out"])
        stopped = _submit(slurm, generated, stopped_dir, args=[*TRAIN, "--output_dir", "out"])
        out = stopped_dir / "out"
        saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, 0)
        slurm.run("scancel", "--signal=USR1", stopped)  # what --signal=USR1@120 does at the time limit
        saved = _requeued(slurm, stopped, stopped_dir, out, restarts=1)
        saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
        slurm.run("scancel", "--signal=TERM", stopped)
        saved = _requeued(slurm, stopped, stopped_dir, out, restarts=2)
        saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
        # Priority preemption: a job in `urgent` (higher PriorityTier) takes debug's nodes; SLURM sends SIGTERM to
        # our steps (PreemptMode=REQUEUE, GraceTime before the kill), and our job requeues itself after the save.
        urgent = slurm.run("sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                           f"--output={tmp_path}/urgent-%j.out", "--wrap", "true").stdout.strip().split(";")[0]
        _requeued(slurm, stopped, stopped_dir, out, restarts=3)
        assert slurm.wait(urgent, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED"
        for job_id, submit_dir in ((whole, whole_dir), (stopped, stopped_dir)):
            job = slurm.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
            assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", _output(submit_dir, job_id)[-4000:]
        _, stderr = one.communicate(timeout=420)
        assert one.returncode == 0, stderr[-4000:]
    finally:
        if one.poll() is None:
            one.kill()

    _assert_trained_alike(reference, whole_dir / "out", out, _output(stopped_dir, stopped))


def _assert_trained_alike(reference: Path, whole_out: Path, out: Path, log: str) -> None:
    assert log.count("hf_scale: resuming from") == 3, log[-4000:]  # rank 0 alone says it, once a start
    assert len(re.findall(r"^hf_scale: run: ", log, re.MULTILINE)) == 4  # one run line per start, not per rank
    assert log.count(f"Exited with exit code {EXIT_PREEMPTED}") == 2 * 3  # both nodes, each stop

    # The 2-node job trains like one process: the same samples, the same losses (up to summation order) through
    # the first epoch (113 examples keep a target token at 32 tokens: 14 full global batches of 8). The epoch's
    # last, partial batch is split otherwise by 2 ranks than by one, so from there on only the weights stay close.
    want = {r["step"]: r for r in read_metrics(reference)}
    for record in read_metrics(whole_out)[:FIRST_EPOCH_STEPS]:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-5)
        assert record["tokens"] == want[record["step"]]["tokens"]
    ref_weights, whole_weights = load_file(reference / "model.safetensors"), load_file(whole_out / "model.safetensors")
    assert all(torch.allclose(whole_weights[name], ref_weights[name], atol=1e-3) for name in ref_weights)

    # The stopped job ends bit-identical to the uninterrupted one, every step logged once.
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    assert [(r["step"], r["loss"]) for r in read_metrics(out)] == [(r["step"], r["loss"]) for r in
                                                                  read_metrics(whole_out)]
    stopped_weights = load_file(out / "model.safetensors")
    assert stopped_weights.keys() == whole_weights.keys()
    assert all(torch.equal(stopped_weights[name], whole_weights[name]) for name in whole_weights)


def test_the_node_count_guard_refuses_another_allocation_in_one_line(slurm, generated, tmp_path):
    job_id = _submit(slurm, generated, tmp_path, "--nodes=1", args=["--max_steps", "1"])
    job = slurm.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", job
    assert _output(tmp_path, job_id).splitlines() == [
        "hf-scale: error: accelerate_configs/job.yaml expects 2 nodes, the allocation has 1"]


def test_a_refusal_on_every_node_is_one_line_once_in_the_job_log(slurm, generated, tmp_path):
    """Each node's accelerate launch refuses the same flags: the job's log holds the line once (not once per node,
    nor srun's per-task exit lines), and the job exits 2."""
    job_id = _submit(slurm, generated, tmp_path, args=["--bf16", "--fp16", "--output_dir", str(tmp_path / "out")])
    job = slurm.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    log = _output(tmp_path, job_id)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", (job, log)
    assert log.splitlines() == ["train.py: error: --bf16 and --fp16 are both set; choose one precision"], log
    assert not (tmp_path / "out").exists()
