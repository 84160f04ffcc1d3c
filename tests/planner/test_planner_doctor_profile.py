"""`hf-scale doctor --write-profile FILE` measures this node (on CPU: fp32 GEMM, memory copy, a 2-process gloo
all-reduce) and writes a profile `hf-scale plan --hardware FILE` reads; the plan's predictions follow the measured
numbers."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_scale.commands.cli import main
from hf_scale.doctor.hardware_profile import measure_node, profile_from_measurement
from hf_scale.planner.estimate import Candidate, Workload
from hf_scale.planner.hardware import hardware_from_file
from hf_scale.planner.published import shapes
from hf_scale.planner.time_model import LINK_EFFICIENCY, step_time


@pytest.mark.multiprocess
def test_doctor_writes_a_measured_profile_that_plan_reads(tmp_path, capsys):
    """The one spawn of doctor's all-reduce in the suite (2 gloo processes; it replaced test_doctor's own)."""
    path = tmp_path / "node.yaml"
    assert main(["doctor", "--write-profile", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    measured, written = result["measured"], yaml.safe_load(path.read_text())
    assert measured["device"] == "cpu" and measured["gemm_dtype"] == "float32" and measured["gemm_tflops"] > 0
    assert measured["allreduce_processes"] == 2 and measured["allreduce_busbw_gbps"] > 0
    assert written == result["profile"]
    # the numbers the plan will use are the measured ones (an unknown device: its measured rate is its peak)
    assert written["bf16_tflops"] == pytest.approx(measured["gemm_tflops"], rel=1e-3)
    assert written["gemm_efficiency"] == 1.0
    assert written["hbm_gbps"] == pytest.approx(measured["memory_copy_gbps"], rel=1e-3)
    assert written["intra_node_gbps"] == pytest.approx(measured["allreduce_busbw_gbps"] / LINK_EFFICIENCY, rel=1e-3)
    assert "measured GEMM float32" in written["source"] and "all-reduce" in written["source"]
    assert measured["allreduce_correct"]  # the all-reduce summed what it should (the gloo path of the GPU test)
    hw = hardware_from_file(str(path))  # what `plan --hardware FILE` reads (test_planner_hardware_file runs plan)
    assert hw.bf16_flops == pytest.approx(written["bf16_tflops"] * 1e12) and hw.name == "node"


def test_the_plans_predictions_scale_with_the_measured_numbers(tmp_path):
    """A node measured twice as fast (GEMM rate and memory bandwidth) is predicted about twice as fast: the profile
    file is read as `plan --hardware` reads it, and the time model runs on it."""
    measured = measure_node(allreduce_processes=0)
    w = Workload(shapes("llama3-8b"), gpus_per_machine=1, num_machines=1, seq_len=2048, micro_batch_size=1)
    times = []
    for factor in (1, 2):
        m = {**measured, "gemm_tflops": measured["gemm_tflops"] * factor,
             "memory_copy_gbps": measured["memory_copy_gbps"] * factor}  # fmt: skip
        path = tmp_path / f"node{factor}.yaml"
        path.write_text(yaml.safe_dump(profile_from_measurement(m)))
        times.append(step_time(w, Candidate("ddp", "DDP", "ddp"), hardware_from_file(str(path))))
    slow, fast = times
    # one GPU: no communication; compute and the optimizer step are bound by what was measured (the fixed per-layer
    # launch cost keeps it from exactly 2)
    assert fast.compute_s == pytest.approx(slow.compute_s / 2, rel=0.01)
    assert fast.optimizer_s == pytest.approx(slow.optimizer_s / 2, rel=1e-3)  # the file keeps 5 significant figures
    assert 1.98 < fast.tokens_per_s / slow.tokens_per_s <= 2.0 * (1 + 1e-4)  # 5 significant figures each


def test_write_profile_into_a_missing_directory_is_one_line_exit_2(tmp_path, capsys):
    target = tmp_path / "missing" / "node.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--write-profile", str(target), "--no-allreduce"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"--write-profile {target}: not a file in an existing directory" in lines[0], lines
    assert not target.parent.exists()
