"""A DeepSpeed config's optimizer/scheduler blocks replace training flags: train.py says so in one warning
line and refuses an explicit flag that would be ignored; its manual loop runs the blocks like the Trainer."""

from __future__ import annotations

import json

import pytest
import torch

from hf_scale.contract.parser import build_parser
from hf_scale.errors import UserError
from hf_scale.knowledge import deepspeed_overrides
from hf_scale.knowledge.rules import given_flags
from hf_scale.train import main as train_main
from hf_scale.train import prepare

ADAMW = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
LAMB = {"type": "Lamb", "params": {"lr": "auto"}}
WARMUP_LR = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}
BASE = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize(
    ("blocks", "argv", "expected"),
    [
        ({}, ["--optim", "adafactor"], []),
        ({"optimizer": ADAMW}, [], []),  # the algorithm of the default --optim: nothing changes
        ({"optimizer": ADAMW}, ["--optim=adamw_torch"], [("optimizer", ("optim",))]),
        ({"optimizer": LAMB}, [], [("optimizer", ())]),
        ({"optimizer": {**ADAMW, "params": {"adam_w_mode": False}}}, [], [("optimizer", ())]),
        ({"scheduler": WARMUP_LR}, [], [("scheduler", ())]),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}}}, [], []),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, [], [("scheduler", ())]),  # log warmup
        ({"scheduler": WARMUP_LR}, ["--lr-scheduler-type", "cosine"], [("scheduler", ("lr_scheduler_type",))]),
    ],
)
def test_which_blocks_replace_which_flags(blocks, argv, expected):
    given = given_flags(argv, [flag for flags in deepspeed_overrides.REPLACED_FLAGS.values() for flag in flags])
    found = deepspeed_overrides.find_overrides({**BASE, **blocks}, given)
    assert [(o.block, o.given) for o in found] == expected


def _train_argv(tmp_path, blocks: dict, *flags: str) -> list[str]:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**BASE, **blocks}))
    return ["--deepspeed", str(config), "--output_dir", str(tmp_path / "out"), *flags]


def test_train_py_refuses_an_explicit_flag_the_json_would_ignore(tmp_path):
    argv = _train_argv(tmp_path, {"scheduler": WARMUP_LR}, "--lr_scheduler_type", "cosine")
    with pytest.raises(UserError) as error:
        train_main.train(argv)
    message = str(error.value)
    assert "scheduler.type='WarmupLR' runs instead of --lr_scheduler_type cosine" in message
    assert "drop --lr_scheduler_type" in message and "\n" not in message
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_train_py_refuses_deepspeed_autotuning_which_would_end_the_run_with_exit_0(tmp_path):
    """DeepSpeed's engine calls exit() after autotuning.end_profile_step (DeepSpeedEngine._autotuning_exit)."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "exit()" in inspect.getsource(DeepSpeedEngine._autotuning_exit)
    argv = _train_argv(tmp_path, {"autotuning": {"enabled": True}})
    with pytest.raises(UserError) as error:
        train_main.train(argv)
    message = str(error.value)
    assert message.startswith("the DeepSpeed config: autotuning.enabled=true: ") and "exit code 0" in message
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_train_py_warning_line_names_what_runs_instead(tmp_path):
    argv = _train_argv(tmp_path, {"optimizer": LAMB, "scheduler": WARMUP_LR})
    ns, _ = build_parser().parse_known_args(argv)
    message = prepare._deepspeed_overrides(ns.deepspeed, ns, given_flags(argv, vars(ns)))
    assert message.startswith("the DeepSpeed config: ")
    assert "optimizer.type='Lamb' runs instead of --optim adamw_torch" in message
    assert "scheduler.type='WarmupLR' runs instead of --lr_scheduler_type linear (default)" in message
    assert "logarithmic" in message and "no decay" in message and "\n" not in message
    assert prepare._deepspeed_overrides(None, ns, frozenset()) is None


@pytest.mark.parametrize(
    ("blocks", "optimizer_kind", "scheduler_kind"),
    [
        ({}, "torch", "torch"),
        ({"optimizer": ADAMW}, "deepspeed", "torch"),  # the torch scheduler of the flags, on DeepSpeed's optimizer
        ({"optimizer": ADAMW, "scheduler": WARMUP_LR}, "deepspeed", "deepspeed"),
        ({"scheduler": WARMUP_LR}, "torch", "deepspeed"),
    ],
)
def test_manual_loop_takes_optimizer_and_scheduler_from_the_same_place_as_the_trainer(
    blocks, optimizer_kind, scheduler_kind, tmp_path
):
    """transformers' deepspeed_optim_sched: DummyOptim iff an optimizer block, DummyScheduler without a
    callable iff a scheduler block (a callable would make DeepSpeed ignore the block)."""
    from accelerate.utils import DummyOptim, DummyScheduler
    from transformers import TrainingArguments

    from hf_scale.train.loops.optimizer import optimizer_and_scheduler

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    optimizer, scheduler = optimizer_and_scheduler(model, args, {**BASE, **blocks}, total_steps=10)
    assert isinstance(optimizer, DummyOptim) == (optimizer_kind == "deepspeed")
    runs_ds_scheduler = isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None
    assert runs_ds_scheduler == (scheduler_kind == "deepspeed")
