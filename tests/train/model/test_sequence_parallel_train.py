"""DeepSpeed Ulysses sequence parallelism in train.py, both loops, real processes on CPU (gloo): sp=2 on two
processes (DeepSpeed ZeRO-2, accelerate's ParallelismConfig wiring the Ulysses attention and data adapter) trains
the one-process run's steps at the same global batch of 8 (one process: micro 8; sp=2: micro 4 x accumulation 2
adapter micro-batches, each a whole batch of rows the two ranks compute half a sequence each): the same per-step
losses, token counts and eval losses (rtol 1e-4, as test_parallel.py's equivalences); the gradient norms too. The
Trainer runs with hf_scale's loss rule (HfScaleTrainer.compute_loss), not the Trainer's own SP loss.

Resume (hf_scale/train/checkpoint/reshard.py): the manual loop's checkpoints of ZeRO-2 sp=2 and of ZeRO-3
dp_shard=2 x sp=2 (4 processes) continue the uninterrupted run bit-identically, also from a step inside a round of
the adapter's micro-batches, and an sp=2 checkpoint resumes at sp=1 (same world size and ZeRO stage) with the
uninterrupted losses; the Trainer path refuses them in one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from checkpoint_runs import resumed
from train_helpers import (
    REPO,
    child_env,
    free_port,
    generate_config,
    launcher_command,
    read_eval_metrics,
    read_metrics,
    run,
    run_ok,
    training_traceback_frames,
)

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.train.checkpoint import store

pytestmark = pytest.mark.multiprocess

STEPS = 4
MIXTURE = REPO / "tests" / "data" / "mixture"
TRAIN = ["--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0", "--lr_scheduler_type", "linear",
         "--max_grad_norm", "1.0",
         "--train_file", str(MIXTURE / "qa.jsonl"), str(MIXTURE / "chat.jsonl"), "--mixture_weights", "0.75", "0.25"]
COMMON = ["--max_steps", str(STEPS), *TRAIN,
          "--validation_file", str(MIXTURE / "validation.jsonl"), "--eval_strategy", "steps", "--eval_steps", "2"]
SP2 = "strategy: deepspeed\nprecision: 'no'\ndeepspeed: {zero_stage: 2}\ntopology: {processes_per_machine: 2}\n" \
      "parallelism: {sp: 2}\nbatch: {micro_batch_size: 4, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"


ZERO3_DP2_SP2 = "strategy: deepspeed\nprecision: 'no'\ndeepspeed: {zero_stage: 3}\n" \
                "topology: {processes_per_machine: 4}\nparallelism: {sp: 2}\n" \
                "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The one-process run every sp layout is compared with, trained once per module (per xdist worker). One run
    serves both loops: in one process they train the same steps (tests/train/loops/test_loops_equivalence.py::
    test_trainer_path_equals_manual_loop)."""
    out = tmp_path_factory.mktemp("sp-reference") / "reference"
    run_ok(launcher_command("python") + COMMON + ["--loop", "accelerate", "--per_device_train_batch_size", "8",
                                                  "--output_dir", str(out)], env=child_env(), timeout=600)
    return out


@pytest.mark.parametrize(("loop", "layout"), [("accelerate", "zero2-sp2"), ("trainer", "zero2-sp2"),
                                              ("accelerate", "zero3-dp2-sp2"), ("trainer", "zero3-dp2-sp2")])
def test_sp2_equals_one_process(loop, layout, reference, tmp_path):
    """ZeRO-3 x dp_shard=2 x sp=2 on 4 processes too: ZeRO-3 averages gradients over the sp group as well
    (sequence_parallel.loss_multiplier); the gradient norms tell (Adam's update would hide the scale). The manual
    loop's checkpoint-2 (two whole rounds of adapter micro-batches per rank) continues the run bit-identically, on
    both layouts. (A 4-process run with one micro-batch per step, to resume inside a round with two sp groups, is left
    out for time: its step's rows are not the one-process run's contiguous ones, so it needs its own full run; the
    next test resumes inside a round with one sp group, through the same skip.)"""
    sp2 = tmp_path / "sp2"
    config = tmp_path / "sp2.yaml"
    config.write_text(SP2 if layout == "zero2-sp2" else ZERO3_DP2_SP2)
    nproc = 2 if layout == "zero2-sp2" else 4
    flags = ["--loop", loop, "--hf_scale_config", str(config)] + (["--save_steps", "2"] if loop == "accelerate" else [])
    command = launcher_command("torchrun", nproc=nproc) + COMMON + flags
    result = run_ok(command + ["--output_dir", str(sp2)], env=child_env(), timeout=600)
    assert f"sp=2) on {nproc} process(es) (torchrun), {loop} loop" in result.stderr
    got, want = read_metrics(sp2), read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    assert want[1]["loss"] != pytest.approx(want[0]["loss"], rel=1e-3)  # the steps see different rows
    got_eval, want_eval = read_eval_metrics(sp2), read_eval_metrics(reference)
    assert len(want_eval) == 2
    assert [r["eval_tokens"] for r in got_eval] == [r["eval_tokens"] for r in want_eval]
    assert [r["eval_loss"] for r in got_eval] == pytest.approx([r["eval_loss"] for r in want_eval], rel=1e-4)

    if loop == "accelerate":
        records = resumed(sp2, 2, tmp_path / "resumed", command, env=child_env(), timeout=600)
        assert [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in records] == [
            (r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in got[2:]]
        return
    # The Trainer's end checkpoint does not resume (its data skip cannot pass the adapter): one line, exit 2, before
    # any model is built, on every rank.
    again = run(command + ["--output_dir", str(sp2), "--resume_from_checkpoint", "auto"], env=child_env(), timeout=600)
    assert again.returncode != 0 and not training_traceback_frames(again.stderr)  # torchrun's own report aside
    assert ("sp=2: the Trainer path does not resume sequence-parallel runs (its data skip cannot pass DeepSpeed's "
            "Ulysses adapter); train them with --loop accelerate") in again.stderr


SP2_ACCUMULATION_3 = SP2.replace("gradient_accumulation_steps: 2", "gradient_accumulation_steps: 3")
DP2_ACCUMULATION_3 = "strategy: deepspeed\nprecision: 'no'\ndeepspeed: {zero_stage: 2}\n" \
                     "topology: {processes_per_machine: 2}\n" \
                     "batch: {micro_batch_size: 2, gradient_accumulation_steps: 3}\noptimizer: {lr: 0.001}\n"


def test_an_sp2_checkpoint_in_the_next_epoch_inside_an_adapter_round_resumes_exactly_and_at_sp1(tmp_path):
    """Three adapter micro-batches per step, 52 per rank in an epoch (207 rows / micro 4 / 2 ranks x sp 2): step 18
    ends the epoch with one, and checkpoint-21 is 9 micro-batches into the next epoch, in the middle of a round of
    two (rank 0's loader batch trained, rank 1's not). The same layout skips 4 rounds on the loader and drops the
    round's first micro-batch: bit-identical. sp=1 on the same 2 processes (ZeRO-2, data-parallel 2 x micro 2 x
    accumulation 3: the same global batch of 12) loads the same ZeRO partitions and skips 9 micro-batches per rank:
    the uninterrupted losses (rtol 1e-4) on the same rows."""
    configs = {"sp2": SP2_ACCUMULATION_3, "dp2": DP2_ACCUMULATION_3}
    for name, text in configs.items():
        (tmp_path / f"{name}.yaml").write_text(text)

    def command(config: str) -> list[str]:
        return launcher_command("torchrun", nproc=2) + ["--max_steps", "23", "--save_steps", "21", *TRAIN, "--loop",
                                                         "accelerate", "--hf_scale_config", str(tmp_path / config)]

    full = tmp_path / "full"
    run_ok(command("sp2.yaml") + ["--output_dir", str(full)], env=child_env(), timeout=600)
    want = read_metrics(full)
    assert want[17]["epoch"] == 1.0  # step 18's short window ends the epoch
    state = checkpoint_verification.read_state(full / "checkpoint-21")
    assert (state["epoch"], state["samples_consumed_in_epoch"]) == (1, 9 * 4)  # not epoch 0 going on
    assert len({r["tokens"] for r in want[19:]}) == 4  # every step other rows

    same = resumed(full, 21, tmp_path / "same", command("sp2.yaml"), env=child_env(), timeout=600)
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in same] == [
        (r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens"]) for r in want[21:]]

    at_sp1 = resumed(full, 21, tmp_path / "sp1", command("dp2.yaml"), env=child_env(), timeout=600)
    assert [r["step"] for r in at_sp1] == [22, 23]
    assert [r["tokens"] for r in at_sp1] == [r["tokens"] for r in want[21:]]  # the same rows: the position is right
    assert [r["loss"] for r in at_sp1] == pytest.approx([r["loss"] for r in want[21:]], rel=1e-4)
    assert [r["grad_norm"] for r in at_sp1] == pytest.approx([r["grad_norm"] for r in want[21:]], rel=1e-4)


def test_the_generated_sp_launch_script_runs_and_equals_one_process(reference, tmp_path):
    """`hf-scale generate` with parallelism.sp=2, then its accelerate launch file (the YAML's parallelism_config
    with sp_backend deepspeed): train.py takes the layout over from --hf_scale_config, as under torchrun."""
    generated = generate_config(tmp_path / "generated", "sp", preset="zero2", sets=[
        "topology.processes_per_machine=2", "precision=no", "parallelism.sp=2", "batch.micro_batch_size=4",
        "batch.gradient_accumulation_steps=2", "optimizer.lr=0.001", "deepspeed.torch_adam=true"])
    out = tmp_path / "run"
    env = {**child_env(), "TRAIN_SCRIPT": str(REPO / "train.py"), "MAIN_PROCESS_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = run_ok(["bash", str(generated / "launch" / "sp.accelerate.sh"), *COMMON, "--loop", "accelerate",
                     "--output_dir", str(out)], env=env, timeout=600)
    assert "deepspeed ZeRO-2 (sp=2) on 2 process(es) (accelerate)" in result.stderr
    got, want = read_metrics(out), read_metrics(reference)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)


def test_trls_alst_ulysses_yaml_runs_without_an_hf_scale_config(tmp_path):
    """TRL's examples/accelerate_configs/alst_ulysses_4gpu.yaml (tests/data/peer_configs), changed only where this
    2-core CPU machine requires: 2 processes (dp_shard 2 -> 1, sp stays 2), sp_attn_implementation sdpa (its
    flash_attention_2 needs a CUDA GPU; hf_scale refuses it under sp). `accelerate launch` of it runs train.py
    with no --hf_scale_config: the inline ZeRO-3, bf16 and sp=2 (DeepSpeed Ulysses) all come from the YAML."""
    import yaml

    trl = yaml.safe_load((REPO / "tests" / "data" / "peer_configs" / "trl_alst_ulysses_4gpu.yaml").read_text())
    trl["num_processes"] = 2
    trl["parallelism_config"]["parallelism_config_dp_shard_size"] = 1
    trl["parallelism_config"]["parallelism_config_sp_attn_implementation"] = "sdpa"
    config = tmp_path / "alst_ulysses_2cpu.yaml"
    config.write_text(yaml.safe_dump(trl))
    out = tmp_path / "run"
    result = run_ok(launcher_command("accelerate", config=config) + [
        "--max_steps", "2", *TRAIN, "--per_device_train_batch_size", "4", "--loop", "accelerate",
        "--output_dir", str(out)], env=child_env(), timeout=600)
    assert "deepspeed ZeRO-3 (sp=2) on 2 process(es) (accelerate)" in result.stderr, result.stderr[-3000:]
    steps = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] > 0 for r in steps)


def test_a_generated_sp_cluster_node_survives_a_preemption_and_resumes(tmp_path):
    """`generate --targets skypilot` with parallelism.sp=2: the node script runs the loop that resumes sp runs (the
    manual loop: the Trainer path refuses sp checkpoints), so SIGTERM saves and exits 75 and the same command started
    again (a recovered node: HF_SCALE_RESUME=auto) resumes from that checkpoint and finishes, with no --loop given."""
    import signal
    import subprocess
    import time

    generated = generate_config(tmp_path / "generated", "sp", preset="zero2", sets=[
        "topology.processes_per_machine=2", "precision=no", "parallelism.sp=2", "batch.micro_batch_size=4",
        "batch.gradient_accumulation_steps=2", "optimizer.lr=0.001", "deepspeed.torch_adam=true",
        "cluster.image=registry.example.com/hf-scale:0.1.0", "cluster.output_dir=/output"],
        extra=("--targets", "skypilot"))
    out = tmp_path / "run"
    env = {**child_env(), "TRAIN_SCRIPT": str(REPO / "train.py"), "MAIN_PROCESS_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1", "SKYPILOT_NUM_GPUS_PER_NODE": "2"}
    command = ["bash", str(generated / "launch" / "sp.node.sh"), "--max_steps", "12", "--save_steps", "1", *TRAIN,
               "--output_dir", str(out)]
    # The Trainer loop asked for over it (the user's flags come last): refused at the first start, not after the
    # first preemption, in one line, nothing written.
    refused = run([*command, "--loop", "trainer"], env=env, timeout=300)
    assert refused.returncode == 2 and not training_traceback_frames(refused.stderr), refused.stderr[-3000:]
    assert ("train.py: error: sp=2 with --loop trainer in a job that restarts itself: the Trainer path does not "
            "resume sequence-parallel runs") in refused.stderr
    assert not out.exists() or not any(out.iterdir())
    log = tmp_path / "node.log"
    with open(log, "w") as sink:
        node = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not store.complete_checkpoints(out):
            assert node.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        node.send_signal(signal.SIGTERM)  # what a preempted node's process gets
        assert node.wait(timeout=300) == 75, log.read_text()[-3000:]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    stopped = checkpoint_layout.step_of(store.complete_checkpoints(out)[-1])
    assert stopped < 12 and not (out / "model.safetensors").exists()
    restarted = run(command, env={**env, "MAIN_PROCESS_PORT": str(free_port())}, timeout=600)
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    assert f"hf_scale: resuming from {out / f'checkpoint-{stopped}'}" in restarted.stderr
    assert "deepspeed ZeRO-2 (sp=2) on 2 process(es) (accelerate), accelerate loop:" in restarted.stderr
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 13))
