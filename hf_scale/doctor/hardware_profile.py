"""`hf-scale doctor --write-profile FILE`: this node's measured speed as a GPU profile that `hf-scale plan --hardware
FILE` reads (the schema of one entry of hf_scale/planner/data/hardware.yaml), so a plan predicts with this node's
numbers instead of a datasheet's.

Measured here: the achieved GEMM rate (bf16 on a GPU; fp32 on a CPU-only node, so the path runs anywhere), the
device-memory copy bandwidth, the host-to-device copy bandwidth (GPU only) and, with 2+ processes possible, the
all-reduce bus bandwidth among this node's GPUs (NCCL) or two CPU processes (gloo). What one node cannot measure (the
network to other machines, the FP8 peak) comes from the datasheet profile of the same GPU when hardware.yaml knows it,
and the profile's ``source`` says which number is which.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from hf_scale.errors import UserError
from hf_scale.planner.hardware import DEFAULT_GPU, architecture, efficiencies, hardware
from hf_scale.planner.time_model import LINK_EFFICIENCY

GEMM_SIZE = {"cuda": 8192, "cpu": 1024}
"""Square GEMM side measured: 8192 fills any data-centre GPU (1.1 TFLOP per matmul); 1024 keeps a CPU run to a
second or two."""
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}
_GB = 1e9


def _timed(fn, sync, repeats: int) -> float:
    """Seconds per call of ``fn`` after one warm-up call (kernel selection, allocation)."""
    fn()
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - started) / repeats


def measure_node(*, allreduce_processes: int) -> dict:
    """The measured numbers of this node: device, gemm_tflops (at GEMM_SIZE), memory_copy_gbps (read + write bytes
    per second of a device-to-device copy), host_copy_gbps (pinned host to GPU; None on CPU), allreduce_busbw_gbps
    and whether it summed correctly (None when ``allreduce_processes`` < 2), and the GPU's name and memory."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = GEMM_SIZE[device]
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm_s = _timed(lambda: torch.mm(a, b), sync, 20 if cuda else 5)
    src = torch.empty(COPY_BYTES[device] // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), sync, 10)
    host_copy = None
    if cuda:
        host = torch.empty(COPY_BYTES[device] // 4, pin_memory=True)
        host_copy = COPY_BYTES[device] / _timed(lambda: dst.copy_(host, non_blocking=True), sync, 10) / _GB
    allreduce = {}
    if allreduce_processes >= 2:
        from hf_scale.doctor.allreduce import allreduce_bandwidth

        size = 256 * 2**20 if cuda else 2**22
        allreduce = allreduce_bandwidth(allreduce_processes, backend="nccl" if cuda else "gloo", size_bytes=size,
                                        iters=10 if cuda else 3)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name, props.total_memory
    else:
        import os

        name, memory = "CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": device,
        "name": name,
        "memory_bytes": memory,
        "gemm_size": n,
        "gemm_dtype": str(dtype).removeprefix("torch."),
        "gemm_tflops": 2 * n**3 / gemm_s / 1e12,
        "memory_copy_gbps": 2 * COPY_BYTES[device] / copy_s / _GB,
        "host_copy_gbps": host_copy,
        "allreduce_processes": allreduce.get("processes"),
        # from the time itself: allreduce_bandwidth's busbw_gbps is rounded to 0.01, which a slow gloo run rounds to 0
        "allreduce_busbw_gbps": (allreduce["size_bytes"] * 2 * (allreduce["processes"] - 1) / allreduce["processes"]
                                 / allreduce["seconds_per_allreduce"] / _GB) if allreduce else None,
        "allreduce_correct": allreduce.get("correct"),
    }


KNOWN = (
    ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"), ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"), ("L40S", "l40s"), ("A10G", "a10g"), ("RTX 4090", "rtx4090"),
)
"""Driver names (torch.cuda.get_device_name) -> hardware.yaml profile, most specific first."""


def _known(name: str) -> str | None:
    """The hardware.yaml profile of the GPU the driver calls ``name``, if any."""
    return next((key for fragment, key in KNOWN if fragment in name), None)


def _figure(x: float) -> float:
    """``x`` to 5 significant figures (a measured rate can be 0.0005 TFLOP/s on a CPU or 3000 GB/s on a GPU: fixed
    decimals would round the small ones away)."""
    return float(f"{x:.5g}")


def profile_from_measurement(m: dict) -> dict:
    """The profile (one hardware.yaml entry) the measurement ``m`` gives. On a known GPU the datasheet peak stays and
    gemm_efficiency becomes measured / peak (the 8192^3 GEMM is large enough that the model's small-GEMM curve,
    f/(f + GEMM_HALF_FLOPS), takes under 1% off it); elsewhere (a CPU, an unknown GPU) the measured rate is the peak
    and the efficiency 1.
    Attention keeps the reference architecture's attention/GEMM ratio; the all-reduce bus bandwidth is divided by
    the LINK_EFFICIENCY the model multiplies links by."""
    achieved = m["gemm_tflops"]
    key = _known(m["name"]) if m["device"] == "cuda" else None
    base = hardware(key or DEFAULT_GPU)
    arch = architecture(key or DEFAULT_GPU)
    gemm_ref, attention_ref = efficiencies()[arch]
    if key:
        peak, gemm = base.bf16_flops / 1e12, min(1.0, achieved / (base.bf16_flops / 1e12))
    else:
        peak, gemm = achieved, 1.0
    measured = [f"GEMM {m['gemm_dtype']} {m['gemm_size']}^3: {m['gemm_tflops']:.3g} TFLOP/s",
                f"device copy {m['memory_copy_gbps']:.4g} GB/s"]
    intra = base.intra_node_bps / _GB
    if m["allreduce_busbw_gbps"]:
        intra = m["allreduce_busbw_gbps"] / LINK_EFFICIENCY
        measured.append(f"all-reduce bus bandwidth {m['allreduce_busbw_gbps']:.4g} GB/s over "
                        f"{m['allreduce_processes']} processes")
    host = m["host_copy_gbps"] or m["memory_copy_gbps"]  # on a CPU the "device" is host memory
    if m["host_copy_gbps"]:
        measured.append(f"host-to-device copy {m['host_copy_gbps']:.4g} GB/s")
    assumed = f"the {base.label} datasheet profile" if key else f"{base.label}'s datasheet profile (no match for " \
        f"{m['name']!r})"
    rest = "network to other machines, FP8 peak" + ("" if m["allreduce_busbw_gbps"] else ", intra-node link")
    return {
        "architecture": arch,
        "label": f"{m['name']} (measured)",
        "memory_gib": _figure(m["memory_bytes"] / 2**30),
        "bf16_tflops": _figure(peak),
        "fp8_tflops": None if base.fp8_flops is None or not key else base.fp8_flops / 1e12,
        "hbm_gbps": _figure(m["memory_copy_gbps"]),
        "intra_node_gbps": _figure(intra),
        "inter_node_gbps": base.inter_node_bps / _GB,
        "host_pcie_gbps": _figure(host),
        "gemm_efficiency": _figure(gemm),
        "attention_efficiency": _figure(min(1.0, gemm * attention_ref / gemm_ref)),
        "source": f"hf-scale doctor on {m['name']}: measured {', '.join(measured)}; {rest} from {assumed}",
    }


def write_profile(path: str, *, allreduce_processes: int) -> dict:
    """Measure this node and write its profile to ``path`` (YAML), all at once (nothing half-written); returns the
    measurement and the profile."""
    target = Path(path)
    if target.is_dir() or not target.parent.is_dir():
        raise UserError(f"--write-profile {path}: not a file in an existing directory")
    measurement = measure_node(allreduce_processes=allreduce_processes)
    profile = profile_from_measurement(measurement)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text("# hf-scale doctor --write-profile: this node, for `hf-scale plan --hardware FILE`\n"
                       + yaml.safe_dump(profile, sort_keys=False, width=1000))
    partial.replace(target)
    return {"path": str(target), "measured": measurement, "profile": profile}
