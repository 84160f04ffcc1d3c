"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model (train/model/router_loss.py), with
``output_router_logits`` and ``router_aux_loss_coef`` on in a tiny Qwen3-MoE (4 experts, 2 active):

- one process: micro 2 x accumulation 4 trains as micro 8 (one big batch) does, in both loops: the same per-step
  losses (token loss + coefficient x aux loss), gradient norms and logged aux losses. The dataset repeats one text, so
  every micro-batch routes as the big batch does and the Switch loss of the big batch equals its micro-batches' mean;
  the model's own term (added per forward) would count 4 times in the accumulated gradient;
- two processes (multiprocess, runs shared by a module fixture): ep=2 with packing equals one packed process over the
  same micro-batches (micro 2 x accumulation 4): losses, gradient norms, aux losses, token counts and the saved model
  (the aux loss is a per-micro-batch mean, so the reference takes the same micro-batches, not one big batch); the
  manual loop's EP checkpoint resumes bit for bit at ep=2 and exports (`hf-scale export`) to a plain Hugging Face
  model with the trained logits;
- packing (in-process, one forward): the padding of packed rows is left out of the aux loss, which equals that of
  the same examples packed without padding.
"""

from __future__ import annotations

import json
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
    run_ok,
    tiny_moe,
)

from hf_scale.train.data.packing import SEQ_LENGTHS, PackedCollator, model_inputs
from hf_scale.train.model import router_loss

# Every test but the packing one launches train.py (as tests/train/test_train_moe.py): marked multiprocess.

STEPS = 2
COEFFICIENT = 0.5  # large beside the token loss, so a wrong weight shows in the loss and the gradient
COMMON = ["--max_steps", str(STEPS), "--learning_rate", "1e-3", "--seed", "11", "--warmup_ratio", "0",
          "--lr_scheduler_type", "linear", "--max_grad_norm", "1.0"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("moe") / "moe", output_router_logits=True,
                          router_aux_loss_coef=COEFFICIENT)


@pytest.fixture(scope="module")
def one_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "one_text.jsonl"
    row = json.dumps({"text": "Experts share the tokens of a batch; the router learns which expert takes which."})
    path.write_text((row + "\n") * 32)
    return path


def _assert_same_steps(got: list[dict], want: list[dict], rel: float) -> None:
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "aux_loss"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=rel), key
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]


@pytest.fixture(scope="module")
def big_batch_dir(moe_dir, one_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("big") / "run"
    run_ok([sys.executable, TRAIN_PY, *COMMON, "--model_name_or_path", str(moe_dir), "--train_file", str(one_text),
            "--output_dir", str(out), "--per_device_train_batch_size", "8", "--loop", "accelerate"],
           env=child_env(), timeout=600)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_router_loss_under_accumulation_equals_one_big_batch(loop, moe_dir, one_text, big_batch_dir, tmp_path):
    out = tmp_path / "run"
    run_ok([sys.executable, TRAIN_PY, *COMMON, "--model_name_or_path", str(moe_dir), "--train_file", str(one_text),
            "--output_dir", str(out), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
            "--loop", loop], env=child_env(), timeout=600)
    want = read_metrics(big_batch_dir)
    assert all(r["aux_loss"] > 0.5 for r in want)  # a real term: the Switch loss is about 1 when balanced
    _assert_same_steps(read_metrics(out), want, rel=1e-5)


PACKED = ["--packing", "--max_seq_length", "128"]
EP_STEPS = 4  # checkpoints at 2 and 4: the resume continues from 2
EP_COMMON = ["--max_steps", str(EP_STEPS), "--save_steps", "2", *COMMON[2:], *PACKED, "--loop", "accelerate"]
EP2 = "strategy: fsdp\nprecision: 'no'\ntopology: {processes_per_machine: 2}\nparallelism: {ep: 2}\n" \
      "batch: {micro_batch_size: 2, gradient_accumulation_steps: 2}\noptimizer: {lr: 0.001}\n"


@pytest.fixture(scope="module")
def ep_runs(moe_dir, tmp_path_factory):
    """(one packed process over micro 2 x accumulation 4, the ep=2 packed run over 2 x micro 2 x accumulation 2, its
    config, the torchrun command), both with checkpoints at 2 and 4; shared by the tests below."""
    root = tmp_path_factory.mktemp("ep-packed")
    config = root / "ep2.yaml"
    config.write_text(EP2)
    reference, ep2 = root / "reference", root / "ep2"
    run_ok([sys.executable, TRAIN_PY, *EP_COMMON, "--model_name_or_path", str(moe_dir), "--output_dir",
            str(reference), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"],
           env=child_env(), timeout=600)
    command = launcher_command("torchrun", nproc=2) + EP_COMMON + [
        "--model_name_or_path", str(moe_dir), "--hf_scale_config", str(config)]
    result = run_ok(command + ["--output_dir", str(ep2)], env=child_env(), timeout=600)
    assert "fsdp (dp_shard=2 (ep=2)) on 2 process(es) (torchrun), accelerate loop" in result.stderr
    return reference, ep2, command


@pytest.mark.multiprocess
def test_ep2_with_packing_and_router_loss_equals_one_process(ep_runs):
    reference, ep2, _ = ep_runs
    got, want = read_metrics(ep2), read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, EP_STEPS + 1))
    for key in ("loss", "grad_norm", "aux_loss"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-4), key
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    assert_saved_model_verified(ep2, like=reference)
    assert json.loads((ep2 / "checkpoint-2" / "hf_scale_state.json").read_text())["parallelism"]["ep"] == 2


@pytest.mark.multiprocess
def test_ep2_checkpoint_resumes_exactly_at_the_same_ep(ep_runs, tmp_path):
    """The manual loop's EP checkpoint (FSDP2 DCP shards of the expert-parallel DTensors) resumed at ep=2 on 2
    processes continues bit for bit as the uninterrupted run."""
    _, ep2, command = ep_runs
    got = resumed(ep2, 2, tmp_path / "resumed", command, env=child_env(), timeout=600)
    want = {r["step"]: r for r in read_metrics(ep2)}
    assert [r["step"] for r in got] == [3, 4]
    for record in got:
        for key in ("loss", "grad_norm", "aux_loss", "tokens"):
            assert record[key] == want[record["step"]][key], key


@pytest.mark.multiprocess
def test_the_manual_loops_ep_checkpoint_exports_to_a_plain_model_with_the_trained_logits(ep_runs, tmp_path):
    _, ep2, _ = ep_runs
    exported = tmp_path / "exported"
    run_ok([sys.executable, "-m", "hf_scale", "export", str(ep2 / f"checkpoint-{EP_STEPS}"), str(exported)],
           env=child_env(), timeout=300)
    torch.testing.assert_close(logits(exported), logits(ep2), rtol=1e-5, atol=1e-5)


def test_packing_padding_does_not_count_in_the_router_loss():
    """Two examples (10 and 6 tokens) packed into one row of 16, or one per row padded to 10: the same tokens route
    alike (positions restart per example), and the loss the loops add (router_loss.Router.aux_loss, given the
    collator's real_token_mask) is the same; transformers' own (no attention_mask in a packed batch) counts the 4
    padding rows as tokens and differs."""
    model, tokenizer = tiny_moe(output_router_logits=True, router_aux_loss_coef=COEFFICIENT)
    router = router_loss.take_over(model)
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (10, 6))
    collate = PackedCollator(pad_token_id=tokenizer.pad_token_id)
    unpadded = collate([{"input_ids": first + second, "labels": first + second, SEQ_LENGTHS: [10, 6]}])
    padded = collate([{"input_ids": ids, "labels": ids, SEQ_LENGTHS: [len(ids)]} for ids in (first, second)])
    assert padded["input_ids"].shape == (2, 10)  # 4 padding tokens in the second row
    with torch.no_grad():
        want, got = (model(**model_inputs(batch), use_cache=False) for batch in (unpadded, padded))
    torch.testing.assert_close(router.aux_loss(got, padded), want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(router.aux_loss(want, unpadded), want.aux_loss, rtol=0, atol=0)
    assert abs(got.aux_loss - want.aux_loss) > 1e-3  # transformers' own, padding counted
