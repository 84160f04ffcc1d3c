"""Evaluation: the exact token-weighted eval loss (checked against an independent per-example computation),
the eval micro-batches dealt to ranks, the schedule of both loops, eval records in metrics.jsonl, and one-line
errors.

Equality across strategies (DDP, ZeRO-1/2/3, FSDP2, both loops, 2 processes vs 1) is asserted by
tests/train/loops/test_loops_equivalence.py, whose runs all evaluate.
"""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from train_helpers import TRAIN_PY, read_eval_metrics, read_metrics, run_ok
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.embedded_assets import EMBEDDED_DATA_FILE, EMBEDDED_MODEL_DIR
from hf_scale.train.data.batches import make_collator
from hf_scale.train.data.sources import prepare_datasets
from hf_scale.train.loops.evaluation import EvalSchedule, evaluate, rank_batches
from hf_scale.train.main import main as train_main


@pytest.mark.parametrize(("examples", "batch", "world"), [(21, 2, 2), (8, 8, 2), (5, 2, 4), (1, 3, 3), (16, 4, 2)])
def test_every_example_is_counted_once_and_every_rank_runs_as_many_forwards(examples, batch, world):
    plans = [rank_batches(examples, batch, rank, world) for rank in range(world)]
    assert len({len(plan) for plan in plans}) == 1  # the same number of forwards (ZeRO-3/FSDP collectives)
    counted = sorted(i for plan in plans for indices, counts in plan if counts for i in indices)
    assert counted == list(range(examples))
    # Batch k goes to rank k % world, in order.
    assert plans[0][0] == (list(range(min(batch, examples))), True)


def _args(**overrides):
    base = {"eval_strategy": "no", "eval_steps": None, "logging_steps": 1, "eval_on_start": False, "do_eval": False}
    return SimpleNamespace(**(base | overrides))


def test_schedule_follows_the_trainers_flags():
    steps = EvalSchedule.from_args(_args(eval_strategy="steps", eval_steps=3, do_eval=True), total_steps=10)
    assert [s for s in range(1, 11) if steps.after_step(s)] == [3, 6, 9] and steps.at_end
    fraction = EvalSchedule.from_args(_args(eval_strategy="steps", eval_steps=0.25), total_steps=10)
    assert fraction.interval == 3  # ceil(0.25 x 10), as the Trainer rounds
    fallback = EvalSchedule.from_args(_args(eval_strategy="steps", logging_steps=4), total_steps=10)
    assert fallback.interval == 4  # no --eval_steps: --logging_steps
    epoch = EvalSchedule.from_args(_args(eval_strategy="epoch", eval_on_start=True), total_steps=10)
    assert epoch.strategy == "epoch" and epoch.on_start and not any(epoch.after_step(s) for s in range(1, 11))


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def test_eval_loss_is_the_token_weighted_mean_whatever_the_batch(accelerator, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    data = prepare_datasets(DataArguments(train_file=str(EMBEDDED_DATA_FILE)),
                            SourceArguments(validation_split_percentage=5), tokenizer, seed=3,
                            eval_requested_by="--do_eval")
    validation = data.validation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR)
    model.train()  # evaluate switches to eval mode and back

    # Independent: every example alone, summed token cross-entropies over all target tokens.
    total, count = 0.0, 0
    with torch.no_grad():
        model.eval()
        for row in validation:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
        model.train()
    want = total / count

    for batch_size in (1, 3, 8):
        for packing in (False, True):
            result = evaluate(model, validation, make_collator(tokenizer, packing=packing), accelerator,
                              batch_size=batch_size)
            assert result.tokens == count
            assert result.loss == pytest.approx(want, rel=1e-5), (batch_size, packing)
            assert result.perplexity == pytest.approx(math.exp(want), rel=1e-5)
    assert model.training


BAD = {
    "eval-without-validation-data": (
        ["--train_file", str(EMBEDDED_DATA_FILE), "--eval_strategy", "steps"],
        "--eval_strategy steps: there is no validation data; pass --validation_file",
    ),
    "do-eval-without-validation-data": (["--do_eval"], "--do_eval: there is no validation data"),
    "eval-batch-zero": (["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size=0: must be >= 1"),
    "eval-steps-negative": (["--eval_strategy", "steps", "--eval_steps", "-2", "--validation_split_percentage", "5"],
                            "--eval_steps=-2: must be a whole number of steps >= 1, or a fraction in (0, 1)"),
    "split-percentage-range": (["--validation_split_percentage", "0"],
                               "--validation_split_percentage 0: must be between 0 and 100"),
    "unknown-eval-strategy": (["--eval_strategy", "sometimes"], "--eval_strategy"),
}


@pytest.mark.parametrize(("flags", "message"), BAD.values(), ids=BAD.keys())
def test_bad_eval_flags_are_one_line_exit_2_before_anything_runs(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_main([*flags, "--output_dir", str(out)])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and message in lines[0], lines
    assert not out.exists()


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory):
    """Both loops, 2 epochs of 2 steps (16 examples: 12 to train with micro 8, 4 to evaluate), eval at the start
    and after each epoch."""
    runs = {}
    for loop in ("accelerate", "trainer"):
        out = tmp_path_factory.mktemp(f"epochs-{loop}")
        run_ok([sys.executable, TRAIN_PY, "--loop", loop, "--max_train_samples", "16", "--num_train_epochs", "2",
                "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--eval_strategy", "epoch",
                "--eval_on_start", "--validation_split_percentage", "25",
                "--per_device_eval_batch_size", "2", "--save_strategy", "no", "--output_dir", str(out)], timeout=400)
        runs[loop] = out
    return runs


@pytest.mark.parametrize("loop", ["accelerate", "trainer"])
def test_epoch_strategy_and_eval_on_start_write_eval_records(loop, epoch_runs):
    out = epoch_runs[loop]
    records = read_eval_metrics(out)
    assert [r["step"] for r in records] == [0, 2, 4]  # start, end of epoch 1, end of epoch 2 (= end of training)
    assert all(r["eval_tokens"] > 0 and r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
               for r in records)
    assert records[-1]["eval_loss"] < records[0]["eval_loss"]  # it trained
    assert len(read_metrics(out)) == 4
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["eval_loss"] == records[-1]["eval_loss"] and summary["data"]["validation_examples"] == 4


def test_both_loops_evaluate_alike(epoch_runs):
    loop, trainer = (read_eval_metrics(epoch_runs[name]) for name in ("accelerate", "trainer"))
    assert [r["eval_loss"] for r in loop] == pytest.approx([r["eval_loss"] for r in trainer], rel=1e-5)
