"""`hf-scale doctor`: what to run on a new node before queueing a job.

It reports the GPUs (name, memory, compute capability, bf16/fp8), the torch/CUDA/NCCL versions, whether the
DeepSpeed ops a config needs can load (prebuilt, or a JIT build: compiler, ninja, nvcc, a
TORCH_CUDA_ARCH_LIST DeepSpeed can parse), which attention and fused kernels are usable, which of tensor, context,
sequence and expert parallelism and HSDP train.py runs on this node (versions, GPUs, launcher), the NCCL/network
environment variables that matter, the free disk at the output directory and, with two or more GPUs, the
all-reduce bus bandwidth against the GPU link's figure. With ``--config FILE`` (a DistributedConfig YAML, an
accelerate YAML or a DeepSpeed JSON) it exits 1 when that config cannot run on this node and says why.

Heavy libraries (torch, deepspeed) are imported inside the functions that need them. The config's requirements and
verdict are in :mod:`hf_scale.doctor.config_verdict`, the all-reduce test in :mod:`hf_scale.doctor.allreduce`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from hf_scale.doctor.allreduce import (
    ALLREDUCE_BYTES,
    ALLREDUCE_ITERS,
    LINK_GBPS,
    allreduce_bandwidth,
    allreduce_report,
    link_figure,
)
from hf_scale.doctor.config_verdict import DEFAULT_OPS, config_requirements, config_verdict
from hf_scale.doctor.parallel_support import train_support
from hf_scale.errors import UserError
from hf_scale.knowledge import rules
from hf_scale.knowledge.installed import version_of
from hf_scale.knowledge.precision_rules import fp8_backends

__all__ = ["ALLREDUCE_BYTES", "ALLREDUCE_ITERS", "DEFAULT_OPS", "LINK_GBPS", "allreduce_bandwidth", "allreduce_report",
           "build_report", "config_requirements", "config_verdict", "format_text", "link_figure", "register"]

EPILOG = """\
examples:
  hf-scale doctor                                   # this node: GPUs, versions, kernels, build tools, network
  hf-scale doctor --config accelerate_configs/zero3_offload.yaml --output-dir /scratch/run1
  hf-scale doctor --config my_run.yaml --json       # a DistributedConfig; exit 1 if it cannot run here
  hf-scale doctor --config ds_configs/zero2.json --no-allreduce
  hf-scale doctor --slurm launch/run.sbatch --partition gpu   # the SLURM cluster against the sbatch file
"""

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "flash-attn", "liger-kernel",
            "triton")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST",
             "PYTORCH_CUDA_ALLOC_CONF", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "FI_", "UCX_", "DS_BUILD_")
def versions() -> dict:
    found = {"python": platform.python_version()}
    found.update({name: version_of(name) for name in PACKAGES})
    import torch

    found["cuda"] = torch.version.cuda
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return found


def gpus() -> list[dict]:
    import torch

    listed = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        listed.append({
            "index": index,
            "name": props.name,
            "memory_bytes": props.total_memory,
            "compute_capability": f"{props.major}.{props.minor}",
            "bf16": props.major >= 8,  # Ampere and newer
            "fp8": (props.major, props.minor) >= rules.FP8_MIN_COMPUTE_CAPABILITY,  # Ada and Hopper tensor cores
        })  # fmt: skip
    return listed


def build_tools(ops: list[str]) -> dict:
    """Compiler, ninja, CUDA toolkit, TORCH_CUDA_ARCH_LIST, and whether each DeepSpeed op in `ops` loads."""
    from torch.utils.cpp_extension import CUDA_HOME, get_cxx_compiler, is_ninja_available

    from hf_scale.knowledge.deepspeed_ops import arch_list_problem

    compiler = os.environ.get("CXX") or get_cxx_compiler()
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    tools = {
        "cxx_compiler": shutil.which(compiler),
        "ninja": is_ninja_available(),
        "cuda_home": CUDA_HOME,
        "nvcc": nvcc if nvcc and os.path.isfile(nvcc) else None,
        "torch_cuda_arch_list": arch,
        "arch_list_problem": arch_list_problem(arch),
        "deepspeed_ops": {},
    }
    if importlib.util.find_spec("deepspeed") is None:
        tools["deepspeed_ops"] = {op: {"usable": False, "how": "deepspeed is not installed"} for op in ops}
        return tools
    from hf_scale.knowledge.deepspeed_ops import op_status

    for op in ops:
        status = op_status(op)
        tools["deepspeed_ops"][op] = {"usable": status.usable, "how": status.how, "missing": status.missing,
                                      "stale_lock": status.stale_lock}
    return tools


def kernels(gpu_list: list[dict]) -> dict:
    """Attention and fused kernels train.py can use here: installed, and the GPU they need present."""
    best_cc = max((tuple(map(int, g["compute_capability"].split("."))) for g in gpu_list), default=None)

    def usable(installed: bool, needs: str, ok_on_gpu: bool) -> dict:
        if not installed:
            return {"usable": False, "why": "not installed"}
        if best_cc is None:
            return {"usable": False, "why": f"installed; needs {needs}, and no GPU is visible"}
        return {"usable": ok_on_gpu, "why": "installed" if ok_on_gpu else f"installed; needs {needs}"}

    cc = best_cc or (0, 0)
    return {
        "flash_attn": usable(importlib.util.find_spec("flash_attn") is not None, "an Ampere+ GPU", cc >= (8, 0)),
        "torch_varlen_attention": usable(importlib.util.find_spec("torch.nn.attention.varlen") is not None,
                                         "an Ampere+ CUDA GPU", cc >= (8, 0)),
        "flex_attention": usable(importlib.util.find_spec("torch.nn.attention.flex_attention") is not None,
                                 "a CUDA GPU and triton", cc >= (7, 0) and importlib.util.find_spec("triton")),
        "liger_kernel": usable(importlib.util.find_spec("liger_kernel") is not None, "a CUDA GPU and triton",
                               bool(importlib.util.find_spec("triton"))),
    }


def network_env(environ: dict[str, str] | None = None) -> dict:
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items())
            if name in ENV_NAMES or name.startswith(ENV_PREFIXES) or name.endswith("_SOCKET_IFNAME")}


def memlock_limit() -> int | None:
    """The soft locked-memory limit in bytes (``ulimit -l``), None when unlimited (or not known: not POSIX)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def disk(path: str) -> dict:
    """Free space where outputs go (the nearest existing parent of `path`)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return {"path": str(Path(path)), "measured_at": str(probe), "free_bytes": usage.free, "total_bytes": usage.total}


# --- the report -------------------------------------------------------------------------------------------------


def build_report(*, config: str | None, output_dir: str, allreduce: bool) -> dict:
    requirements = config_requirements(config) if config else None  # bad input fails before any probing
    gpu_list = gpus()
    ops = list(DEFAULT_OPS)
    if requirements and requirements["deepspeed"] is not None:
        from hf_scale.knowledge.deepspeed_ops import required_ops

        ops += [n.op for n in required_ops(requirements["deepspeed"], gpu=bool(gpu_list)) if n.op not in ops]
    report = {
        "host": platform.node(),
        "versions": versions(),
        "gpus": gpu_list,
        "build": build_tools(ops),
        "kernels": kernels(gpu_list),
        "parallelism": train_support(bool(gpu_list)),
        "environment": network_env(),
        "disk": disk(output_dir),
        "memlock_bytes": memlock_limit(),
        "allreduce": allreduce_report(gpu_list, enabled=allreduce),
        "fp8": {"gpu": any(g["fp8"] for g in gpu_list), "backends": fp8_backends()},
    }
    if requirements:
        problems, warnings = config_verdict(requirements, gpu_list, report["build"]["deepspeed_ops"], os.environ,
                                            report["fp8"]["backends"], report["memlock_bytes"])
        report["config"] = {**{k: v for k, v in requirements.items() if k != "deepspeed"},
                            "can_run": not problems, "problems": problems, "warnings": warnings}
    return report


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_text(report: dict) -> str:
    v = report["versions"]
    missing = [name for name in PACKAGES if v.get(name) is None]
    present = [f"{name} {v[name]}" for name in PACKAGES if v.get(name) and name != "torch"]
    lines = [f"hf-scale doctor on {report['host']} (python {v['python']})",
             f"versions    torch {v['torch']} (CUDA {v['cuda'] or 'none'}, NCCL {v['nccl'] or 'none'}); "
             + ", ".join(present) + (f"; not installed: {', '.join(missing)}" if missing else "")]
    gpu_lines = [f"{g['index']}: {g['name']}, {_gib(g['memory_bytes'])}, compute capability {g['compute_capability']}, "
                 f"bf16 {'yes' if g['bf16'] else 'no'}, fp8 {'yes' if g['fp8'] else 'no'}" for g in report["gpus"]]
    lines += _block("GPUs", gpu_lines or ["none visible"])
    b = report["build"]
    lines += _block("build", [
        f"C++ compiler {b['cxx_compiler'] or 'none'}; ninja {'yes' if b['ninja'] else 'no'}; nvcc {b['nvcc'] or 'none'}"
        f" (CUDA_HOME {b['cuda_home'] or 'unset'}); TORCH_CUDA_ARCH_LIST {b['torch_cuda_arch_list'] or 'unset'}",
        *([f"warning: {b['arch_list_problem']} (default configs build nothing)"] if b["arch_list_problem"] else []),
        *[f"DeepSpeed op {op}: {'yes, ' + s['how'] if s['usable'] else 'NO'}"
          + (f" (missing: {', '.join(s['missing'])})" if s.get("missing") else "")
          + (f" ({s['stale_lock']})" if s.get("stale_lock") else "")
          for op, s in b["deepspeed_ops"].items()],
    ])
    f8 = report["fp8"]
    need = ".".join(map(str, rules.FP8_MIN_COMPUTE_CAPABILITY))
    lines += _block("fp8", [
        f"GPU: {'yes' if f8['gpu'] else 'no'} (compute capability >= {need} needed); backends: "
        + ", ".join(f"{name} {version or 'not installed'}" for name, version in f8["backends"].items())])
    lines += _block("kernels", [f"{name}: {'yes' if k['usable'] else 'no'} ({k['why']})"
                                for name, k in report["kernels"].items()])
    lines += _block("parallelism", [f"{kind}: {'yes' if k['usable'] else 'no'} ({k['why']})"
                                    for kind, k in report["parallelism"].items()])
    lines += _block("network", [f"{k}={val}" for k, val in report["environment"].items()] or ["no NCCL/rendezvous "
                                                                                            "variables set"])
    d = report["disk"]
    lines += _block("disk", [f"{d['path']}: {_gib(d['free_bytes'])} free of {_gib(d['total_bytes'])}"])
    a = report["allreduce"]
    lines += _block("all-reduce", [f"skipped: {a['reason']}" if a["status"] == "skipped" else
                                   f"{a['processes']} GPUs, {a['size_bytes'] // 2**20} MiB fp32: bus bandwidth "
                                   f"{a['busbw_gbps']} GB/s" + (f", {a['busbw_vs_link']:.0%} of {a['link']} "
                                                                f"({a['link_gbps']:.0f} GB/s)" if "link" in a else "")])
    if "config" in report:
        c = report["config"]
        verdict = "can run here" if c["can_run"] else "CANNOT run here"
        lines += _block("config", [f"{c['file']} ({c['kind']}, strategy {c['strategy']}): {verdict}",
                                   *[f"problem: {p}" for p in c["problems"]],
                                   *[f"warning: {w}" for w in c["warnings"]]])
    return "\n".join(lines) + "\n"


def _block(title: str, lines: list[str]) -> list[str]:
    return [f"{title:<11} {lines[0]}", *[f"{'':<11} {line}" for line in lines[1:]]]


@contextlib.contextmanager
def _stdout_to_stderr():
    """DeepSpeed logs and its op builders print to stdout; stdout carries the report (--json must parse)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_doctor(args: argparse.Namespace) -> int:
    if args.slurm:  # the cluster, not this node: nothing here is probed
        from hf_scale.doctor.slurm_cluster import format_slurm, slurm_report

        report = slurm_report(args.slurm, args.partition)
        print(json.dumps(report, indent=2) if args.json else format_slurm(report), end="\n" if args.json else "")
        return 1 if report["findings"] else 0
    if args.partition:
        raise UserError(f"--partition {args.partition}: only with --slurm FILE.sbatch")
    if args.write_profile:  # this node's speed as a plan --hardware profile
        from hf_scale.doctor.hardware_profile import write_profile

        with _stdout_to_stderr():
            result = write_profile(args.write_profile, allreduce_processes=_allreduce_processes(args))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            p = result["profile"]
            print(f"wrote {result['path']}: {p['label']}, {p['bf16_tflops'] * p['gemm_efficiency']:.4g} TFLOP/s "
                  f"large GEMMs, {p['hbm_gbps']:.4g} GB/s memory, {p['intra_node_gbps']:.4g} GB/s link\n"
                  f"plan with it: hf-scale plan MODEL --hardware {result['path']}")
        return 0
    with _stdout_to_stderr():
        report = build_report(config=args.config, output_dir=args.output_dir, allreduce=not args.no_allreduce)
    print(json.dumps(report, indent=2) if args.json else format_text(report), end="\n" if args.json else "")
    return 0 if report.get("config", {}).get("can_run", True) else 1


def _allreduce_processes(args: argparse.Namespace) -> int:
    """Processes of the profile's all-reduce: one per GPU; 2 over gloo on a CPU-only node; none with --no-allreduce."""
    if args.no_allreduce:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this node before queueing a job (GPUs, versions, kernels, DeepSpeed ops, network, disk)",
        description="Report what a training job on this node can use and, with --config, whether that config "
        "can run here (exit 1 and why if not).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE",
                        help="a DistributedConfig YAML, an accelerate YAML or a DeepSpeed JSON to check against "
                        "this node")
    parser.add_argument("--slurm", metavar="FILE.sbatch",
                        help="instead of this node, read the SLURM cluster (scontrol) the generated sbatch file will "
                        "be queued on: requeue, time limit vs the --signal lead, GPU GRES, preemption grace time; "
                        "exit 1 on a mismatch")
    parser.add_argument("--partition", metavar="NAME", help="with --slurm: the partition (default: the cluster's)")
    parser.add_argument("--output-dir", default=".", metavar="DIR", help="where outputs will go (free disk; default .)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--write-profile", metavar="FILE",
                        help="instead of the report, measure this node (GEMM TFLOP/s, memory and host copy bandwidth, "
                        "the all-reduce among its GPUs) and write it as a profile for `hf-scale plan --hardware FILE`")
    parser.add_argument("--no-allreduce", action="store_true",
                        help=f"skip the all-reduce bandwidth test (with 2+ GPUs it moves {ALLREDUCE_BYTES // 2**20} "
                        f"MiB x {ALLREDUCE_ITERS} over NCCL, a few seconds)")
    parser.set_defaults(func=run_doctor)
