"""The benchmark scripts run end to end (tiny settings: this proves they work, it measures nothing).

Timings are never asserted; what is asserted holds whatever the machine: the results file records its
environment, every variant produced a number, and compared variants computed the same losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
ENVIRONMENT_KEYS = {"date", "torch", "transformers", "accelerate", "deepspeed", "device", "cores", "cpu"}


def _bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _ok(script: str, tmp_path: Path, *args: str) -> dict:
    output = tmp_path / f"{Path(script).stem}.json"
    result = _bench(script, "--workdir", str(tmp_path / "work"), "--output", str(output), *args)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert f"wrote {output}" in result.stdout
    data = json.loads(output.read_text())
    assert set(data["environment"]) >= ENVIRONMENT_KEYS
    return data


def test_gpu_script_documents_its_options():
    result = _bench("gpu.py", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for expected in ("MFU", "--variants", "--cpu-smoke", "--peak-tflops", "baseline"):
        assert expected in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_script_without_gpu_fails_in_one_line_and_records_not_run(tmp_path):
    output = tmp_path / "gpu.json"
    result = _bench("gpu.py", "--output", str(output), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("gpu.py: error: no CUDA GPU")
    data = json.loads(output.read_text())
    assert data["status"] == "not run" and set(data["environment"]) >= ENVIRONMENT_KEYS
    # Results of a real GPU run are never replaced by a "not run" record.
    output.write_text(json.dumps({"status": "ok", "results": {"baseline": {}}}))
    assert _bench("gpu.py", "--output", str(output), timeout=120).returncode == 2
    assert json.loads(output.read_text())["status"] == "ok"


@pytest.mark.multiprocess
def test_overhead_compares_both_loops_with_their_baselines(tmp_path):
    data = _ok("overhead.py", tmp_path, "--reps", "1", "--steps", "3", "--warmup", "1")
    assert set(data["results"]) == {"accelerate", "trainer"}
    for path, result in data["results"].items():
        assert result["ratio"] > 0 and len(data["runs"][path]["hf_scale"][0]["step_times_s"]) == 3
        # Same model, data, order and optimizer: both loops train identically (the Trainer logs 4 digits).
        assert result["max_abs_loss_diff"] < 1e-3, path


@pytest.mark.multiprocess
def test_packing_sees_the_same_batches_and_loss_as_padding(tmp_path):
    data = _ok("packing.py", tmp_path, "--reps", "1", "--steps", "3", "--warmup", "1", "--rows", "64")
    results = data["results"]
    assert results["same_micro_batches"]
    assert results["max_relative_loss_diff"] < 1e-4
    assert results["effective_tokens_per_s"]["packed"] > 0 and results["effective_tokens_per_s"]["padded"] > 0
    assert data["setup"]["length_distribution"]["token_lengths"]["examples"] == 64


@pytest.mark.multiprocess
def test_strategies_run_two_processes_each_and_report_ratios_to_ddp(tmp_path):
    data = _ok(
        "strategies_cpu.py", tmp_path, "--strategies", "ddp", "zero3", "--reps", "1", "--steps", "3", "--warmup", "1"
    )
    rows = data["results"]
    assert rows["ddp"]["step_time_vs_ddp"] == 1.0
    assert rows["zero3"]["step_time_vs_ddp"] > 0 and rows["zero3"]["peak_rss_rank0_bytes"] > 0
    # The planner's per-rank model states: ZeRO-3 shards what DDP replicates.
    assert rows["zero3"]["planned_model_states_vs_ddp"] < 1
    # Both strategies train the same model on the same data: same losses.
    assert data["runs"]["zero3"][0]["losses"] == pytest.approx(data["runs"]["ddp"][0]["losses"], rel=1e-4)


@pytest.mark.multiprocess
def test_gpu_script_pipeline_runs_on_a_tiny_model_without_gpu(tmp_path):
    data = _ok(
        "gpu.py", tmp_path, "--cpu-smoke", "--variants", "baseline", "hf_scale", "--steps", "3", "--warmup", "1",
        "--seq-len", "256", "--rows", "64", "--threads", "1",
    )  # fmt: skip
    assert data["status"] == "cpu smoke (not a measurement)"
    assert data["results"]["hf_scale"]["vs_baseline"] > 0
    assert data["setup"]["flops_per_token"] > 0


def test_a_failed_command_keeps_its_whole_stderr_and_shows_the_last_lines():
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    script = "import sys\nfor i in range(3000): print(f'line {i}', file=sys.stderr)\nsys.exit(3)"
    with pytest.raises(common.CommandFailed) as failed:
        common.run_checked([sys.executable, "-c", script], env=None)
    record = failed.value.record()
    assert record["exit_code"] == 3 and record["stderr"].splitlines() == [f"line {i}" for i in range(3000)]
    shown = str(failed.value).splitlines()
    assert shown[-common.TAIL_LINES:] == [f"line {i}" for i in range(3000 - common.TAIL_LINES, 3000)]
    assert "line 0" not in shown


def test_planner_gpu_memory_documents_its_options():
    result = _bench("planner_gpu_memory.py", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for expected in ("--cpu-smoke", "--candidates", "--gpus", "whole stderr"):
        assert expected in result.stdout


@pytest.mark.multiprocess
def test_planner_gpu_memory_cpu_smoke_runs_zero3_without_a_compiler(tmp_path):
    """The GPU benchmark's pipeline on CPU with no compiler on PATH: ZeRO-3 (no optimizer block: fused torch
    AdamW) runs; the optimizer-offload candidate needs DeepSpeedCPUAdam and is reported, not crashed."""
    from train_helpers import no_compiler_env, path_without_compilers, prebuilt_shm_comm_op

    env = no_compiler_env(path_without_compilers(tmp_path / "bin"), prebuilt_shm_comm_op(tmp_path / "jit"))
    env["PYTHONPATH"] = str(REPO)
    output = tmp_path / "planner.json"
    result = subprocess.run(
        [sys.executable, str(BENCH / "planner_gpu_memory.py"), "--cpu-smoke", "--candidates", "zero3",
         "zero3_offload_opt", "--output", str(output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]  # one candidate could not run
    data = json.loads(output.read_text())
    assert data["status"] == "cpu smoke (not a measurement)" and set(data["environment"]) >= ENVIRONMENT_KEYS
    zero3, offload = data["rows"]
    assert zero3["candidate"] == "zero3" and zero3["measured_peak_allocated_bytes"] > 0 and "error" not in zero3
    assert zero3["predicted_bytes"] > 0
    (reason,) = offload["error"]["not_run"]
    assert "needs DeepSpeed's cpu_adam op" in reason
    assert any(line.startswith("zero3_offload_opt") and "NOT RUN" in line for line in result.stdout.splitlines())
    assert sorted(p.name for p in (tmp_path / "jit").iterdir()) == ["deepspeed_shm_comm"]  # nothing compiled
