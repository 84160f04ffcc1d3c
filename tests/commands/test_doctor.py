"""`hf-scale doctor`: the report's structure on this (CPU) node, config verdicts with real checks and with given
GPU facts, --json, bad input, and the all-reduce measurement over gloo with 2 real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_helpers import child_env, no_compiler_env, path_without_compilers, stale_lock

from hf_scale.commands import doctor
from hf_scale.commands.cli import main

REPO = Path(__file__).resolve().parents[2]
H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85 * 10**9, "compute_capability": "9.0",
        "bf16": True, "fp8": True}
V100 = {"index": 0, "name": "Tesla V100-SXM2-32GB", "memory_bytes": 34 * 10**9, "compute_capability": "7.0",
        "bf16": False, "fp8": False}
USABLE = {"usable": True, "how": "prebuilt", "missing": []}


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_scale", "doctor", *args], cwd=REPO, env=env or child_env(),
                          capture_output=True, text=True, timeout=300)


def test_report_structure_on_this_node(tmp_path):
    report = doctor.build_report(config=None, output_dir=str(tmp_path / "not" / "yet"), allreduce=True)
    assert set(report) == {"host", "versions", "gpus", "build", "kernels", "parallelism", "environment", "disk",
                           "memlock_bytes", "allreduce", "fp8"}
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert report["memlock_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert set(report["parallelism"]) == {"tp", "cp", "sp", "ep", "hsdp"}
    assert report["parallelism"]["tp"]["usable"] is True  # torch 2.13, accelerate 1.15, transformers 5: TP on gloo
    if not report["gpus"]:
        assert "needs a CUDA GPU" in report["parallelism"]["cp"]["why"]
    assert report["versions"]["torch"] and report["versions"]["deepspeed"]
    assert set(report["kernels"]) == {"flash_attn", "torch_varlen_attention", "flex_attention", "liger_kernel"}
    assert set(report["build"]["deepspeed_ops"]) >= set(doctor.DEFAULT_OPS)
    assert report["disk"]["measured_at"] == str(tmp_path) and report["disk"]["free_bytes"] > 0
    if not report["gpus"]:
        assert report["allreduce"] == {"status": "skipped", "reason": "needs 2 or more GPUs (found 0)"}
        assert report["kernels"]["torch_varlen_attention"]["usable"] is False
    text = doctor.format_text(report)
    for title in ("versions", "GPUs", "build", "fp8", "kernels", "parallelism", "network", "disk", "all-reduce"):
        assert f"\n{title:<11} " in text


def test_fp8_report_names_the_capable_gpus_and_the_importable_backends():
    import importlib.util

    report = doctor.build_report(config=None, output_dir="/tmp", allreduce=False)["fp8"]
    assert report["gpu"] == any(g["fp8"] for g in doctor.gpus())
    assert set(report["backends"]) == {"torchao", "te", "msamp"}
    for name, module in {"torchao": "torchao", "te": "transformer_engine", "msamp": "msamp"}.items():
        assert (report["backends"][name] is None) == (importlib.util.find_spec(module) is None)
    if importlib.util.find_spec("torchao"):
        import torchao

        assert report["backends"]["torchao"] == torchao.__version__


def test_json_output_parses_and_exits_0_without_a_config(tmp_path):
    result = cli("--json", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)  # DeepSpeed's own log lines go to stderr
    assert report["disk"]["path"] == str(tmp_path) and "config" not in report


def test_network_variables_that_matter_are_listed():
    environ = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "n1",
               "FI_PROVIDER": "efa", "HOME": "/root", "PATH": "/bin", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert list(doctor.network_env(environ)) == ["FI_PROVIDER", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "NCCL_DEBUG",
                                                 "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]


def test_arch_list_trap_is_reported(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    build = doctor.build_tools([])
    assert "cannot parse '9.0a'" in build["arch_list_problem"]


def test_offload_config_without_a_compiler_cannot_run_here(tmp_path):
    """Real checks: this node's GPUs (none here) and its (stripped) build tools; exit 1 and why."""
    env = no_compiler_env(path_without_compilers(tmp_path / "bin"), tmp_path / "empty_jit_cache")
    config = tmp_path / "offload.yaml"
    config.write_text(yaml.safe_dump({"strategy": "deepspeed", "topology": {"processes_per_machine": 2},
                                      "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}}))
    result = cli("--config", str(config), "--json", "--no-allreduce", env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    report = json.loads(result.stdout)
    verdict = report["config"]
    assert verdict["can_run"] is False and verdict["kind"] == "DistributedConfig"
    assert any("needs DeepSpeed's cpu_adam op, which cannot load here" in p and "a C++ compiler" in p
               for p in verdict["problems"])
    assert report["build"]["cxx_compiler"] is None and report["build"]["deepspeed_ops"]["cpu_adam"]["usable"] is False
    text = doctor.format_text(report)  # what the command prints without --json
    assert "CANNOT run here" in text and "problem: " in text and "C++ compiler none" in text


@pytest.mark.parametrize(
    ("config", "gpus", "environ", "problem", "warning"),
    [
        ("zero2.json", [H100] * 8, {}, None, None),
        ("zero2.json", [V100] * 8, {}, "has no bf16; use precision fp16", None),
        ("zero2.json", [], {}, "no CUDA GPU is visible", None),
        ("accelerate:fsdp2_full_shard", [], {}, "needs GPUs (FSDP through accelerate)", None),
        ("accelerate:ddp", [H100] * 4, {}, "8 processes per machine but 4 GPU(s) visible", None),
        ("accelerate:ddp_multinode", [H100] * 8, {}, None, "no NCCL_SOCKET_IFNAME"),
        ("accelerate:ddp_multinode", [H100] * 8, {"NCCL_SOCKET_IFNAME": "ib0"}, None, None),
        ("zero3_nvme.json", [H100] * 8, {}, "nvme_path=/local_nvme does not exist", None),
    ],
    ids=["zero2-h100", "bf16-on-v100", "no-gpu", "fsdp-no-gpu", "more-processes-than-gpus", "multinode-no-ifname",
         "multinode-ifname", "nvme-path-missing"],
)
def test_config_verdicts_from_given_node_facts(config, gpus, environ, problem, warning):
    if config.startswith("accelerate:"):
        req = doctor.config_requirements(str(REPO / "accelerate_configs" / f"{config.split(':')[1]}.yaml"))
    else:
        req = doctor.config_requirements(str(REPO / "ds_configs" / config))
    statuses = dict.fromkeys(("cpu_adam", "async_io", "fused_adam"), USABLE)
    problems, warnings = doctor.config_verdict(req, gpus, statuses, environ)
    assert (problem is None) == (problems == []), problems
    assert problem is None or any(problem in p for p in problems), problems
    assert (warning is None) == (warnings == []), warnings
    assert warning is None or any(warning in w for w in warnings)


A100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 85 * 10**9, "compute_capability": "8.0",
        "bf16": True, "fp8": False}
L40S = {"index": 0, "name": "NVIDIA L40S", "memory_bytes": 48 * 10**9, "compute_capability": "8.9", "bf16": True,
        "fp8": True}
TORCHAO_ONLY = {"torchao": "0.18.0", "te": None, "msamp": None}


@pytest.mark.parametrize(("gpu", "backend", "problem"), [
    (A100, "torchao", "GPU 0 (NVIDIA A100-SXM4-80GB, compute capability 8.0): precision=fp8 needs a GPU of compute "
                      "capability >= 8.9 (Ada, Hopper or later); this GPU has 8.0: use precision=bf16"),
    (L40S, "torchao", None),
    (H100, "torchao", None),
    (H100, "te", "fp8.backend=te: the module transformer_engine is not importable"),
], ids=["8.0", "8.9", "9.0", "9.0-backend-missing"])
@pytest.mark.parametrize("kind", ["DistributedConfig", "accelerate YAML"])
def test_an_fp8_config_needs_compute_capability_8_9_and_its_backend(gpu, backend, problem, kind, tmp_path):
    """The node's GPUs and installed backends are data (what doctor reads from torch and importlib on a real node)."""
    if kind == "DistributedConfig":
        config = tmp_path / "fp8.yaml"
        config.write_text(yaml.safe_dump({"strategy": "ddp", "precision": "fp8", "fp8": {"backend": backend},
                                          "topology": {"processes_per_machine": 2}}))
    else:
        config = tmp_path / "accelerate.yaml"
        config.write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "num_processes": 2, "mixed_precision": "fp8",
                                          "fp8_config": {"backend": {"torchao": "AO", "te": "TE"}[backend]}}))
    req = doctor.config_requirements(str(config))
    assert req["kind"] == kind and req["precision"] == "fp8" and req["fp8_backend"] == backend
    problems, _ = doctor.config_verdict(req, [gpu, {**gpu, "index": 1}], {}, {}, TORCHAO_ONLY)
    assert problems == ([] if problem is None else [p for p in problems if problem in p])
    assert len(problems) == (problem is not None)


def test_an_offload_op_that_cannot_build_on_a_gpu_node():
    req = doctor.config_requirements(str(REPO / "accelerate_configs" / "zero3_offload.yaml"))
    assert req["deepspeed"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # read from ds_configs/
    missing = {"usable": False, "how": "not usable", "missing": ["a C++ compiler (c++ is not on PATH)"]}
    problems, _ = doctor.config_verdict(req, [H100] * 8, {"cpu_adam": missing}, {})
    assert problems == [
        "optimizer.type=AdamW with zero_optimization.offload_optimizer.device=cpu needs DeepSpeed's cpu_adam op, "
        "which cannot load here (missing: a C++ compiler (c++ is not on PATH)); fix: "
        + doctor_fix("cpu_adam")
    ]


def doctor_fix(op: str) -> str:
    from hf_scale.knowledge.deepspeed_ops import FIXES

    return FIXES[op]


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.yaml", "missing.yaml: not found; expected a DistributedConfig YAML"),
        ("{not json", "bad.json", "not valid JSON"),
        ("a: [1,", "bad.yaml", "not valid YAML"),
        ("strategy: deepspeed\ndeepspeed: {zero_stage: 7}\n", "cfg.yaml", "deepspeed.zero_stage=7 is invalid"),
        ("distributed_type: TPU\n", "acc.yaml", "distributed_type=TPU is not supported"),
    ],
    ids=["missing", "bad-json", "bad-yaml", "bad-field", "unknown-accelerate-type"],
)
def test_bad_config_is_one_line_and_exit_2(content, name, message, tmp_path, capsys):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-scale: error: ") and message in err[0]


def test_link_figures():
    assert doctor.link_figure("NVIDIA H100 80GB HBM3") == (450.0, "NVLink 4")
    assert doctor.link_figure("NVIDIA H100 PCIe") == (64.0, "PCIe Gen5 x16")
    assert doctor.link_figure("NVIDIA A100-SXM4-80GB") == (300.0, "NVLink 3")
    assert doctor.link_figure("Some Future GPU") is None


# The all-reduce's gloo path (2 spawned processes) runs once, inside `doctor --write-profile`:
# tests/planner/test_planner_doctor_profile.py::test_doctor_writes_a_measured_profile_that_plan_reads.


# --- what train.py does with HSDP on this node (hf_scale.doctor.parallel_support) ------------------------------


def test_hsdp_support_is_what_train_py_does_on_the_node_not_what_the_versions_allow():
    """HSDP without TP was "yes" on CPU from the versions alone; train.py refuses it there under every launcher:
    accelerate launch's runtime guard (asked with the request a generated hybrid_shard YAML makes) and its own FSDP2
    setup under torchrun/python (no 2-D mesh). With a GPU the guard lets accelerate launch run it."""
    from hf_scale.doctor.parallel_support import accelerate_refusal, hsdp_support, train_support

    cpu = hsdp_support(gpu_present=False)
    assert cpu["usable"] is False
    assert cpu["why"].startswith("train.py refuses HSDP without TP on this node under every launcher: under "
                                 "accelerate launch (FSDP was requested by the accelerate config")
    assert "FSDP through accelerate needs GPUs" in cpu["why"] and "no 2-D mesh" in cpu["why"]
    assert "HSDP x TP" in cpu["why"] and "run on GPUs, or ask for FSDP with --hf_scale_config" not in cpu["why"]
    assert accelerate_refusal(gpu_present=True) is None
    gpu = hsdp_support(gpu_present=True)
    assert gpu["usable"] is True and "under accelerate launch (launch/NAME.accelerate.sh" in gpu["why"]
    assert "under torchrun or python only with tp > 1" in gpu["why"]
    assert train_support(gpu_present=False)["hsdp"] == cpu
    if not doctor.gpus():
        report = doctor.build_report(config=None, output_dir=".", allreduce=False)
        assert report["parallelism"]["hsdp"] == cpu
        assert f"hsdp: no ({cpu['why']})" in doctor.format_text(report)


@pytest.mark.multiprocess
def test_train_py_refuses_hsdp_here_under_both_launchers_as_doctor_says(tmp_path):
    """What doctor reports on this CPU node, from the real runs: a generated hybrid_shard config (2 x 2) under torchrun
    and under accelerate launch with its YAML, 4 processes each, both refused in one line before training."""
    from train_helpers import TRAIN_PY, free_port, generate_config, run, torchrun, training_traceback_frames

    from hf_scale.doctor.parallel_support import hsdp_support

    if doctor.gpus():
        pytest.skip("a GPU node runs HSDP under accelerate launch")
    generate_config(tmp_path, "hsdp", preset="fsdp2_hybrid_multinode",
                    sets=["topology.processes_per_machine=2", "topology.main_process_ip=127.0.0.1"])
    flags = ["--hf_scale_config", str(tmp_path / "hf_scale_configs" / "hsdp.yaml"), "--max_steps", "1"]
    by_torchrun = run(torchrun(TRAIN_PY, *flags, "--loop", "accelerate", "--output_dir", tmp_path / "a", nproc=4))
    by_accelerate = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         str(tmp_path / "accelerate_configs" / "hsdp.yaml"), "--num_machines", "1", "--num_processes",
                         "4", "--machine_rank", "0", "--main_process_port", str(free_port()), TRAIN_PY, *flags,
                         "--output_dir", str(tmp_path / "b")])
    why = hsdp_support(gpu_present=False)["why"]
    for result, reason in ((by_torchrun, "has no 2-D mesh"), (by_accelerate, "FSDP through accelerate needs GPUs")):
        assert result.returncode != 0 and not training_traceback_frames(result.stderr), result.stderr[-3000:]
        assert "train.py: error:" in result.stderr and reason in result.stderr, result.stderr[-3000:]
        assert reason in why


def test_doctor_names_a_stale_deepspeed_build_lock(tmp_path, monkeypatch):
    """A run killed while JIT-building cpu_adam left its lock: doctor's build line and the config's verdict say which
    file, since when, that no process holds it and how to clear it (every later run would wait on it forever)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    lock = stale_lock(tmp_path / "jit")
    build = doctor.build_tools(["cpu_adam"])
    status = build["deepspeed_ops"]["cpu_adam"]
    if status["how"] == "prebuilt":
        pytest.skip("cpu_adam is prebuilt here: it never goes through the JIT lock")
    assert status["usable"] is False and f"torch's JIT-build lock {lock} exists since" in status["stale_lock"]
    req = doctor.config_requirements(str(REPO / "ds_configs" / "zero2_offload.json"))
    problems, _ = doctor.config_verdict(req, [H100], build["deepspeed_ops"], {})
    assert problems == ["optimizer.type=AdamW with zero_optimization.offload_optimizer.device=cpu needs DeepSpeed's "
                        f"cpu_adam op, but {status['stale_lock']}"]


def test_the_installed_deepspeeds_changes_and_pinned_offload_against_ulimit_l(tmp_path):
    """DeepSpeed on this node (0.19.8) refuses removed keys and a 0-step warmup at start: doctor says so before the
    queue. Offload pins host memory by default since 0.19.5: a locked-memory limit (ulimit -l) is a warning, none
    without a limit or with pin_memory false."""
    statuses = dict.fromkeys(("cpu_adam", "async_io", "fused_adam"), USABLE)
    offload = doctor.config_requirements(str(REPO / "ds_configs" / "zero3_offload.json"))
    _, warnings = doctor.config_verdict(offload, [H100] * 8, statuses, {}, memlock_bytes=8 * 2**20)
    (pinned,) = warnings
    assert pinned.startswith("zero_optimization.offload_optimizer and zero_optimization.offload_param pin host memory")
    assert "limits locked memory to 8192 KiB (ulimit -l)" in pinned
    assert doctor.config_verdict(offload, [H100] * 8, statuses, {}, memlock_bytes=None) == ([], [])
    unpinned = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    for block in ("offload_optimizer", "offload_param"):
        unpinned["zero_optimization"][block]["pin_memory"] = False
    (tmp_path / "unpinned.json").write_text(json.dumps(unpinned))
    req = doctor.config_requirements(str(tmp_path / "unpinned.json"))
    assert doctor.config_verdict(req, [H100] * 8, statuses, {}, memlock_bytes=64 * 1024) == ([], [])

    old = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    old |= {"amp": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    problems, _ = doctor.config_verdict(doctor.config_requirements(str(tmp_path / "old.json")), [H100] * 8, statuses,
                                        {})
    assert [p.split(":")[0] for p in problems] == ["amp", "scheduler.params.warmup_num_steps"]
    assert "DeepSpeed >= 0.19.7 refuses the config at start: NVIDIA Apex AMP was removed" in problems[0]


def test_doctor_reports_expert_parallelism_from_the_versions_it_needs():
    """ep is a row of the parallelism table: usable where transformers/torch/Python are new enough (parallelism.NEEDS),
    and it says what train.py runs and how far it is proven."""
    from hf_scale.config import parallelism
    from hf_scale.doctor.parallel_support import train_support

    ep = train_support(gpu_present=False)["ep"]
    assert ep["usable"] is (parallelism.version_problem("ep") is None)
    if ep["usable"]:
        assert "transformers' expert-parallel plan under FSDP2" in ep["why"]
        assert "resume at another ep or world size in the manual loop" in ep["why"]
    if not doctor.gpus():
        report = doctor.build_report(config=None, output_dir=".", allreduce=False)
        assert f"ep: {'yes' if ep['usable'] else 'no'} ({ep['why']})" in doctor.format_text(report)
