"""The benchmark scripts run end to end (tiny settings: this proves they work, it measures nothing).

Timings are never asserted; what is asserted holds whatever the machine: the results file records its
environment, every variant produced a number, and compared variants computed the same losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import child_env, run

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
ENVIRONMENT_KEYS = {"date", "torch", "transformers", "accelerate", "deepspeed", "device", "cores", "cpu"}


def _bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The benchmark script run as `python benchmarks/SCRIPT ARGS` (from the tests' preloaded fork server: the
    variants it starts are its own subprocesses, as anywhere)."""
    return run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=child_env(), timeout=timeout)


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
    for expected in ("MFU", "--variants", "--cpu-smoke", "--peak-tflops", "baseline", "torch_packed_bf16",
                     "hf_scale_best", "--budget", "--variant-timeout", "--profile", "--merge"):
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
    # 2 steps, 1 timed: startup dominates either way; this proves the script, it measures nothing.
    data = _ok("overhead.py", tmp_path, "--reps", "1", "--steps", "2", "--warmup", "1")
    assert set(data["results"]) == {"accelerate", "trainer"}
    for path, result in data["results"].items():
        assert result["cpu"]["pairs"] == 1 and result["cpu"]["median_paired_ratio"] > 0
        assert result["wall"]["median_paired_ratio"] > 0
        for variant in ("hf_scale", "baseline"):
            run = data["runs"][path][variant][0]
            assert len(run["step_times_s"]) == 2 and all(cpu > 0 for cpu in run["step_cpu_s"]), (path, variant)
        # Same model, data, order and optimizer: both loops train identically (the Trainer logs 4 digits).
        assert result["max_abs_loss_diff"] < 1e-3, path


def test_overhead_verdict_needs_the_whole_interval_on_one_side_of_the_goal():
    sys.path.insert(0, str(BENCH))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCH))
    assert overhead.paired_statistics([1.00, 1.01, 0.99, 1.00, 1.005, 1.01])["verdict"] == "met"
    assert overhead.paired_statistics([1.10, 1.12, 1.08, 1.09, 1.11, 1.10])["verdict"] == "not met"
    straddling = overhead.paired_statistics([0.92, 1.21, 1.015, 0.98, 1.13, 1.05])
    assert straddling["verdict"] == "undecided" and straddling["pairs"] == 6
    low, high = straddling["interval_90"]
    assert low <= straddling["median_paired_ratio"] <= high and low < overhead.GOAL < high


@pytest.mark.multiprocess
def test_packing_compares_budget_rows_with_padded_batches(tmp_path):
    # 2 steps, 1 timed, 2 padded examples per step: the script's whole pipeline at ~4/5 of the CPU of 3 steps of 8.
    data = _ok("packing.py", tmp_path, "--reps", "1", "--steps", "2", "--warmup", "1", "--rows", "64",
               "--micro-batch", "2")
    results, runs = data["results"], data["runs"]
    assert results["effective_tokens_per_s"]["packed"] > 0 and results["effective_tokens_per_s"]["padded"] > 0
    assert all(0 < tokens <= 1024 for tokens in runs["packed"][0]["tokens_per_step"])  # one row of <= 1,024
    assert all(loss > 0 for loss in results["mean_step_loss"].values())
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
    """The plain Trainer, the plain PyTorch packed reference (its bf16-parameter form: torch_packed is the same
    worker without the cast), hf_scale's best configuration (without its GPU-only flags), ZeRO-3 through the
    generated launch script, QLoRA against LoRA on the same data (the comparison gpu.py records for the GPU), and the
    profile of the fastest variant."""
    data = _ok(
        "gpu.py", tmp_path, "--cpu-smoke", "--variants", "baseline", "torch_packed_bf16",
        "hf_scale_best", "hf_scale_zero3", "hf_scale_lora", "hf_scale_qlora", "--steps", "3", "--warmup", "1",
        "--seq-len", "256", "--budget", "512",
        "--rows", "64", "--threads", "1", "--profile",
    )  # fmt: skip
    assert data["status"] == "cpu smoke (not a measurement)"
    rows = data["results"]
    assert set(rows) == {"baseline", "torch_packed_bf16", "hf_scale_best", "hf_scale_zero3", "hf_scale_lora",
                         "hf_scale_qlora"}
    qlora = data["precision"]["qlora_vs_lora"]
    # Same examples, same initial model: the 4-bit base moves the loss a little, never a lot (random init, 2 steps)
    assert qlora["tokens_per_s_ratio"] > 0 and abs(qlora["mean_loss_difference"]) < 0.5
    assert all(row["vs_baseline"] > 0 and row["mean_loss"] > 0 for row in rows.values())
    assert all(0 < rows[name]["tokens_per_step"] <= 512 for name in ("torch_packed_bf16", "hf_scale_best"))
    assert rows["hf_scale_best"]["attention"] == "sdpa"  # what auto takes on a CPU
    assert data["setup"]["flops_per_token"] > 0 and "--use_liger_kernel" in data["setup"]["smoke_dropped_flags"]
    profile = data["profile"]
    assert profile["variant"] in rows and "Self CPU" in profile["top_kernels"] and "aten::mm" in profile["top_kernels"]
    assert Path(profile["file"]).read_text().endswith(profile["top_kernels"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_fp8_variant_is_generated_and_refused_cleanly_without_a_gpu(tmp_path):
    """hf_scale_fp8 runs through its generated accelerate launch script (precision: fp8 in the config and the YAML);
    on a machine without an fp8 GPU train.py refuses before the model loads, and the results hold that one line, no
    traceback (the launcher's report stays in the variant's stderr.log)."""
    import yaml

    from hf_scale.knowledge.precision_rules import fp8_machine_refusal

    data = _ok("gpu.py", tmp_path, "--cpu-smoke", "--variants", "hf_scale_fp8", "--steps", "3", "--warmup", "1",
               "--seq-len", "256", "--budget", "512", "--rows", "64", "--threads", "1")
    configs = tmp_path / "work" / "configs"
    assert (configs / "launch" / "hf_scale_fp8.accelerate.sh").is_file()
    launched = yaml.safe_load((configs / "accelerate_configs" / "hf_scale_fp8.yaml").read_text())
    assert launched["mixed_precision"] == "fp8" and launched["fp8_config"]["backend"] == "AO"
    assert yaml.safe_load((configs / "hf_scale_configs" / "hf_scale_fp8.yaml").read_text())["precision"] == "fp8"
    assert data["results"] == {"hf_scale_fp8": {"refused": fp8_machine_refusal("torchao", capability=None,
                                                                               importable=True)}}
    assert "Traceback" not in json.dumps(data) and data["precision"] == {}
    assert "train.py: error: precision=fp8" in (tmp_path / "work" / "hf_scale_fp8" / "stderr.log").read_text()


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


def _gpu_module():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu
    finally:
        sys.path.remove(str(BENCH))
    return gpu


def test_gpu_variant_process_keeps_its_whole_stderr_and_its_exit_code(tmp_path):
    gpu = _gpu_module()
    noisy = "import sys; sys.stderr.write('x' * 20000 + '\\nreal error\\n'); sys.exit(3)"
    code, stderr = gpu.run_process([sys.executable, "-c", noisy], env=None, timeout=60, log_dir=tmp_path / "v")
    assert code == 3 and len(stderr) == 20012 and stderr.endswith("real error\n")
    assert (tmp_path / "v" / "stderr.log").read_text() == stderr


def test_gpu_variant_past_its_time_limit_is_killed_with_its_children(tmp_path):
    gpu = _gpu_module()
    # A child that would outlive its parent (like torchrun's workers): killing the process group takes it too.
    sleeper = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(60)']); print(child.pid, file=sys.stderr, flush=True); time.sleep(60)")
    with pytest.raises(gpu.VariantFailed) as info:
        gpu.run_process([sys.executable, "-c", sleeper], env=None, timeout=3, log_dir=tmp_path / "v")
    assert str(info.value) == "timed out after 3 s"
    child = Path(f"/proc/{int(info.value.stderr)}/stat")
    deadline = time.monotonic() + 10
    while child.exists() and child.read_text().split(")")[1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child.exists() or child.read_text().split(")")[1].split()[0] == "Z", "the child survived"


def test_gpu_merge_keeps_rows_only_of_the_same_setup(tmp_path):
    gpu = _gpu_module()
    output = tmp_path / "gpu.json"
    output.write_text(json.dumps({"setup": {"budget": 16384}, "results": {"baseline": {"tokens_per_s": 1.0}}}))
    assert gpu._previous_rows(output, {"budget": 16384}) == {"baseline": {"tokens_per_s": 1.0}}
    assert gpu._previous_rows(output, {"budget": 8192}) == {}


def test_checkpoint_checksums_measures_hashing_sealing_and_verifying(tmp_path):
    data = _ok("checkpoint_checksums.py", tmp_path, "--size-mb", "4", "--files", "2", "--reps", "1")
    results = data["results"]
    assert set(results["hash_gb_per_s"]) == {"xxh3_128", "blake2b", "sha256"}
    assert all(results[key] > 0 for key in ("write_fsync_s_per_gb", "seal_s_per_gb", "verify_s_per_gb"))


def test_train_help_benchmark_times_every_command(tmp_path):
    output = tmp_path / "train_help.json"
    result = _bench("train_help.py", "--reps", "1", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(output.read_text())
    assert set(data["environment"]) >= ENVIRONMENT_KEYS
    assert set(data["results"]) == {"python", "import_torch", "help", "help_live_parser"}
    assert all(r["median_s"] > 0 for r in data["results"].values())


def test_gpu_cp_script_documents_what_one_gpu_can_and_cannot_show():
    result = _bench("gpu_cp.py", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for expected in ("--one-gpu-gloo", "--cpu-smoke", "--loops", "--rtol", "NCCL refuses them", "cannot show speed"):
        assert expected in result.stdout


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the behaviour without 2 GPUs")
def test_gpu_cp_script_without_two_gpus_fails_in_one_line_and_records_not_run(tmp_path):
    output = tmp_path / "gpu_cp.json"
    result = _bench("gpu_cp.py", "--output", str(output), "--workdir", str(tmp_path / "work"), timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "cp=2 needs 2 (NCCL refuses two ranks on one device" in result.stderr
    data = json.loads(output.read_text())
    assert data["status"] == "not run" and set(data["environment"]) >= ENVIRONMENT_KEYS


def test_gpu_fsdp_final_save_check_is_ready_for_a_gpu(tmp_path):
    """benchmarks/gpu_fsdp_final_save.py proves on GPUs what no CPU run can reach (accelerate keeps its FSDP plugin
    only on GPUs): its launch config is the corpus' SHARDED_STATE_DICT FSDP2 file and accelerate reads it as such,
    its train.py flags parse, and without a GPU it records "not run" in one line."""
    from accelerate.commands.config.config_args import load_config_from_file

    from hf_scale.contract.parser import build_parser

    work = tmp_path / "work"
    result = _bench("gpu_fsdp_final_save.py", "--workdir", str(work), "--dry-run", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    train, export = [line.split() for line in result.stdout.strip().splitlines()]
    config = load_config_from_file(str(work / "fsdp2.yaml"))
    assert config.distributed_type == "FSDP" and config.mixed_precision == "no"
    assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert config.fsdp_config["fsdp_version"] == 2
    flags = train[train.index(str(REPO / "train.py")) + 1:]
    ns, unknown = build_parser().parse_known_args(flags)
    assert unknown == [] and ns.loop == "trainer" and ns.max_steps == ns.save_steps == 4
    assert export[-2] == str(work / "out" / "checkpoint-4")
    if torch.cuda.is_available():
        return
    output = tmp_path / "result.json"
    result = _bench("gpu_fsdp_final_save.py", "--workdir", str(work), "--output", str(output), timeout=300)
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr[-3000:]
    assert "not run: no GPU" in result.stderr and "not_run" in json.loads(output.read_text())


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_gpu_cp_script_compares_a_two_rank_train_py_run_with_one_process_on_cpu(tmp_path):
    """benchmarks/gpu_cp.py --cpu-smoke: the cp=2 pipeline with dp_shard=2 (FSDP2 over gloo) in place of cp=2, whose
    ring attention has no CPU kernel; train.py refuses cp=2 here in one line naming it."""
    data = _ok("gpu_cp.py", tmp_path, "--cpu-smoke", "--steps", "3")
    assert data["status"] == "cpu smoke (not a measurement)"
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in data["results"]["cp_refused_on_cpu"]
    run = data["results"]["accelerate"]
    assert run["problems"] == [] and [r["step"] for r in run["two_ranks"]] == [1, 2, 3]
    assert run["two_ranks"][0]["grad_norm"] > 0


def test_gpu_cp_comparison_names_every_step_that_differs():
    sys.path.insert(0, str(BENCH))
    try:
        from gpu_cp import compare
    finally:
        sys.path.remove(str(BENCH))
    one = [{"step": 1, "loss": 2.0, "grad_norm": 1.0, "tokens": 10}, {"step": 2, "loss": 1.9, "grad_norm": 0.9,
                                                                       "tokens": 12}]
    assert compare(one, [dict(r) for r in one], 1e-3) == []
    two = [dict(one[0], grad_norm=1.01), dict(one[1], tokens=11)]
    assert compare(one, two, 1e-3) == ["step 1: grad_norm 1.01 against one process's 1.0",
                                       "step 2: 11 tokens against one process's 12"]
    assert compare(one, two[:1], 1e-3) == ["steps [1] against [1, 2]"]


def _session_plan(*stages: str) -> dict[str, list[list[str]]]:
    """benchmarks/gpu_session.sh --dry-run: each stage's commands, split into words."""
    result = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "--dry-run", *stages], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plan: dict[str, list[list[str]]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("# "):
            plan[line.split()[1]] = []
        else:
            plan[list(plan)[-1]].append(line.split())
    return plan


def test_the_gpu_session_plans_every_check_of_the_gpu_issue_with_arguments_its_scripts_take():
    """The one device call a session with a GPU makes: every stage's command names a script, variant, candidate,
    preset and train.py flags that exist, all gpu.py calls share one setup (so --merge keeps the earlier rows),
    and the stages' limits fit one device call."""
    sys.path.insert(0, str(BENCH))
    try:
        from gpu import VARIANTS
        from planner_gpu_memory import DEFAULT_CANDIDATES
    finally:
        sys.path.remove(str(BENCH))
    from hf_scale.config.presets import PRESETS
    from hf_scale.contract.parser import build_parser

    plan = _session_plan()
    assert list(plan) == ["install", "doctor", "throughput", "memory", "saves", "precision", "fsdp_save"]
    gpu_setups, variants = set(), []
    for stage, commands in plan.items():
        for words in commands:
            scripts = [w for w in words if w.startswith("benchmarks/")]
            assert all((REPO / s).is_file() for s in scripts), (stage, words)
            if "benchmarks/gpu.py" in words:
                at = words.index("--variants")
                variants.append(words[at + 1])
                setup = [w for w in words[at + 2:] if w not in ("--merge", "--profile")]
                gpu_setups.add(tuple(setup[:setup.index("--output")]))
                assert "--merge" in words
            if "benchmarks/planner_gpu_memory.py" in words:
                assert words[words.index("--candidates") + 1] in DEFAULT_CANDIDATES
            if "generate" in words:
                assert words[words.index("--preset") + 1] in PRESETS
            if words[0] == "bash":  # a generated launch script: the rest is train.py's flags
                namespace, unknown = build_parser().parse_known_args(words[2:])
                assert unknown == [] and namespace.max_steps == 4, words
    assert len(gpu_setups) == 1
    assert set(variants) <= set(VARIANTS) and {"baseline", "hf_scale_best", "hf_scale_fp8", "hf_scale_qlora"} <= set(
        variants)
    text = (BENCH / "gpu_session.sh").read_text()
    assert "DEADLINE_S=${DEADLINE_S:-570}" in text  # inside one device call's 600 s


def test_the_gpu_session_runs_its_stages_keeps_their_logs_and_refuses_an_unknown_stage(tmp_path):
    """The runner itself, on CPU: the doctor stage runs for real, its log and the summary land in $OUT; a stage
    past the session's deadline is skipped, not started; an unknown stage is one line, exit 2."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
           "DEADLINE_S": "300"}
    result = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "doctor"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "out" / "session.tsv").read_text().splitlines()
    assert summary[0] == "stage\texit\tseconds" and summary[1].startswith("doctor\t")
    log = (tmp_path / "out" / "doctor.log").read_text()
    assert "$ python3 -m hf_scale doctor --config" in log and "zero2" in log
    late = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "fsdp_save"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**env, "DEADLINE_S": "3"})
    assert "fsdp_save\tskipped (no time left)" in (tmp_path / "out" / "session.tsv").read_text(), late.stdout
    wrong = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "nope"], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "'nope' is not one of" in wrong.stderr


def test_planner_time_accuracy_prints_every_published_row_and_its_error(tmp_path):
    output, png = tmp_path / "acc.json", tmp_path / "acc.png"
    result = _bench("planner_time_accuracy.py", "--output", str(output), "--plot", str(png), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(output.read_text())
    assert len(data["rows"]) >= 30 and all("predicted" in row and "source" in row for row in data["rows"])
    assert f"{len(data['rows'])} rows: median absolute error" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
