"""Resuming at another world size (2 -> 1 and 1 -> 2 processes) in the manual loop, and the refusals.

Both runs of a pair have the same global batch (2 processes x accumulation 2 = 1 process x accumulation
4), so the resumed steps must equal the uninterrupted run's (rtol 1e-4: the reduction order differs).
What check_resumable decides for sequence-parallel checkpoints is tested here without processes; the resumes it
allows run in tests/train/model/test_sequence_parallel_train.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace

import pytest
from checkpoint_runs import COMMON, launcher, strategy_args, trained
from train_helpers import TRAIN_PY, launcher_command, read_metrics, run, run_ok, training_traceback_frames

from hf_scale.config.parallelism import Layout
from hf_scale.contract import checkpoint_layout
from hf_scale.errors import UserError
from hf_scale.train.checkpoint import reshard, store
from hf_scale.train.setup.run_spec import RunSpec


def _resume(tmp_path_factory, tmp_path, strategy: str, saved_procs: int, new_procs: int):
    """Resume `checkpoint-2` of a `saved_procs` run with `new_procs` processes; (uninterrupted, resumed) metrics."""
    full = trained(tmp_path_factory, strategy, saved_procs)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    result = run_ok(launcher(strategy, new_procs) + COMMON + strategy_args(tmp_path_factory, strategy, new_procs)
                    + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert f"resuming from {out / 'checkpoint-2'}" in result.stderr
    return read_metrics(full), read_metrics(out), result


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("strategy", "saved_procs", "new_procs"),
    # DeepSpeed: ZeRO-2 grows (1 -> 2), ZeRO-3 shrinks (2 -> 1); both go through DeepSpeed's universal checkpoint.
    [("ddp", 2, 1), ("ddp", 1, 2), ("zero2", 1, 2), ("zero3", 2, 1), ("fsdp", 2, 1), ("fsdp", 1, 2)],
    ids=lambda v: str(v),
)
def test_resume_at_another_world_size_continues_the_uninterrupted_run(
    strategy, saved_procs, new_procs, tmp_path_factory, tmp_path
):
    full, resumed, result = _resume(tmp_path_factory, tmp_path, strategy, saved_procs, new_procs)
    assert [r["step"] for r in resumed] == [3, 4]
    want = {r["step"]: r for r in full}
    for record in resumed:
        assert record["loss"] == pytest.approx(want[record["step"]]["loss"], rel=1e-4)
        assert record["lr"] == pytest.approx(want[record["step"]]["lr"], rel=1e-6)
        assert record["tokens"] == want[record["step"]]["tokens"]  # the same samples: the data position is right
    if strategy.startswith("zero"):
        assert "DeepSpeed universal checkpoint" in result.stderr
        # The temporary universal view is gone; only real checkpoints remain.
        assert not list((tmp_path / "resumed").glob(f"{checkpoint_layout.TMP_PREFIX}*"))
    saved = checkpoint_layout.complete_checkpoints(tmp_path / "resumed")
    assert [p.name for p in saved] == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.multiprocess
def test_trainer_path_refuses_another_world_size_before_training(tmp_path):
    out = tmp_path / "run"
    base = ["--max_steps", "2", "--save_steps", "2", "--per_device_train_batch_size", "2", "--loop", "trainer"]
    run_ok([sys.executable, TRAIN_PY, *base, "--output_dir", str(out)])
    result = run(launcher_command("torchrun", nproc=2) + base + ["--max_steps", "4", "--output_dir", str(out),
                                                                 "--resume_from_checkpoint", "auto"])
    assert result.returncode != 0
    assert (
        f"train.py: error: --resume_from_checkpoint={out / 'checkpoint-2'}: saved by 1 processes, resumed with 2; "
        "the Trainer path resumes only at the same world size" in result.stderr
    )
    assert "hf-scale export" in result.stderr
    assert not training_traceback_frames(result.stderr)  # one line from train.py (torchrun adds its own report)
    assert not (out / "metrics.jsonl").read_text().count('"step": 3')  # refused before any training step


@pytest.mark.multiprocess
def test_resume_with_another_strategy_is_refused_with_how_to_convert(tmp_path_factory, tmp_path):
    full = trained(tmp_path_factory, "ddp", 1)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    result = run(launcher_command("torchrun", nproc=1) + COMMON + strategy_args(tmp_path_factory, "zero2", 1)
                 + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    assert result.returncode != 0 and not training_traceback_frames(result.stderr)
    assert "saved with full states (DDP / one process), resumed with DeepSpeed ZeRO-2" in result.stderr
    assert f"hf-scale export {out / 'checkpoint-2'} EXPORT_DIR" in result.stderr
    assert not (out / "metrics.jsonl").exists()


def _spec(loop: str, world: int, sp: int, micro: int) -> RunSpec:
    dp = world // sp
    return RunSpec(launcher="torchrun", strategy="deepspeed", world_size=world, loop=loop, micro_batch_size=micro,
                   gradient_accumulation_steps=1, global_batch_size=micro * dp, precision="no", seed=11,
                   data_seed=11, packing=False, zero_stage=2, layout=Layout(dp_shard=dp, sp=sp))


# (saved world, sp, micro; micro-batches per rank at the save) -> (resumed world, sp, micro): None if it resumes.
SP_CASES = {
    "same layout, inside a round": ((4, 2, 2, 3), (4, 2, 2), None),
    "one sp group, inside a round, at sp=1": ((2, 2, 4, 3), (2, 1, 2), None),
    "round ends, at sp=1": ((4, 2, 2, 4), (4, 1, 2), None),
    "round ends, sp=4 -> sp=2": ((4, 4, 1, 8), (4, 2, 1), None),
    "sp=1 into sp=2, round ends": ((4, 1, 2, 4), (4, 2, 2), None),
    "two sp groups, inside a round, at sp=1": ((4, 2, 2, 3), (4, 1, 2), "step 3 ends inside a round"),
    "sp=1 into a round of two sp groups": ((4, 1, 1, 3), (4, 2, 2), "step 3 ends inside a round"),
    "another micro batch, inside a round": ((4, 2, 2, 3), (4, 2, 1), "step 3 ends inside a round"),
    "another world size": ((2, 2, 4, 2), (1, 1, 4), "sp=2: saved by 2 processes, resumed with 1; DeepSpeed records"),
    "sp=1 into sp=2 at another world size": ((2, 1, 2, 2), (4, 2, 2), "sp=2: saved by 2 processes, resumed with 4"),
}


@pytest.mark.parametrize("case", SP_CASES, ids=str)
def test_which_sequence_parallel_positions_resume_at_another_layout(case, tmp_path):
    """The manual loop: an sp position (saved with one step per micro-batch) at another sp, data-parallel size or
    micro batch is taken up where it is a prefix of the epoch's batch order on both sides; never at another world
    size (DeepSpeed's converter reads the sp group as tensor parallelism)."""
    (world, sp, micro, batches), resumed_as, refusal = SP_CASES[case]
    saved = _spec("accelerate", world, sp, micro)
    store.write_state(tmp_path, step=batches, spec=saved, epoch=0,
                           samples_consumed_in_epoch=batches * micro * saved.data_parallel_size)
    resumed = _spec("accelerate", *resumed_as)
    if refusal is None:
        assert reshard.check_resumable(tmp_path, resumed)["step"] == batches
        return
    with pytest.raises(UserError) as error:
        reshard.check_resumable(tmp_path, resumed)
    assert str(error.value).startswith(f"--resume_from_checkpoint={tmp_path}: {refusal}")
    assert "\n" not in str(error.value)
    if "inside a round" in refusal:
        assert f"resume with sp={sp} and --per_device_train_batch_size {micro}" in str(error.value)


@pytest.mark.parametrize(("saved_sp", "resumed_sp"), [(2, 2), (2, 1), (1, 2)])
def test_the_trainer_path_refuses_sequence_parallel_checkpoints_either_way(saved_sp, resumed_sp, tmp_path):
    store.write_state(tmp_path, step=2, spec=_spec("trainer", 2, saved_sp, 2))
    with pytest.raises(UserError, match="^--resume_from_checkpoint=.*: sp=2: the Trainer path does not resume "
                                        "sequence-parallel runs .*; train them with --loop accelerate"):
        reshard.check_resumable(tmp_path, _spec("trainer", 2, resumed_sp, 2))


@pytest.mark.parametrize(("saved", "resumed", "refusal"), [
    ("4bit", None, "saved on a 4-bit base (--load_in_4bit), resumed on an unquantized base; its adapter continues "
                   "only on the base it was trained on: resume with --load_in_4bit, or convert it"),
    (None, "4bit", "saved on an unquantized base, resumed on a 4-bit base (--load_in_4bit); its adapter continues "
                   "only on the base it was trained on: resume without --load_in_4bit, or convert it"),
    ("4bit", "4bit", None), (None, None, None)])
def test_an_adapter_resumes_only_on_the_base_quantization_it_was_trained_on(saved, resumed, refusal, tmp_path):
    """A QLoRA checkpoint resumed without --load_in_4bit would continue its adapter on a full-precision base without
    a word: hf_scale_state.json records the base's quantization, and another one is refused before anything loads."""
    spec = _spec("accelerate", 2, 1, 2)
    store.write_state(tmp_path, step=2, spec=replace(spec, quantization=saved), epoch=0,
                           samples_consumed_in_epoch=8)
    if refusal is None:
        assert reshard.check_resumable(tmp_path, replace(spec, quantization=resumed))["quantization"] == saved
        return
    with pytest.raises(UserError) as error:
        reshard.check_resumable(tmp_path, replace(spec, quantization=resumed))
    assert str(error.value).startswith(f"--resume_from_checkpoint={tmp_path}: {refusal}")
    assert "\n" not in str(error.value)


def _written_before_quantization_was_recorded(path, spec, config: dict | None, adapter: bool = False) -> None:
    """A checkpoint as hf_scale wrote it before hf_scale_state.json recorded the base's quantization: the state
    without it, the saved config.json (`config`, None: none) and, for LoRA, the adapter config."""
    store.write_state(path, step=2, spec=spec, epoch=0, samples_consumed_in_epoch=8)
    state = json.loads((path / "hf_scale_state.json").read_text())
    del state["quantization"]
    (path / "hf_scale_state.json").write_text(json.dumps(state))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if adapter:
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))


QLORA_CONFIG = {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                               "bnb_4bit_quant_type": "nf4"}}


@pytest.mark.parametrize(("config", "adapter", "resumed", "refusal"), [
    (QLORA_CONFIG, True, None, "saved on a 4-bit base (--load_in_4bit) (read from its config.json: its "
                               "hf_scale_state.json predates the record of the quantization), resumed on an "
                               "unquantized base; its adapter continues only on the base it was trained on: resume "
                               "with --load_in_4bit"),
    ({"model_type": "llama"}, True, "4bit", "saved on an unquantized base (read from its config.json"),
    (None, True, None, "records no quantization of its base (no \"quantization\" in hf_scale_state.json, no "
                       "config.json), so it cannot be told whether its adapter was trained on an unquantized base"),
    (None, False, "4bit", "records no quantization of its base"),
    (QLORA_CONFIG, True, "4bit", None), ({"model_type": "llama"}, True, None, None), (None, False, None, None)],
    ids=["config-4bit-resumed-plain", "config-plain-resumed-4bit", "no-record-adapter", "no-record-4bit-run",
         "config-4bit-same", "config-plain-same", "no-record-full-model"])
def test_a_checkpoint_written_before_quantization_was_recorded_is_judged_by_its_config(config, adapter, resumed,
                                                                                      refusal, tmp_path):
    """Older checkpoints' hf_scale_state.json has no "quantization": the saved config.json's quantization_config
    (transformers writes it for a quantized model) says which base; where nothing says, an adapter or a quantized
    run is refused in one line rather than assumed."""
    spec = _spec("accelerate", 2, 1, 2)
    _written_before_quantization_was_recorded(tmp_path, spec, config, adapter)
    if refusal is None:
        assert reshard.check_resumable(tmp_path, replace(spec, quantization=resumed))["step"] == 2
        return
    with pytest.raises(UserError) as error:
        reshard.check_resumable(tmp_path, replace(spec, quantization=resumed))
    assert str(error.value).startswith(f"--resume_from_checkpoint={tmp_path}: {refusal}")
    assert "\n" not in str(error.value)




def _ep_spec(world: int, ep: int, loop: str = "accelerate") -> RunSpec:
    return RunSpec(launcher="torchrun", strategy="fsdp", world_size=world, loop=loop, micro_batch_size=2,
                   gradient_accumulation_steps=1, global_batch_size=2 * world, precision="no", seed=11,
                   data_seed=11, packing=False, zero_stage=None, layout=Layout(dp_shard=world, ep=ep))


@pytest.mark.parametrize(("saved", "resumed", "recorded"), [
    ((2, 2), (2, 2), True), ((2, 1), (2, 1), True),       # the same split resumes
    ((4, 2), (4, 4), True), ((4, 4), (4, 1), True),       # another ep
    ((2, 2), (4, 2), True), ((2, 2), (1, 1), True),       # another world size (and ep)
    ((2, 1), (2, 2), False),                              # a state from before ep was recorded
])
def test_an_expert_parallel_checkpoint_resumes_at_another_ep_only_in_the_manual_loop(saved, resumed, recorded,
                                                                                     tmp_path):
    """hf_scale_state.json records ep; the manual loop resumes an EP checkpoint at any ep and world size (run in
    tests/train/model/test_model_expert_parallel.py); the Trainer path refuses another ep in one line, and another
    world size with its own line for every strategy."""
    store.write_state(tmp_path, step=2, spec=_ep_spec(*saved), epoch=0, samples_consumed_in_epoch=8)
    state = json.loads((tmp_path / "hf_scale_state.json").read_text())
    assert state["parallelism"]["ep"] == saved[1]
    if not recorded:
        del state["parallelism"]["ep"]
        (tmp_path / "hf_scale_state.json").write_text(json.dumps(state))
    assert reshard.check_resumable(tmp_path, _ep_spec(*resumed))["step"] == 2
    (tmp_path / "hf_scale_state.json").write_text(json.dumps({**state, "loop": "trainer"}))
    if saved == resumed:
        assert reshard.check_resumable(tmp_path, _ep_spec(*resumed, loop="trainer"))["step"] == 2
        return
    with pytest.raises(UserError) as error:
        reshard.check_resumable(tmp_path, _ep_spec(*resumed, loop="trainer"))
    convert = (f"or convert it with `hf-scale export {tmp_path} EXPORT_DIR` and start a new run from it "
               "(--model_name_or_path EXPORT_DIR; the optimizer state starts fresh)")
    if saved[0] != resumed[0]:
        assert str(error.value) == (
            f"--resume_from_checkpoint={tmp_path}: saved by {saved[0]} processes, resumed with {resumed[0]}; the "
            f"Trainer path resumes only at the same world size: launch {saved[0]} processes, train with --loop "
            f"accelerate (resumes at any world size), {convert}")
        return
    predates = "" if recorded else " (its hf_scale_state.json predates the record of ep)"
    assert str(error.value) == (
        f"--resume_from_checkpoint={tmp_path}: saved with ep={saved[1]}{predates}, resumed with ep={resumed[1]}; the "
        f"Trainer path resumes expert-parallel checkpoints only at the ep that saved them (resharding the experts is "
        f"proven in the manual loop only): resume with parallelism.ep={saved[1]}, train with --loop accelerate "
        f"(resumes at another ep or world size), {convert}")
