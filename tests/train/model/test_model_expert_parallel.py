"""Expert parallelism in train.py, real processes on CPU (gloo runs transformers' all_to_all token dispatch): a tiny
Qwen3-MoE (4 experts, 2 active, built locally) at ep=2 over FSDP2's dp_shard=2 (transformers'
DistributedConfig(ep_size=2, fsdp_size=2): each rank holds 2 of every layer's experts, tokens exchanged by
all-to-all) trains as one process does, in both loops: the same per-step losses, gradient norms and token counts
(rtol 1e-4), train.py's own save check passes and the saved model gives the one-process model's logits. train.py's
runtime guard checks that the model's experts really are split 2 ways (guard.expert_split). Its refusals at start,
one line and exit 2 before anything is written: ep with --lora_r, ep on a dense model. The Trainer's final
checkpoint of the EP run exports to a plain Hugging Face model with the trained logits, and its checkpoint at step 2
resumes at ep=2 bit for bit. The manual loop's checkpoint at step 2 resumes at another ep and world size, both ways:
in one process (ep=1), whose checkpoint at step 3 resumes at ep=2 over dp_shard=4 (4 processes), each continuing
the uninterrupted run.

Against the same one-process reference: `accelerate launch` with the accelerate YAML `hf-scale generate` writes for the
ep=2 config (2 processes); and ep=2 with tp=2 over dp_shard=2 (4 processes, manual loop: transformers' all-to-all
dispatch gives each rank of a TP group a disjoint slice of the batch they share, so no token reaches an expert twice,
and the experts are FSDP-sharded over dp_shard x tp / ep = 2 copies).

The one-process run trains a global batch of 8 (micro 8); ep=2: micro 2 x accumulation 2 on each of the 2 data-parallel
ranks (EP ranks see different data: ep splits the experts, not the batch). The router's auxiliary loss is off (the
model's output_router_logits default), so the per-micro-batch load-balancing term is not part of this equality.
"""

from __future__ import annotations

import sys

import pytest
import torch
from checkpoint_runs import resumed
from train_helpers import (
    TRAIN_PY,
    assert_saved_model_verified,
    build_tiny_moe,
    child_env,
    launcher_command,
    logits,
    read_metrics,
    run,
    run_ok,
)

from hf_scale.commands.cli import main

pytestmark = pytest.mark.multiprocess

STEPS = 4
COMMON = ["--max_steps", str(STEPS), "--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0",
          "--lr_scheduler_type", "linear", "--max_grad_norm", "1.0"]
EP2 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 2}\nparallelism: {ep: 2}\n" \
      "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"
EP2_TP2 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 4}\nparallelism: {ep: 2, tp: 2}\n" \
          "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"
"""dp_shard = 4 / tp = 2: the one-process global batch of 8 again (2 data-parallel ranks x micro 2 x accumulation 2)."""


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("moe") / "moe")


@pytest.fixture(scope="module")
def ep_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "ep2.yaml"
    path.write_text(EP2)
    return path


@pytest.fixture(scope="module")
def reference_dir(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "reference"
    run_ok([sys.executable, TRAIN_PY, *COMMON, "--model_name_or_path", str(moe_dir), "--output_dir", str(out),
            "--per_device_train_batch_size", "8", "--loop", "accelerate"], env=child_env(), timeout=600)
    return out


def _assert_equals_reference(out, reference_dir):
    got, want = read_metrics(out), read_metrics(reference_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-4)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    assert_saved_model_verified(out, like=reference_dir)


@pytest.fixture(scope="module")
def ep2_run(moe_dir, ep_config, tmp_path_factory):
    """The ep=2 torchrun run of a loop, launched once per loop and shared: (its output directory, its stderr, its
    command without --output_dir). It keeps its checkpoints at steps 2 and 4 (the resumes below start from 2)."""
    runs = {}

    def get(loop: str):
        if loop not in runs:
            out = tmp_path_factory.mktemp("ep2") / loop
            command = launcher_command("torchrun", nproc=2) + COMMON + [
                "--save_steps", "2", "--save_total_limit", "2", "--model_name_or_path", str(moe_dir),
                "--hf_scale_config", str(ep_config), "--loop", loop]
            result = run_ok(command + ["--output_dir", str(out)], env=child_env(), timeout=600)
            runs[loop] = out, result.stderr, command
        return runs[loop]

    return get


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_ep2_equals_one_process(loop, ep2_run, reference_dir, tmp_path):
    """Both loops; the one-process reference is the manual loop's (the loops train the same steps in one process:
    tests/train/loops/test_loops_equivalence.py)."""
    out, stderr, _ = ep2_run(loop)
    assert f"fsdp (dp_shard=2 (ep=2)) on 2 process(es) (torchrun), {loop} loop" in stderr
    _assert_equals_reference(out, reference_dir)
    if loop == "trainer":
        # The Trainer's final checkpoint holds the EP run's FSDP2 shards (DCP): `hf-scale export` rebuilds the plain
        # Hugging Face model, with the trained logits.
        exported = tmp_path / "exported"
        run_ok([sys.executable, "-m", "hf_scale", "export", str(out / f"checkpoint-{STEPS}"), str(exported)],
               env=child_env(), timeout=300)
        torch.testing.assert_close(logits(exported), logits(out), rtol=1e-5, atol=1e-5)


def test_the_trainers_ep2_checkpoint_resumes_exactly_at_the_same_ep(ep2_run, tmp_path):
    """The Trainer's EP checkpoint (its FSDP2 DCP shards of the expert-parallel DTensors and the optimizer state
    hf_scale writes for a mesh-built model) resumed at ep=2 continues bit for bit as the uninterrupted run (the
    manual loop's: tests/train/model/test_router_loss.py)."""
    uninterrupted, _, command = ep2_run("trainer")
    got = resumed(uninterrupted, 2, tmp_path / "resumed", command, env=child_env(), timeout=600)
    want = {r["step"]: r for r in read_metrics(uninterrupted)}
    assert [r["step"] for r in got] == [3, 4]
    for record in got:
        for key in ("loss", "grad_norm", "tokens"):
            assert record[key] == want[record["step"]][key], key


ONE_PROCESS = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 1}\n" \
              "batch: {micro_batch_size: 2, gradient_accumulation_steps: 4}\noptimizer: {lr: 0.001}\n"
"""FSDP2 in one process (ep=1): the ep=2 run's global batch of 8 again (micro 2 x accumulation 4)."""
EP2_DS4 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 4}\nparallelism: {ep: 2}\n" \
          "batch: {micro_batch_size: 1, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"
"""dp_shard = 4, the experts of 2 EP groups of different batches FSDP-sharded over 2 copies: 4 x micro 1 x 2 = 8."""


def test_the_manual_loops_ep2_checkpoint_resumes_in_one_process_and_at_ep2_over_dp_shard4(moe_dir, ep2_run, tmp_path):
    """Another ep and world size, both ways (reshard._check_ep: DCP holds each expert tensor at its global shape and
    reshards it like any FSDP2 parameter): checkpoint-2 of the ep=2 run on 2 processes, resumed by one process at
    ep=1, trains steps 3 and 4 as the uninterrupted run; that run's checkpoint-3, resumed on 4 processes at ep=2 over
    dp_shard=4 (each expert FSDP-sharded over the 2 ranks holding it, the 2 EP groups on different batches: micro 1 x
    accumulation 2 x 4 = the global batch of 8), trains step 4 as it too and saves its model (the same logits).
    rel 1e-6 (observed up to 2.6e-7): the reduction order differs."""
    uninterrupted, _, ep2_command = ep2_run("accelerate")
    one_config, ds4_config = tmp_path / "one.yaml", tmp_path / "ep2_ds4.yaml"
    one_config.write_text(ONE_PROCESS)
    ds4_config.write_text(EP2_DS4)
    train = COMMON + ["--model_name_or_path", str(moe_dir), "--loop", "accelerate"]
    one_process = launcher_command("torchrun", nproc=1) + train + ["--save_steps", "1", "--hf_scale_config",
                                                                   str(one_config)]
    in_one = resumed(uninterrupted, 2, tmp_path / "one", one_process, env=child_env(), timeout=600)
    over_ds4 = launcher_command("torchrun", nproc=4) + train + ["--hf_scale_config", str(ds4_config)]
    at_ds4 = resumed(tmp_path / "one", 3, tmp_path / "ds4", over_ds4, env=child_env(), timeout=600)
    want = {r["step"]: r for r in read_metrics(uninterrupted)}
    assert [r["step"] for r in in_one] == [3, 4]
    assert [r["step"] for r in at_ds4] == [4]
    for record in in_one + at_ds4:
        for key in ("loss", "grad_norm", "lr"):
            assert record[key] == pytest.approx(want[record["step"]][key], rel=1e-6), key
        assert record["tokens"] == want[record["step"]]["tokens"]  # the same samples: the data position is right
    torch.testing.assert_close(logits(tmp_path / "ds4"), logits(uninterrupted), rtol=1e-5, atol=1e-5)


def test_accelerate_launch_of_the_generated_ep2_files_equals_one_process(moe_dir, ep_config, reference_dir, tmp_path):
    """What a user runs: `hf-scale generate` of the ep=2 config, then `accelerate launch --config_file
    accelerate_configs/ep2.yaml train.py --hf_scale_config hf_scale_configs/ep2.yaml` (2 processes)."""
    generated = tmp_path / "generated"
    assert main(["generate", str(ep_config), "--output-dir", str(generated)]) == 0
    out = tmp_path / "ep2"
    command = launcher_command("accelerate", config=generated / "accelerate_configs" / "ep2.yaml") + COMMON + [
        "--model_name_or_path", str(moe_dir), "--hf_scale_config", str(generated / "hf_scale_configs" / "ep2.yaml"),
        "--output_dir", str(out), "--loop", "accelerate"]
    result = run_ok(command, env=child_env(), timeout=600)
    assert "fsdp (dp_shard=2 (ep=2)) on 2 process(es) (accelerate), accelerate loop" in result.stderr
    _assert_equals_reference(out, reference_dir)


def test_ep2_with_tp2_over_dp_shard2_equals_one_process(moe_dir, reference_dir, tmp_path):
    """4 processes, manual loop: the experts split 2 ways over each TP group (ep = the TP group, which shares a
    batch). The Trainer gave the same numbers by hand (rel < 5e-5): one more 4-process launch (80 to 130 s on 2
    cores), left out of the suite. ep=2 over dp_shard=4 (tp=1) trains a resumed step in the test above."""
    config = tmp_path / "ep2_tp2.yaml"
    config.write_text(EP2_TP2)
    out = tmp_path / "ep2"
    result = run_ok(launcher_command("torchrun", nproc=4) + COMMON + [
        "--model_name_or_path", str(moe_dir), "--hf_scale_config", str(config), "--output_dir", str(out),
        "--loop", "accelerate"], env=child_env(), timeout=600)
    assert "fsdp (dp_shard=2 x tp=2 (ep=2)) on 4 process(es) (torchrun), accelerate loop" in result.stderr
    _assert_equals_reference(out, reference_dir)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_r", "4"], "--lora_r=4 with expert parallelism ({config}: parallelism.ep=2): hf_scale has not proven "
                            "peft's LoRA layers on expert-parallel weights; train all weights (--lora_r 0) or set "
                            "parallelism.ep to 1"),
        ([], "{config}: parallelism.ep=2 needs a mixture-of-experts model; llama is dense (no num_experts/"
             "num_local_experts/n_routed_experts in its config): set ep to 1"),
    ],
    ids=["lora", "dense-model"],
)
def test_train_py_refuses_ep_in_one_line_exit_2_before_writing(flags, message, moe_dir, ep_config, tmp_path):
    out = tmp_path / "out"
    model = ["--model_name_or_path", str(moe_dir)] if flags else []  # without: the embedded (dense) tiny Llama
    result = run([sys.executable, TRAIN_PY, "--hf_scale_config", str(ep_config), "--output_dir", str(out), *model,
                  *flags], env=child_env(), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    config = f"--hf_scale_config={ep_config}"
    assert result.stderr.strip().splitlines()[-1] == "train.py: error: " + message.format(config=config)
    assert "Traceback" not in result.stderr
    assert not out.exists()
