"""`hf-scale doctor`: what to run on a new node before queueing a job.

It reports the GPUs (name, memory, compute capability, bf16/fp8), the torch/CUDA/NCCL versions, whether the
DeepSpeed ops a config needs can load (prebuilt, or a JIT build: compiler, ninja, nvcc, a
TORCH_CUDA_ARCH_LIST DeepSpeed can parse), which attention and fused kernels are usable, which of tensor, context
and sequence parallelism and HSDP the installed versions (and GPUs) support, the NCCL/network
environment variables that matter, the free disk at the output directory and, with two or more GPUs, the
all-reduce bus bandwidth against the GPU link's figure. With ``--config FILE`` (a DistributedConfig YAML, an
accelerate YAML or a DeepSpeed JSON) it exits 1 when that config cannot run on this node and says why.

Heavy libraries (torch, deepspeed) are imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from hf_scale import parallelism, rules
from hf_scale.errors import UserError
from hf_scale.inputs import read_text
from hf_scale.precision_rules import fp8_backends, precision_gpu_problems
from hf_scale.rules import DEEPSPEED_PRECISION_BLOCKS

EPILOG = """\
examples:
  hf-scale doctor                                   # this node: GPUs, versions, kernels, build tools, network
  hf-scale doctor --config accelerate_configs/zero3_offload.yaml --output-dir /scratch/run1
  hf-scale doctor --config my_run.yaml --json       # a DistributedConfig; exit 1 if it cannot run here
  hf-scale doctor --config ds_configs/zero2.json --no-allreduce
"""

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "flash-attn", "liger-kernel",
            "triton")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST",
             "PYTORCH_CUDA_ALLOC_CONF", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "FI_", "UCX_", "DS_BUILD_")
# One direction of a GPU's link to its peers, GB/s: the all-reduce bus bandwidth a healthy node approaches
# (nccl-tests reach about 80% of it). Most specific names first.
LINK_GBPS = (
    ("H100 PCIe", 64.0, "PCIe Gen5 x16"),
    ("H100 NVL", 300.0, "NVLink bridge"),
    ("GH200", 450.0, "NVLink 4"),
    ("H100", 450.0, "NVLink 4"),
    ("H200", 450.0, "NVLink 4"),
    ("H800", 200.0, "NVLink 4 (8 links)"),
    ("B200", 900.0, "NVLink 5"),
    ("A100-SXM", 300.0, "NVLink 3"),
    ("A100 80GB PCIe", 32.0, "PCIe Gen4 x16"),
    ("A100-PCIE", 32.0, "PCIe Gen4 x16"),
    ("A800", 200.0, "NVLink 3 (8 links)"),
    ("V100-SXM", 150.0, "NVLink 2"),
    ("L40S", 32.0, "PCIe Gen4 x16"),
    ("L40", 32.0, "PCIe Gen4 x16"),
    ("L4", 32.0, "PCIe Gen4 x16"),
    ("A10", 32.0, "PCIe Gen4 x16"),
)
ALLREDUCE_BYTES = 256 * 2**20
ALLREDUCE_ITERS = 10


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
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

    from hf_scale.deepspeed_ops import arch_list_problem

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
    from hf_scale.deepspeed_ops import op_status

    for op in ops:
        status = op_status(op)
        tools["deepspeed_ops"][op] = {"usable": status.usable, "how": status.how, "missing": status.missing}
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


def disk(path: str) -> dict:
    """Free space where outputs go (the nearest existing parent of `path`)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return {"path": str(Path(path)), "measured_at": str(probe), "free_bytes": usage.free, "total_bytes": usage.total}


def link_figure(gpu_name: str) -> tuple[float, str] | None:
    return next(((gbps, link) for key, gbps, link in LINK_GBPS if key in gpu_name), None)


# --- all-reduce bandwidth ------------------------------------------------------------------------------------


def _allreduce_worker(rank: int, world: int, port: int, backend: str, size_bytes: int, iters: int, out: str):
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tensor = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
        for _ in range(2):  # warm-up: connection set-up, NCCL channels
            dist.all_reduce(tensor)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        sync()
        seconds = (time.perf_counter() - started) / iters
        expected = float(world ** (iters + 2))  # every all-reduce multiplied the ones by world
        correct = bool(torch.allclose(tensor[:16].cpu(), torch.full((16,), expected)))
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds, "correct": correct}))
    finally:
        dist.destroy_process_group()


def allreduce_bandwidth(nprocs: int, *, backend: str, size_bytes: int = ALLREDUCE_BYTES,
                        iters: int = ALLREDUCE_ITERS) -> dict:
    """All-reduce `size_bytes` of fp32 among `nprocs` fresh processes (one per GPU with nccl); returns the
    time per all-reduce and the bus bandwidth nccl-tests reports: size x 2(n-1)/n / time."""
    import tempfile

    import torch.multiprocessing as mp

    from hf_scale.train.setup.distributed import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_allreduce_worker, args=(nprocs, _free_port(), backend, size_bytes, iters, out),
                           nprocs=nprocs, start_method="spawn")
        result = json.loads(Path(out).read_text())
    busbw = size_bytes * 2 * (nprocs - 1) / nprocs / result["seconds"] / 1e9
    return {"processes": nprocs, "backend": backend, "size_bytes": size_bytes, "iterations": iters,
            "seconds_per_allreduce": result["seconds"], "busbw_gbps": round(busbw, 2), "correct": result["correct"]}


def allreduce_report(gpu_list: list[dict], *, enabled: bool) -> dict:
    if not enabled:
        return {"status": "skipped", "reason": "--no-allreduce"}
    if len(gpu_list) < 2:
        return {"status": "skipped", "reason": f"needs 2 or more GPUs (found {len(gpu_list)})"}
    result = {"status": "ok", **allreduce_bandwidth(len(gpu_list), backend="nccl")}
    figure = link_figure(gpu_list[0]["name"])
    if figure:
        result.update(link=figure[1], link_gbps=figure[0], busbw_vs_link=round(result["busbw_gbps"] / figure[0], 3))
    return result


# --- a config's requirements and the verdict -----------------------------------------------------------------

_ACCELERATE_STRATEGY = rules.STRATEGY_OF_DISTRIBUTED_TYPE
DEFAULT_OPS = ("cpu_adam", "fused_adam", "async_io")
"""What optimizer offload, deepspeed.fused_adam and NVMe offload would load; shown without --config too."""


def _read_file(path: str) -> tuple[Path, str]:
    """The file's text (hf_scale.inputs: a FIFO or device refused without blocking, UTF-8, size bounded)."""
    return Path(path), read_text(path, "--config", expected="a DistributedConfig YAML, an accelerate YAML or a "
                                 "DeepSpeed JSON")


def _json_object(text: str, where: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: a DeepSpeed config must be a JSON object, got {type(data).__name__}")
    return data


def _deepspeed_precision(ds: dict, fallback: str | None) -> str | None:
    for dtype, blocks in DEEPSPEED_PRECISION_BLOCKS.items():
        if any(str((ds.get(block) or {}).get("enabled")).lower() == "true" for block in blocks):
            return dtype
    return fallback


def config_requirements(path: str) -> dict:
    """What a config asks of the node: strategy, processes per machine, machines, precision, DeepSpeed dict."""
    file, text = _read_file(path)
    if file.suffix == ".json":
        ds = _json_object(text, f"--config {path}")
        return {"file": path, "kind": "DeepSpeed JSON", "strategy": "deepspeed", "processes_per_machine": None,
                "num_machines": 1, "use_cpu": False, "precision": _deepspeed_precision(ds, None), "deepspeed": ds}
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UserError(f"--config {path}: not valid YAML ({' '.join(str(error).split())[:200]})") from None
    if isinstance(data, dict) and "distributed_type" in data:
        return _accelerate_requirements(path, file, data)
    from hf_scale.config import load_config
    from hf_scale.generators.deepspeed_json import deepspeed_config

    cfg = load_config(path)
    return {"file": path, "kind": "DistributedConfig", "strategy": cfg.strategy,
            "processes_per_machine": cfg.topology.processes_per_machine, "num_machines": cfg.topology.num_machines,
            "use_cpu": False, "precision": cfg.precision,
            "fp8_backend": cfg.fp8.backend if cfg.precision == rules.FP8 else None,
            "deepspeed": deepspeed_config(cfg, "auto") if cfg.strategy == "deepspeed" else None}


def _accelerate_requirements(path: str, file: Path, data: dict) -> dict:
    kind = str(data.get("distributed_type"))
    if kind not in _ACCELERATE_STRATEGY:
        raise UserError(f"--config {path}: distributed_type={kind} is not supported (allowed: "
                        f"{', '.join(_ACCELERATE_STRATEGY)})")
    machines = int(data.get("num_machines") or 1)
    processes = int(data.get("num_processes") or 1)
    ds = None
    if kind == "DEEPSPEED":
        section = data.get("deepspeed_config") or {}
        ds_file = section.get("deepspeed_config_file")
        if ds_file:
            # accelerate resolves it from the launch directory; configs generated by hf-scale sit next to it.
            candidates = [Path(ds_file), file.parent / ds_file, file.parent.parent / ds_file]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None:
                raise UserError(f"--config {path}: deepspeed_config_file={ds_file} not found (looked in the current "
                                "directory and next to the YAML)")
            ds = _json_object(found.read_text(encoding="utf-8"), f"{path}: deepspeed_config_file={ds_file}")
        else:  # accelerate's inline keys; offload makes DeepSpeedCPUAdam run
            device = str(section.get("offload_optimizer_device", "none"))
            ds = {"zero_optimization": {"stage": section.get("zero_stage", 0),
                                        "offload_optimizer": {"device": device},
                                        "offload_param": {"device": str(section.get("offload_param_device", "none"))}}}
            if device in ("cpu", "nvme"):
                ds["optimizer"] = {"type": "AdamW"}
    mixed = data.get("mixed_precision")
    precision = "no" if mixed in (None, False, "no") else str(mixed)
    fp8_config = data.get("fp8_config") if isinstance(data.get("fp8_config"), dict) else {}
    fp8_backend = rules.fp8_backend_of_accelerate(fp8_config.get("backend")) if precision == rules.FP8 else None
    return {"file": path, "kind": "accelerate YAML", "strategy": _ACCELERATE_STRATEGY[kind],
            "processes_per_machine": max(1, processes // machines), "num_machines": machines,
            "use_cpu": bool(data.get("use_cpu")),
            # fp8 runs on DeepSpeed's bf16 block (hf_scale.rules.FP8_AUTOCAST): the YAML's fp8 is what the GPU needs.
            "precision": precision if precision == rules.FP8 else _deepspeed_precision(ds or {}, precision),
            "fp8_backend": fp8_backend,
            "deepspeed": ds}


def config_verdict(req: dict, gpu_list: list[dict], op_statuses: dict[str, dict], environ: dict[str, str],
                   fp8_installed: dict[str, str | None] | None = None) -> tuple[list[str], list[str]]:
    """(problems that stop the config on this node, warnings). Pure: the node's facts are arguments
    (``fp8_installed``: :func:`fp8_backends`'s report)."""
    from hf_scale.deepspeed_ops import FIXES, GENERIC_FIX, required_ops

    problems: list[str] = []
    warnings: list[str] = []
    strategy, count = req["strategy"], len(gpu_list)
    if req["use_cpu"]:
        warnings.append("use_cpu: true trains on the CPU only (accelerate then starts a single process)")
    elif count == 0:
        needs = "FSDP through accelerate" if strategy == "fsdp" else "NCCL" if strategy != "single" else "a CUDA run"
        problems.append(f"no CUDA GPU is visible (torch.cuda.device_count() == 0): strategy {strategy} needs GPUs "
                        f"({needs}); here train.py could only run a CPU test over gloo")
    wanted = req["processes_per_machine"]
    if count and wanted and wanted > count:
        problems.append(f"{wanted} processes per machine but {count} GPU(s) visible here")
    problems += precision_gpu_problems(req["precision"], req.get("fp8_backend"), gpu_list, fp8_installed or {})
    ds = req["deepspeed"]
    if ds is not None:
        if importlib.util.find_spec("deepspeed") is None:
            problems.append("strategy deepspeed but the deepspeed package is not installed (pip install deepspeed)")
        for need in required_ops(ds, gpu=count > 0):
            status = op_statuses.get(need.op) or {"usable": False, "missing": ["not checked"]}
            if not status["usable"]:
                problems.append(f"{need.reason} needs DeepSpeed's {need.op} op, which cannot load here (missing: "
                                f"{', '.join(status.get('missing') or [status.get('how', '?')])}); fix: "
                                f"{FIXES.get(need.op, GENERIC_FIX)}")
        zero = ds.get("zero_optimization") or {}
        for key in ("offload_optimizer", "offload_param"):
            block = zero.get(key) or {}
            if block.get("device") == "nvme" and block.get("nvme_path") and not os.path.isdir(block["nvme_path"]):
                problems.append(f"zero_optimization.{key}.nvme_path={block['nvme_path']} does not exist on this node")
    if (req["num_machines"] or 1) > 1 and not any(name.endswith("_SOCKET_IFNAME") for name in environ):
        warnings.append("several machines and no NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME: NCCL picks an interface by "
                        "itself; set them to the network between the nodes if the rendezvous hangs")
    return problems, warnings


# --- the report -------------------------------------------------------------------------------------------------


def build_report(*, config: str | None, output_dir: str, allreduce: bool) -> dict:
    requirements = config_requirements(config) if config else None  # bad input fails before any probing
    gpu_list = gpus()
    ops = list(DEFAULT_OPS)
    if requirements and requirements["deepspeed"] is not None:
        from hf_scale.deepspeed_ops import required_ops

        ops += [n.op for n in required_ops(requirements["deepspeed"], gpu=bool(gpu_list)) if n.op not in ops]
    report = {
        "host": platform.node(),
        "versions": versions(),
        "gpus": gpu_list,
        "build": build_tools(ops),
        "kernels": kernels(gpu_list),
        "parallelism": parallelism.node_support(bool(gpu_list)),
        "environment": network_env(),
        "disk": disk(output_dir),
        "allreduce": allreduce_report(gpu_list, enabled=allreduce),
        "fp8": {"gpu": any(g["fp8"] for g in gpu_list), "backends": fp8_backends()},
    }
    if requirements:
        problems, warnings = config_verdict(requirements, gpu_list, report["build"]["deepspeed_ops"], os.environ,
                                            report["fp8"]["backends"])
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
    with _stdout_to_stderr():
        report = build_report(config=args.config, output_dir=args.output_dir, allreduce=not args.no_allreduce)
    print(json.dumps(report, indent=2) if args.json else format_text(report), end="\n" if args.json else "")
    return 0 if report.get("config", {}).get("can_run", True) else 1


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
    parser.add_argument("--output-dir", default=".", metavar="DIR", help="where outputs will go (free disk; default .)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-allreduce", action="store_true",
                        help=f"skip the all-reduce bandwidth test (with 2+ GPUs it moves {ALLREDUCE_BYTES // 2**20} "
                        f"MiB x {ALLREDUCE_ITERS} over NCCL, a few seconds)")
    parser.set_defaults(func=run_doctor)
