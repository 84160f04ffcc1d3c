"""`hf-scale plan --calibrate RUN_DIR`: a run directory written by train.py's own writers (metrics.jsonl by
StepMetrics, hf_scale_state.json by write_state from a RunSpec, the model's config.json, hf_scale_live.json), and the
plan's prediction for that run's layout after calibration equal to the measured step."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time

import pytest
from paths import TINY_LLAMA
from train_helpers import TRAIN_PY, run_ok

from hf_scale.commands.cli import main
from hf_scale.config.parallelism import Layout
from hf_scale.contract import checkpoint_layout as layout
from hf_scale.planner import calibrate as calibration_module
from hf_scale.planner.calibrate import calibrate
from hf_scale.planner.hardware import hardware
from hf_scale.planner.time_model import step_time
from hf_scale.train.checkpoint.store import write_state
from hf_scale.train.loops.metrics import StepMetrics
from hf_scale.train.setup.run_spec import RunSpec

SEQ = 256


def make_run(path, *, strategy="fsdp", world=2, micro=2, accumulation=1, steps=4, zero_stage=None, checkpointing=False,
             run_layout=None):
    """A finished run's directory as train.py leaves it (main process' writers)."""
    path.mkdir()
    dp = world // (run_layout.model_parallel_size if run_layout else 1)
    spec = RunSpec(launcher="torchrun", strategy=strategy, world_size=world, loop="accelerate", micro_batch_size=micro,
                   gradient_accumulation_steps=accumulation, global_batch_size=micro * accumulation * dp,
                   precision="bf16", seed=0, data_seed=0, packing=True, zero_stage=zero_stage,
                   layout=run_layout or Layout())
    metrics = StepMetrics(str(path), is_main=True, total_steps=steps, world_size=world, flops_per_token=None,
                          progress_bar=False)
    for step in range(1, steps + 1):
        time.sleep(0.02 * step)  # steps of different lengths: the median is of the steps after the first
        metrics.log_step(step=step, loss=2.0, lr=1e-4, grad_norm=1.0, tokens=spec.global_batch_size * SEQ,
                         epoch=step / steps)
    metrics.close()
    checkpoint = path / f"{layout.PREFIX}{steps}"
    checkpoint.mkdir()
    write_state(checkpoint, step=steps, spec=spec, epoch=0, samples_consumed_in_epoch=steps * spec.global_batch_size)
    shutil.copy(TINY_LLAMA / "config.json", path / "config.json")
    (path / layout.LIVE_FILE).write_text(json.dumps({"activation_checkpointing": checkpointing}))
    return path


def measured(path):
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records[1:])


def test_the_file_names_are_train_pys():
    assert calibration_module.STATE == layout.STATE and calibration_module.LIVE == layout.LIVE_FILE


def test_after_calibration_the_plan_predicts_the_runs_layout_as_measured(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    argv = ["plan", str(run / "config.json"), "--gpus-per-machine", "2", "--seq-len", str(SEQ),
            "--micro-batch-size", "2", "--calibrate", str(run)]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    row = next(c for c in data["candidates"] if c["key"] == "fsdp2_full_shard")
    assert row["time"]["step_s"] == pytest.approx(measured(run), rel=0.01)
    cal = data["calibration"]
    assert cal["layout"] == "fsdp2_full_shard" and cal["steps"] == 3 and cal["seq_len"] == SEQ
    assert cal["factor"] == pytest.approx(cal["measured_step_s"] / cal["predicted_step_s"])
    assert f"calibrated from {run}: every predicted step x " in out.err
    # every candidate is corrected by the same factor
    assert main(["plan", str(run / "config.json"), "--gpus-per-machine", "2", "--seq-len", str(SEQ),
                 "--micro-batch-size", "2", "--json"]) == 0
    plain = {c["key"]: c["time"]["step_s"] for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert all(c["time"]["step_s"] == pytest.approx(plain[c["key"]] * cal["factor"]) for c in data["candidates"])
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith(f"calibrated from {run}: every predicted step x ")


@pytest.mark.parametrize(("kw", "engine", "stage", "checkpointing"), [
    ({"strategy": "ddp", "accumulation": 2, "checkpointing": True}, "ddp", 0, True),
    ({"strategy": "deepspeed", "zero_stage": 3, "world": 4}, "deepspeed", 3, False),
    ({"strategy": "fsdp", "world": 4, "run_layout": Layout(dp_shard=2, tp=2)}, "fsdp", 0, False),
])  # fmt: skip
def test_the_runs_layout_is_read_and_predicted_as_measured(kw, engine, stage, checkpointing, tmp_path):
    run = make_run(tmp_path / "run", **kw)
    hw = hardware("a100-80gb")
    cal = calibrate(str(run), hw, gpus_per_machine=8)
    c, w = cal.candidate, cal.workload
    assert (c.engine, c.zero_stage, c.activation_checkpointing) == (engine, stage, checkpointing)
    assert w.world_size == kw.get("world", 2) and cal.micro_steps == kw.get("accumulation", 1)
    predicted = step_time(w, c, cal.apply(hw), micro_steps=cal.micro_steps).step_s
    assert predicted == pytest.approx(measured(run), rel=0.01)


def remove(path, name):
    (path / name).unlink()


@pytest.mark.parametrize(("damage", "fragment"), [
    (lambda p: remove(p, "metrics.jsonl"), "no metrics.jsonl: not the output directory of a train.py run"),
    (lambda p: (p / "metrics.jsonl").write_text(""), "metrics.jsonl has no training step"),
    (lambda p: (p / "metrics.jsonl").write_text('{"step": 4, "eval_loss": 1.0}\nnot json\n'),
     "metrics.jsonl has no training step"),
    (lambda p: shutil.rmtree(p / "checkpoint-4"), "no checkpoint-STEP/hf_scale_state.json: the run's layout"),
    (lambda p: (p / "checkpoint-4" / "hf_scale_state.json").write_text('{"world_size": 0}'),
     "checkpoint-4/hf_scale_state.json lacks a valid world_size"),
    (lambda p: (p / "checkpoint-4" / "hf_scale_state.json").write_text("{"), "hf_scale_state.json cannot be read"),
    (lambda p: remove(p, "config.json"), "no config.json in it nor in checkpoint-4: the run's model cannot be read"),
    (lambda p: (p / "config.json").write_text('{"model_type": "nothing"}'), "the run's model cannot be read"),
])  # fmt: skip
def test_a_bad_run_directory_is_one_line_exit_2(damage, fragment, tmp_path, capsys):
    run = make_run(tmp_path / "run")
    damage(run)
    written = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(TINY_LLAMA), "--seq-len", str(SEQ), "--calibrate", str(run), "--write-config",
              str(written)])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"--calibrate {run}: " in lines[0] and fragment in lines[0], lines
    assert not written.exists()


def test_not_a_directory_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(TINY_LLAMA), "--calibrate", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_real_train_py_run_calibrates_the_plan_to_its_measured_step(tmp_path, capsys):
    """One tiny one-process run of train.py (CPU, fp32): its own run directory, read as written."""
    run = tmp_path / "real"
    run_ok([sys.executable, TRAIN_PY, "--max_steps", "4", "--packing", "--max_seq_length", "128",
            "--per_device_train_batch_size", "2", "--save_steps", "4", "--loop", "accelerate",
            "--output_dir", str(run)], timeout=300)
    cal = calibrate(str(run), hardware(), gpus_per_machine=1)
    assert (cal.candidate.key, cal.workload.world_size, cal.workload.micro_batch_size, cal.steps) == ("ddp", 1, 2, 3)
    assert 100 <= cal.workload.seq_len <= 128  # packed rows of 105-128 real tokens: the run's tokens per sequence
    assert main(["plan", str(run / "config.json"), "--gpus-per-machine", "1", "--seq-len", str(cal.workload.seq_len),
                 "--micro-batch-size", "2", "--precision", "no", "--calibrate", str(run), "--json"]) == 0
    ddp = next(c for c in json.loads(capsys.readouterr().out)["candidates"] if c["key"] == "ddp")
    assert ddp["time"]["step_s"] == pytest.approx(measured(run), rel=0.01)
