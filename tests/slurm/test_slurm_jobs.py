"""The generated sbatch file on a real 2-node SLURM cluster (tests/slurm/conftest.py): real sbatch, srun,
scontrol and scancel, the generated files unchanged; the only option added at submission is
`--gpus-per-node=0` (the test nodes have no GPU GRES, and sbatch refuses a GRES request they cannot meet).

The module's trainings run side by side (`started`): the one-process reference, the uninterrupted 2-node x
1-process DDP job and the 2-node ZeRO-2 job (partition spare, where nothing preempts them), and the DDP job that
is stopped over and over (partition debug). Its stops, each after a checkpoint of the current start:
1. a real time limit: the job is submitted with `--time` two minutes over the generated `--signal=USR1@120` lead,
   so that SLURM itself sends USR1 (not "B:": to every process of the steps) 2-2.5 minutes into the job (slurmctld
   looks at time limits every 30 s), when it trains, and the save has the lead's 120 s; the later starts run
   without a limit (`scontrol update TimeLimit=UNLIMITED`);
2. `scancel --signal=TERM`, the other stop request;
3. `scontrol requeue`: SLURM itself ends the running job (SIGTERM to every process, the batch shell included,
   SIGKILL after KillWait) and queues it again;
4. a priority preemption: a job in partition `urgent` (higher PriorityTier, PreemptMode=REQUEUE) takes the nodes,
   and SLURM sends SIGTERM to the steps (GraceTime before the kill);
5. a lost node: SIGKILL to the training process of node n2. The job ends non-zero in bounded time, nothing of it
   is left running, the newest complete checkpoint verifies, and the job submitted again resumes from it.
After stops 1-4 train.py has saved a checkpoint and the job is queued again (released at once: SLURM would hold
it ~2 minutes). The job ends bit-identical to the uninterrupted one, every step logged once.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from cluster_helpers import LOOPBACK_ENV
from safetensors.torch import load_file
from train_helpers import TRAIN_PY, child_env, free_port, prebuilt_shm_comm_op, read_metrics

from hf_scale.commands.cli import main
from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.train.checkpoint import store

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

STEPS = 40  # five stops, each a few steps after a checkpoint of its start, and steps left after the last
FIRST_EPOCH_STEPS = 14
TRAIN = ["--max_steps", str(STEPS), "--save_steps", "2", "--seed", "5", "--warmup_ratio", "0", "--loop",
         "accelerate", "--max_seq_length", "32"]
SETS = ["precision=no", "batch.micro_batch_size=2", "optimizer.lr=1e-3", "topology.processes_per_machine=1"]
TWO_NODES = ["topology.num_machines=2", "topology.main_process_ip=n1", "batch.gradient_accumulation_steps=2"]
# name: (preset, --set values); the one-process reference keeps the global batch (8) with 4 accumulation steps.
CONFIGS = {"job": ("ddp", ["strategy=ddp", *TWO_NODES]),
           "zero2": ("zero2", TWO_NODES),
           "one": ("ddp", ["strategy=ddp", "topology.num_machines=1", "batch.gradient_accumulation_steps=4"])}
GPU_LESS = "--gpus-per-node=0"
NODE_LOSS_BOUND_S = 120
"""How soon a job whose node died must end: gloo sees the peer's sockets close at once; never the 30-minute
collective timeout."""
PORTS: dict[str, int] = {}
"""Each submitted job's rendezvous port (MAIN_PROCESS_PORT)."""


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generated")
    for name, (preset, sets) in CONFIGS.items():
        args = [arg for item in SETS + sets for arg in ("--set", item)]
        assert main(["generate", "--preset", preset, *args, "--name", name, "--output-dir", str(root)]) == 0
    return root


class Started(NamedTuple):
    root: Path
    reference: subprocess.Popen
    whole: str
    zero2: str


@pytest.fixture(scope="module")
def started(slurm, generated, tmp_path_factory):
    """The runs that nothing interrupts, started at once so that they train while the stopped job is stopped."""
    root = tmp_path_factory.mktemp("jobs")
    reference = subprocess.Popen([sys.executable, TRAIN_PY, *TRAIN, "--hf_scale_config",
                                  str(generated / "hf_scale_configs" / "one.yaml"), "--output_dir",
                                  str(root / "reference")], env=child_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    try:
        whole = _submit(slurm, generated, root / "whole", "--partition=spare", args=[*TRAIN, "--output_dir", "out"])
        # DeepSpeed's CPU comm op, built once (as a node would have it), so that no job step compiles it.
        extensions = prebuilt_shm_comm_op(root / "torch_extensions")
        zero2 = _submit(slurm, generated, root / "zero2", "--partition=spare", name="zero2",
                        env={"TORCH_EXTENSIONS_DIR": str(extensions)}, args=[*TRAIN, "--output_dir", "out"])
        yield Started(root, reference, whole, zero2)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()


def _reference(started: Started) -> Path:
    _, stderr = started.reference.communicate(timeout=600)
    assert started.reference.returncode == 0, stderr[-4000:]
    return started.root / "reference"


def _finished(slurm, job_id: str, submit_dir: Path) -> Path:
    job = slurm.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=600)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (
        job, _output(submit_dir, job_id)[-4000:] + slurm.logs())
    return submit_dir / "out"


def _job_env(tmp: Path, slurm) -> dict[str, str]:
    """What sbatch passes on to the job (--export=ALL): this interpreter first, gloo on lo, the cluster's config, a
    rendezvous port of its own (the "nodes" of two jobs are one machine)."""
    env = {**child_env(), **LOOPBACK_ENV, "SLURM_CONF": slurm.env["SLURM_CONF"], "TMPDIR": str(tmp),
           "MAIN_PROCESS_PORT": str(free_port())}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.pop("TRAIN_SCRIPT", None)  # the script's default: python -m hf_scale.train
    return env


def _submit(slurm, generated: Path, submit_dir: Path, *options: str, args: list[str], name: str = "job",
            env: dict[str, str] | None = None) -> str:
    submit_dir.mkdir(exist_ok=True)
    env = {**_job_env(submit_dir, slurm), **(env or {})}
    result = subprocess.run(["sbatch", "--parsable", GPU_LESS, *options, str(generated / "launch" / f"{name}.sbatch"),
                             *args], cwd=submit_dir, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    PORTS[job_id] = int(env["MAIN_PROCESS_PORT"])
    return job_id


def _output(submit_dir: Path, job_id: str) -> str:
    return next(submit_dir.glob(f"hf-scale-*-{job_id}.out")).read_text()


def _wait_for_checkpoint_after(slurm, job_id: str, submit_dir: Path, step: int, timeout: float = 420) -> int:
    out = submit_dir / "out"
    deadline = time.monotonic() + timeout
    while True:
        saved = store.complete_checkpoints(out)
        if saved and checkpoint_layout.step_of(saved[-1]) > step:
            return checkpoint_layout.step_of(saved[-1])
        job = slurm.job(job_id)
        assert job["JobState"] in {"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED"}, (
            job, _output(submit_dir, job_id)[-6000:] + slurm.logs())
        assert time.monotonic() < deadline, "no new checkpoint in time" + slurm.logs()
        time.sleep(0.2)


def _requeued(slurm, job_id: str, submit_dir: Path, out: Path, restarts: int, **update: str) -> int:
    """After a stop of the running job: the job checkpointed, ended and is queued again (by its script after the
    step's exit 75, or by SLURM). Release it (SLURM holds a requeued job ~120 s), with `update`'s job settings
    changed; the step of the newest checkpoint."""
    job = slurm.wait(job_id, {"PENDING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    log = _output(submit_dir, job_id)
    assert job["JobState"] == "PENDING" and job["Restarts"] == str(restarts), (job, log[-4000:] + slurm.logs())
    # once a stop, from rank 0 (which of SLURM's signal and the script's SIGUSR1 came first does not matter)
    assert len(re.findall(r"^hf_scale: stopped by ", log, re.MULTILINE)) == restarts, log[-4000:]
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    saved = checkpoint_layout.step_of(store.complete_checkpoints(out)[-1])
    _wait_until_gone(slurm, job_id)
    slurm.run("scontrol", "update", f"JobId={job_id}", *(f"{key}={value}" for key, value in update.items()),
              "StartTime=now")
    return saved


def _wait_until_gone(slurm, job_id: str) -> None:
    """SLURM holds a requeued job ~120 s, by which time the stopped run is gone from its nodes; a job released at
    once, or submitted again, must still wait for that (its rendezvous port and the nodes free), as the hold
    would."""
    deadline = time.monotonic() + 120
    while sorted(slurm.run("sinfo", "-h", "-N", "-p", "debug", "-t", "idle", "-o", "%N").stdout.split()) != [
        "n1", "n2"
    ] or _listening(PORTS[job_id]) or _job_processes(slurm, job_id):
        assert time.monotonic() < deadline, "the stopped run did not leave its nodes"
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _job_processes(slurm, job_id: str) -> dict[int, dict[str, str]]:
    """The processes of this cluster's job on every "node" (all are this machine): pid -> environment, read from
    /proc (another cluster on the machine numbers its jobs alike: its SLURM_CONF differs)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue  # ended meanwhile
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_CONF") == slurm.env["SLURM_CONF"]:
            found[int(entry.name)] = env
    return found


def _kill_node(slurm, job_id: str, node: str) -> list[int]:
    """SIGKILL to the training processes (the launcher's children: they have LOCAL_RANK) of one node of the job."""
    pids = [pid for pid, env in _job_processes(slurm, job_id).items()
            if env.get("SLURMD_NODENAME") == node and "LOCAL_RANK" in env]
    assert pids, f"no training process of job {job_id} on {node}"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


@pytest.mark.skip(reason="issue 34: not yet seen passing 3 runs in a row (a project rule before it runs in CI); "
                  "one cause of failure found and fixed (the fifth start's resume line was counted before that "
                  "start printed it); a failure seen earlier (the start after the TERM requeue FAILED 1:0, no "
                  "output) not reproduced; a failed run now keeps the cluster's folder and prints its logs. Run on a "
                  "quiet machine (2026-11-28) it fails at its first stop: the 40-step job finished in ~10 s, before "
                  "SLURM's time-limit USR1 (1-2.5 min after the start), so the job must outlast the signal's lead")
def test_a_two_node_job_stopped_five_ways_resumes_bit_identically(slurm, generated, started, tmp_path):
    stopped_dir = tmp_path / "stopped"
    lead_s = int(re.search(r"^#SBATCH --signal=USR1@(\d+)$", (generated / "launch" / "job.sbatch").read_text(),
                           re.MULTILINE)[1])
    stopped = _submit(slurm, generated, stopped_dir, f"--time={lead_s // 60 + 2}",
                      args=[*TRAIN, "--output_dir", "out"])
    out = stopped_dir / "out"
    slurm.wait(stopped, {"RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})  # started (PENDING: not yet)
    # The time limit: SLURM sends USR1 `lead_s` before it; the job saves, exits 75 and requeues itself.
    saved = _requeued(slurm, stopped, stopped_dir, out, restarts=1, TimeLimit="UNLIMITED")
    assert "hf_scale: stopped by SIGUSR1;" in _output(stopped_dir, stopped)
    saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
    slurm.run("scancel", "--signal=TERM", stopped)
    saved = _requeued(slurm, stopped, stopped_dir, out, restarts=2)
    saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
    slurm.run("scontrol", "requeue", stopped)  # SLURM ends the running job itself and queues it again
    saved = _requeued(slurm, stopped, stopped_dir, out, restarts=3)
    saved = _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
    # Priority preemption: a job in `urgent` (higher PriorityTier) takes debug's nodes; SLURM sends SIGTERM to
    # our steps (PreemptMode=REQUEUE, GraceTime before the kill), and our job requeues itself after the save.
    urgent = slurm.run("sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                       f"--output={tmp_path}/urgent-%j.out", "--wrap", "true").stdout.strip().split(";")[0]
    saved = _requeued(slurm, stopped, stopped_dir, out, restarts=4)
    assert slurm.wait(urgent, {"COMPLETED", "FAILED", "CANCELLED"})["JobState"] == "COMPLETED"

    # A lost node: n2's training process killed. The job ends non-zero soon, nothing of it is left running, and the
    # newest complete checkpoint verifies.
    _wait_for_checkpoint_after(slurm, stopped, stopped_dir, saved)
    _kill_node(slurm, stopped, "n2")
    lost_at = time.monotonic()
    job = slurm.wait(stopped, {"COMPLETED", "FAILED", "CANCELLED", "PENDING"}, timeout=NODE_LOSS_BOUND_S + 60)
    assert time.monotonic() - lost_at < NODE_LOSS_BOUND_S, job
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", (
        job, _output(stopped_dir, stopped)[-4000:] + slurm.logs())
    _wait_until_gone(slurm, stopped)  # the step's processes end with it (bounded by the same wait)
    log = _output(stopped_dir, stopped)  # its five starts, the fifth's resume line included
    newest, skipped = checkpoint_verification.newest_verified(out)
    assert newest == store.complete_checkpoints(out)[-1] and not skipped, (newest, skipped)
    # Submitted again, it resumes from that checkpoint and finishes.
    again = _submit(slurm, generated, stopped_dir, args=[*TRAIN, "--output_dir", "out"])
    _finished(slurm, again, stopped_dir)
    assert f"hf_scale: resuming from out/{newest.name}" in _output(stopped_dir, again)

    whole_out = _finished(slurm, started.whole, started.root / "whole")
    _assert_stopped_log(log)
    # The stopped job ends bit-identical to the uninterrupted one, every step logged once.
    assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))
    assert [(r["step"], r["loss"]) for r in read_metrics(out)] == [(r["step"], r["loss"]) for r in
                                                                  read_metrics(whole_out)]
    stopped_weights, whole_weights = load_file(out / "model.safetensors"), load_file(whole_out / "model.safetensors")
    assert stopped_weights.keys() == whole_weights.keys()
    assert all(torch.equal(stopped_weights[name], whole_weights[name]) for name in whole_weights)


def _assert_stopped_log(log: str) -> None:
    """What the stopped job printed over its five starts, four of them stopped."""
    assert log.count("hf_scale: resuming from") == 4, log[-4000:]  # rank 0 alone says it, once a start
    assert len(re.findall(r"^hf_scale: run: ", log, re.MULTILINE)) == 5  # one run line per start, not per rank
    # The steps exit 75 on each stop; the script requeues on it, except after `scontrol requeue` (SLURM requeued
    # the job and ended the batch shell).
    assert log.count(f"Exited with exit code {EXIT_PREEMPTED}") == 2 * 4, log
    assert log.count("hf-scale: checkpoint saved before the time limit; requeueing job") == 3, log
    # SLURM signals every process of a step, the launcher too: it leaves the stop to the training processes.
    assert "death signal" not in log and "SignalException" not in log, log


@pytest.mark.parametrize("job", ["whole", "zero2"])
def test_a_two_node_job_trains_like_one_process(slurm, started, job):
    """DDP and ZeRO-2 on 2 nodes x 1 process: the same samples, losses and gradient norms (up to summation order) as
    one process through the first epoch (113 examples keep a target token at 32 tokens: 14 full global batches of
    8), and the DDP job's weights after it (checkpoint-14) those of one process. Each epoch's last, partial batch
    is filled on 2 ranks by accelerate's even_batches with samples from the epoch's start (see
    hf_scale/train/data/batches.py), so from there on the one process trains otherwise; the ZeRO-2 job, dealt the
    same samples as the DDP job, keeps its losses and weights to the end."""
    submit_dir = started.root / job
    out = _finished(slurm, getattr(started, job), submit_dir)
    reference = _reference(started)
    want = {r["step"]: r for r in read_metrics(reference)}
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for record in got[:FIRST_EPOCH_STEPS]:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(want[record["step"]]["grad_norm"], rel=1e-4)
        assert record["tokens"] == want[record["step"]]["tokens"]
    assert len(re.findall(r"^hf_scale: run: ", _output(submit_dir, getattr(started, job)), re.MULTILINE)) == 1
    if job == "whole":
        weights, like = (load_file(path / f"checkpoint-{FIRST_EPOCH_STEPS}" / "model.safetensors")
                         for path in (out, reference))
    else:
        ddp = _finished(slurm, started.whole, started.root / "whole")
        for record, ddp_record in zip(got, read_metrics(ddp), strict=True):
            assert record["loss"] == pytest.approx(ddp_record["loss"], rel=1e-5)
            assert record["grad_norm"] == pytest.approx(ddp_record["grad_norm"], rel=1e-4)
        weights, like = load_file(out / "model.safetensors"), load_file(ddp / "model.safetensors")
    assert weights.keys() == like.keys()
    assert all(torch.allclose(weights[name], like[name], rtol=0, atol=1e-5) for name in like)


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
