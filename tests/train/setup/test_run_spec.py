"""The run spec (hf_scale.train.setup.run_spec) built once from the launch request and the final TrainingArguments,
train.py's TrainingArguments built without touching the parsed flags, and the per-rank micro batch read from
accelerate's prepared loader. In-process, real TrainingArguments / accelerate objects."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from transformers import TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from hf_scale.contract.launch_request import LaunchRequest
from hf_scale.contract.parser import build_parser
from hf_scale.train import prepare
from hf_scale.train.data.batches import micro_batch_per_rank
from hf_scale.train.setup import guard, run_spec
from hf_scale.train.setup.run_spec import RunSpec


def _request(**fields) -> LaunchRequest:
    values = {"launcher": "torchrun", "world_size": 4, "strategy": "ddp", "deepspeed_config_file": None,
              "zero_stage": None, "mixed_precision": None}
    return LaunchRequest(**{**values, **fields})


def _args(tmp_path, **flags) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **flags)


def test_batch_arithmetic_precision_and_seeds_come_from_the_final_flags(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, bf16=True, seed=7)
    spec = run_spec.build(_request(), args, loop="accelerate", packing=True)
    assert (spec.micro_batch_size, spec.gradient_accumulation_steps, spec.world_size) == (2, 3, 4)
    assert spec.global_batch_size == 24
    assert (spec.precision, spec.loss_scaling) == ("bf16", False)
    assert (spec.seed, spec.data_seed) == (7, 7)  # the Trainer's rule: --data_seed, else --seed
    assert (spec.launcher, spec.strategy, spec.loop, spec.packing) == ("torchrun", "ddp", "accelerate", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.micro_batch_size = 4


def test_data_seed_and_fp16_and_fsdp_settings(tmp_path):
    args = _args(tmp_path, data_seed=11, seed=7)
    args.fp16 = True  # TrainingArguments refuses fp16 on CPU at construction; the spec only reads the flag
    fsdp = {"version": 2, "sharding": "full_shard"}
    spec = run_spec.build(_request(strategy="fsdp", fsdp_settings=fsdp), args, loop="accelerate", packing=False)
    assert (spec.data_seed, spec.precision, spec.loss_scaling, spec.fsdp_settings) == (11, "fp16", True, fsdp)


def test_the_guard_expects_exactly_the_spec(tmp_path):
    spec = run_spec.build(_request(), _args(tmp_path, per_device_train_batch_size=3), loop="trainer", packing=False)
    assert spec.expected == guard.Expected(strategy="ddp", world_size=4, micro_batch_size=3,
                                           gradient_accumulation_steps=1, precision="no", zero_stage=None,
                                           zero3_init=False)


def test_zero3_init_follows_the_deepspeed_plugin_transformers_builds(tmp_path):
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
              "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    try:
        args = _args(tmp_path, deepspeed=config)
        request = _request(strategy="deepspeed", zero_stage=3, launcher="deepspeed")
        spec = run_spec.build(request, args, loop="trainer", packing=False)
        assert spec.zero3_init and spec.expected.zero3_init and spec.zero_stage == 3
        assert spec.final_save_is_checkpoint  # no 16-bit gather in the config: the final save is a checkpoint
        assert spec.describe().startswith("deepspeed ZeRO-3 on 4 process(es) (deepspeed), trainer loop")
    finally:
        unset_hf_deepspeed_config()  # TrainingArguments registered the config globally


@pytest.mark.parametrize("loop", ["trainer", "accelerate"])
def test_the_checkpoint_state_is_written_from_the_run_spec(loop, tmp_path):
    """hf_scale_state.json (both loops' savers call checkpoint.write_state with the run's spec): every batch fact
    is the spec's, and the file reads back (checkpoint_verification.read_state, what a resume and export read)."""
    from hf_scale.contract import checkpoint_verification
    from hf_scale.train.checkpoint import store

    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, seed=7, data_seed=9)
    spec = run_spec.build(_request(strategy="deepspeed", zero_stage=2, launcher="accelerate"), args, loop=loop,
                          packing=False)
    position = {"epoch": 1, "samples_consumed_in_epoch": 16} if loop == "accelerate" else {}
    store.write_state(tmp_path, step=5, spec=spec, **position)
    assert checkpoint_verification.read_state(tmp_path) == {
        "step": 5, **position, "world_size": 4, "strategy": "deepspeed", "zero_stage": 2, "micro_batch_size": 2,
        "gradient_accumulation_steps": 3, "global_batch_size": 24, "precision": "no", "seed": 7, "data_seed": 9,
        "loop": loop, "parallelism": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 1, "sp": 1, "ep": 1},
        "quantization": None,  # a full-precision base: an adapter resumes only on the base it was trained on
    }


def test_tensor_parallel_ranks_count_once_in_the_batch_arithmetic(tmp_path):
    """dp_shard=2 x tp=2 on 4 processes: 2 data-parallel ranks; the global batch, the guard's expectation and the
    checkpoint's layout say so."""
    from hf_scale.config.parallelism import Layout

    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    spec = run_spec.build(_request(strategy="fsdp", layout=Layout(dp_shard=2, tp=2)), args, loop="accelerate",
                          packing=False)
    assert (spec.data_parallel_size, spec.global_batch_size, spec.expected.tp) == (2, 12, 2)
    assert spec.describe().startswith("fsdp (dp_shard=2 x tp=2) on 4 process(es)")


def test_one_line_says_global_accumulation_and_local_batch(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    line = run_spec.build(_request(world_size=2), args, loop="trainer", packing=True).describe()
    assert "\n" not in line
    assert line == ("ddp on 2 process(es) (torchrun), trainer loop: global batch size 16, gradient accumulation "
                    "steps 4, local batch size 2; precision no, packing")


@pytest.mark.parametrize(("micro", "accumulation", "world", "global_batch", "precision"), [
    (2, 2, 2, 16, "no"),  # global is not micro x accumulation x world
    (0, 1, 1, 0, "no"),
    (1, 1, 1, 1, "fp8"),
])
def test_an_inconsistent_spec_cannot_be_built(micro, accumulation, world, global_batch, precision):
    with pytest.raises(AssertionError):
        RunSpec(launcher="python", strategy="single", world_size=world, loop="trainer", micro_batch_size=micro,
                gradient_accumulation_steps=accumulation, global_batch_size=global_batch, precision=precision,
                seed=0, data_seed=0, packing=False)


def test_training_arguments_are_built_without_changing_the_parsed_flags(tmp_path):
    PartialState(cpu=True)  # what train.py creates first; TrainingArguments reuses it (use_configured_state)
    ns, _ = build_parser().parse_known_args(["--output_dir", str(tmp_path), "--bf16", "--push_to_hub"])
    before = copy.deepcopy(vars(ns))
    args = prepare._training_arguments(ns)
    assert vars(ns) == before
    assert args.push_to_hub is False  # hf_scale pushes itself, after the save check
    assert args.use_cpu == (not torch.cuda.is_available())
    assert args.dataloader_num_workers == 0  # no GPU: collation in the training process
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
    assert kwargs == {"use_reentrant": False}


def test_micro_batch_per_rank_reads_accelerates_prepared_loader():
    rows = list(range(12))
    assert micro_batch_per_rank(DataLoader(rows, batch_size=3), 1) is None  # not prepared: unknown
    prepared = Accelerator(cpu=True).prepare(DataLoader(rows, batch_size=3))
    assert micro_batch_per_rank(prepared, 1) == 3
    split = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    assert micro_batch_per_rank(split.prepare(DataLoader(rows, batch_size=4)), 1) == 4  # one process: all of it
