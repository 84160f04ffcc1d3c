"""Tensor parallelism in train.py's manual loop, real processes on CPU (gloo): the tiny Llama built on the mesh by
transformers (DTensor weights; train.py's runtime guard checks the model's tp_size), each data-parallel group
on its own data, the ranks of one TP group on the same batches.

The Trainer (`--loop trainer`) runs the same layouts: tp=2 (packed too) and dp_shard=2 x tp=2 give the one-process
Trainer's per-step losses and gradient norms, and its tp=2 checkpoint (DCP shards written by HfScaleTrainer, since
transformers' Trainer has no writer for a mesh-built model's optimizer state) resumes bit-identically.

Every run trains 5 steps of a global batch of 8 (one process: micro 8; tp=2: micro 4 x accumulation 2 on one
data-parallel rank; dp_shard=2 x tp=2: micro 2 x accumulation 2 on two) and must give the one-process per-step
losses, gradient norms, token counts and eval losses (rtol 1e-4), pass train.py's own save check and save a model
with the one-process model's logits. The tp=2 run saves checkpoint-3, which must resume at tp=2 bit-identically,
resume at dp_shard=2 (FSDP2, DCP resharding) with the uninterrupted losses, and export to Hub safetensors; the
dp_shard=2 x tp=2 run's checkpoint resumes on 2 processes at tp=2. HSDP x TP is not run here: with dp_shard=1
accelerate refuses TP over pure replication, so it needs dp_replicate=2 x dp_shard=2 x tp=2 = 8 processes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import (
    PROBE_IDS,
    REPO,
    assert_saved_model_verified,
    child_env,
    free_port,
    generate_config,
    launcher_command,
    logits,
    read_eval_metrics,
    read_metrics,
    run,
    run_ok,
    training_traceback_frames,
)
from transformers import AutoModelForCausalLM

from hf_scale.contract import checkpoint_layout, checkpoint_verification

pytestmark = pytest.mark.multiprocess

STEPS = 5
MIXTURE = REPO / "tests" / "data" / "mixture"
COMMON = ["--max_steps", str(STEPS), "--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0",
          "--lr_scheduler_type", "linear", "--max_grad_norm", "1.0",
          "--train_file", str(MIXTURE / "qa.jsonl"), str(MIXTURE / "chat.jsonl"), "--mixture_weights", "0.75", "0.25",
          "--validation_file", str(MIXTURE / "validation.jsonl"), "--eval_strategy", "steps", "--eval_steps", "3"]
PACKED = ["--packing", "--max_seq_length", "128"]
TP2 = "strategy: ddp\nprecision: 'no'\ntopology: {processes_per_machine: 2}\nparallelism: {tp: 2}\n" \
      "batch: {micro_batch_size: 4, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"
FSDP2 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 2}\n" \
        "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"
FSDP2_TP2 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 4}\nparallelism: {tp: 2}\n" \
            "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"


def _train(out, flags: list[str], *, nproc: int = 1, config: str | None = None,
           loop: str = "accelerate") -> subprocess.CompletedProcess:
    command = launcher_command("python") if nproc == 1 else launcher_command("torchrun", nproc=nproc)
    if config is not None:
        path = out.parent / f"{out.name}-config.yaml"
        path.write_text(config)
        flags = flags + ["--hf_scale_config", str(path)]
    return run_ok(command + COMMON + flags + ["--loop", loop, "--output_dir", str(out)], env=child_env(), timeout=600)


def _assert_same_run(out, reference_dir) -> None:
    got, want = read_metrics(out), read_metrics(reference_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    # The gradient norm over every rank's shards (Adam's update would hide a wrong gradient scale; the norm does not)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]  # each data-parallel rank's rows once
    got_eval, want_eval = read_eval_metrics(out), read_eval_metrics(reference_dir)
    assert [r["eval_tokens"] for r in got_eval] == [r["eval_tokens"] for r in want_eval]
    assert [r["eval_loss"] for r in got_eval] == pytest.approx([r["eval_loss"] for r in want_eval], rel=1e-4)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "reference"
    _train(out, ["--per_device_train_batch_size", "8"])
    return out


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    """tp=2 on 2 processes, checkpoint-3 kept (--save_steps 3)."""
    out = tmp_path_factory.mktemp("tp") / "tp2"
    result = _train(out, ["--save_steps", "3"], nproc=2, config=TP2)
    assert "ddp (tp=2) on 2 process(es)" in result.stderr
    return out


def test_tp2_equals_one_process(tp_dir, reference_dir):
    _assert_same_run(tp_dir, reference_dir)
    assert_saved_model_verified(tp_dir, like=reference_dir)


def test_dp_shard2_x_tp2_on_four_processes_equals_one_process_and_resumes_on_two(reference_dir, tmp_path):
    """FSDP2 over dp_shard=2 and TP over tp=2 on one mesh (transformers applies both at load); its checkpoint-3
    resumes on 2 processes at tp=2 (4 -> 2 processes, DCP resharding) with the uninterrupted losses."""
    out = tmp_path / "fsdp2_tp2"
    result = _train(out, ["--save_steps", "3"], nproc=4, config=FSDP2_TP2)
    assert "fsdp (dp_shard=2 x tp=2) on 4 process(es)" in result.stderr
    _assert_same_run(out, reference_dir)
    assert_saved_model_verified(out, like=reference_dir)
    want = {r["step"]: r for r in read_metrics(out)}
    resumed = _resume(out, tmp_path / "on_two", TP2)
    assert [r["step"] for r in resumed] == [4, 5]
    for record in resumed:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)
        assert record["tokens"] == want[record["step"]]["tokens"]


def test_tp2_packed_equals_one_packed_process(tmp_path):
    reference, out = tmp_path / "packed_reference", tmp_path / "packed_tp2"
    _train(reference, PACKED + ["--per_device_train_batch_size", "8"])
    _train(out, PACKED, nproc=2, config=TP2)
    _assert_same_run(out, reference)


def _resume(tp_dir, out, config: str, loop: str = "accelerate") -> list[dict]:
    out.mkdir()
    shutil.copytree(tp_dir / "checkpoint-3", out / "checkpoint-3")
    result = _train(out, ["--resume_from_checkpoint", "auto"], nproc=2, config=config, loop=loop)
    assert f"resuming from {out / 'checkpoint-3'}" in result.stderr
    return read_metrics(out)


def test_tp2_checkpoint_resumes_exactly_and_at_dp_shard2(tp_dir, tmp_path):
    """Same layout: bit-identical continuation. tp=2 -> dp_shard=2 (FSDP2): DCP reshards the DTensor shards; the
    uninterrupted losses to rtol 1e-4 (another reduction order) and the same samples."""
    want = {r["step"]: r for r in read_metrics(tp_dir)}
    same = _resume(tp_dir, tmp_path / "same", TP2)
    assert [r["step"] for r in same] == [4, 5]
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in same] == [
        (want[s]["loss"], want[s]["grad_norm"], want[s]["lr"]) for s in (4, 5)]
    other = _resume(tp_dir, tmp_path / "fsdp2", FSDP2)
    assert [r["step"] for r in other] == [4, 5]
    for record in other:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)
        assert record["tokens"] == want[record["step"]]["tokens"]


FULL_DISK = 600_000
"""The launcher's RLIMIT_FSIZE (inherited by every rank): a file may grow to 600 kB, the kernel refuses more (EFBIG;
Python ignores SIGXFSZ) — a real limit standing in for a full disk. The model's files fit; each rank's DCP shard of
the model and its Adam state does not."""


@pytest.mark.parametrize(("config", "loop", "saved", "failing"), [
    (TP2, "accelerate", "tp_dir", 4), (FSDP2, "accelerate", "tp_dir", 4),
    # The Trainer resumes checkpoint-3's TrainerState, save_steps=3 included (transformers 5.24 trainer.py,
    # _inner_training_loop: load_from_json after compute_steps; it only warns about the differing --save_steps):
    # its first save after the resume is the end-of-training one, checkpoint-5.
    (TP2, "trainer", "trainer_tp_dir", 5)], ids=["tp2", "fsdp2", "trainer-tp2"])
def test_a_full_disk_during_a_sharded_save_is_one_line_and_keeps_the_intact_checkpoint(config, loop, saved, failing,
                                                                                       request, tmp_path):
    """A sharded save (torch.distributed.checkpoint, every rank writing its shards) that cannot write, in the manual
    loop (tp=2, and FSDP2 resharded from tp=2) and in the Trainer (HfScaleTrainer's DCP shards): DCP raises every
    rank's failure on every rank; each says the same line (the generated scripts print it once), no traceback, and
    checkpoint-3 stays the newest checkpoint, nothing half-written published."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(request.getfixturevalue(saved) / "checkpoint-3", out / "checkpoint-3")
    path = tmp_path / "config.yaml"
    path.write_text(config)
    result = run(launcher_command("torchrun") + COMMON + [
        "--hf_scale_config", str(path), "--resume_from_checkpoint", "auto", "--save_steps", "1", "--loop", loop,
        "--output_dir", str(out)], env=child_env(), timeout=600, file_size_limit=FULL_DISK)
    assert result.returncode != 0, result.stderr[-3000:]
    assert training_traceback_frames(result.stderr) == [] and "CheckpointException" not in result.stderr, \
        result.stderr[-4000:]
    lines = set(re.findall(r"train\.py: error: [^\n]*", result.stderr))
    assert len(lines) == 1, result.stderr[-4000:]
    (line,) = lines
    assert f"train.py: error: saving checkpoint-{failing} failed (rank " in line, line
    assert f"the newest intact checkpoint is {out / 'checkpoint-3'}" in line and "GiB free" in line, line
    assert [p.name for p in checkpoint_layout.complete_checkpoints(out)] == ["checkpoint-3"]
    assert checkpoint_verification.verify(out / "checkpoint-3") is None


def test_export_of_a_tp2_checkpoint_loads_with_the_trained_logits(tp_dir, tmp_path):
    out = tmp_path / "exported"
    run_ok([sys.executable, "-m", "hf_scale", "export", str(tp_dir), str(out)], timeout=180)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        got = model(input_ids=PROBE_IDS).logits.float()
    torch.testing.assert_close(got, logits(tp_dir), rtol=1e-5, atol=1e-5)


# --- the Trainer --------------------------------------------------------------------------------------------


def _assert_resumes_exactly(saved_dir, resumed: list[dict]) -> None:
    want = {r["step"]: r for r in read_metrics(saved_dir)}
    assert [r["step"] for r in resumed] == [4, 5]
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in resumed] == [
        (want[s]["loss"], want[s]["grad_norm"], want[s]["lr"]) for s in (4, 5)]


@pytest.fixture(scope="module")
def trainer_tp_dir(tmp_path_factory):
    """The Trainer at tp=2 on 2 processes, checkpoint-3 kept (--save_steps 3)."""
    out = tmp_path_factory.mktemp("tp") / "trainer_tp2"
    result = _train(out, ["--save_steps", "3"], nproc=2, config=TP2, loop="trainer")
    assert "ddp (tp=2) on 2 process(es) (torchrun), trainer loop" in result.stderr
    return out


def test_trainer_tp2_equals_one_process_and_its_checkpoint_resumes_exactly(trainer_tp_dir, tmp_path):
    reference, out = tmp_path / "trainer_reference", trainer_tp_dir
    _train(reference, ["--per_device_train_batch_size", "8"], loop="trainer")
    _assert_same_run(out, reference)
    assert_saved_model_verified(out, like=reference)
    assert (out / "checkpoint-3" / "fsdp_sharded").is_dir()  # the optimizer state the Trainer cannot write
    _assert_resumes_exactly(out, _resume(out, tmp_path / "resumed", TP2, loop="trainer"))


def test_trainer_dp_shard2_x_tp2_on_four_processes_equals_one_process(reference_dir, tmp_path):
    """transformers applies FSDP2 over dp_shard and TP over tp at load; the Trainer trains the mesh-built model."""
    out = tmp_path / "trainer_fsdp2_tp2"
    result = _train(out, [], nproc=4, config=FSDP2_TP2, loop="trainer")
    assert "fsdp (dp_shard=2 x tp=2) on 4 process(es) (torchrun), trainer loop" in result.stderr
    _assert_same_run(out, reference_dir)


def test_trainer_tp2_packed_equals_one_packed_trainer_process(tmp_path):
    reference, out = tmp_path / "trainer_packed_reference", tmp_path / "trainer_packed_tp2"
    _train(reference, PACKED + ["--per_device_train_batch_size", "8"], loop="trainer")
    _train(out, PACKED, nproc=2, config=TP2, loop="trainer")
    _assert_same_run(out, reference)


def test_trainer_tp2_loads_the_best_checkpoint_at_the_end_on_every_rank(tmp_path):
    """--load_best_model_at_end with TP: the best checkpoint's DCP shards are loaded into the mesh-built model (the
    Trainer would read its safetensors into the DTensors), on every rank (each records the published name)."""
    out = tmp_path / "best"
    _train(out, ["--save_steps", "3", "--load_best_model_at_end", "--metric_for_best_model", "eval_loss",
                 "--greater_is_better", "true"], nproc=2, config=TP2, loop="trainer")  # best: step 3's, not the last
    exported = tmp_path / "exported"
    run_ok([sys.executable, "-m", "hf_scale", "export", str(out / "checkpoint-3"), str(exported)], timeout=180)
    torch.testing.assert_close(logits(out), logits(exported), rtol=0, atol=0)


# --- the generated launch script (accelerate launch with a parallelism_config) ---------------------------------


def _run_generated(tmp_path, name: str, preset: str, sets: list[str], flags: list[str]) -> Path:
    """`hf-scale generate`, then its `launch/NAME.accelerate.sh` with train.py (accelerate launch with the YAML's
    parallelism_config and --hf_scale_config)."""
    generated = generate_config(tmp_path / "generated", name, preset=preset, sets=sets)
    out = tmp_path / f"{name}-run"
    env = {**child_env(), "TRAIN_SCRIPT": str(REPO / "train.py"), "MAIN_PROCESS_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = run_ok(["bash", str(generated / "launch" / f"{name}.accelerate.sh"), *flags, "--output_dir", str(out)],
                    env=env, timeout=600)
    assert "(accelerate)" in result.stderr  # the start line names the launcher
    return out


def test_the_generated_fsdp2_tp_launch_script_runs_and_equals_one_process(reference_dir, tmp_path):
    """The preset's own launch file: accelerate launch reads the YAML's parallelism_config (dp_shard=2 x tp=2) and
    its FSDP plugin; train.py turns both off and builds the mesh from the config, as under torchrun."""
    sets = ["topology.processes_per_machine=4", "precision=no", "batch.micro_batch_size=2",
            "batch.gradient_accumulation_steps=2", "optimizer.lr=0.001"]
    out = _run_generated(tmp_path, "tp", "fsdp2_tp", sets, COMMON + ["--loop", "trainer"])
    _assert_same_run(out, reference_dir)
