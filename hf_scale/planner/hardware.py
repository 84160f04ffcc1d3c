"""GPU profiles the time model runs on (`hf-scale plan --gpu NAME`): the data file hf_scale/planner/data/hardware.yaml,
one entry per GPU with the datasheet each number comes from, and the node-level assumptions (CPU memory bandwidth
for the offloaded optimizer step, checkpoint write bandwidth)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from hf_scale.errors import UserError

DATA = Path(__file__).with_name("data") / "hardware.yaml"
DEFAULT_GPU = "h100-sxm"
"""The profile a plan runs on without --gpu: the GPU whose 80 GiB is --gpu-memory's default."""
_GB = 10**9


@dataclass(frozen=True)
class Hardware:
    """One GPU and the machine around it; bandwidths in bytes/s, peaks in FLOP/s."""

    name: str
    label: str
    memory_bytes: int
    bf16_flops: float
    fp8_flops: float | None
    hbm_bps: float
    intra_node_bps: float
    inter_node_bps: float
    host_pcie_bps: float
    cpu_memory_bps: float
    storage_write_bps: float
    gemm_efficiency: float
    """Fraction of the dense peak a large bf16 GEMM reaches on this GPU."""
    attention_efficiency: float
    """Fraction of the dense peak flash attention reaches, forward and backward together."""
    source: str


@functools.cache
def _data() -> dict:
    return yaml.safe_load(DATA.read_text())


def gpu_names() -> tuple[str, ...]:
    return tuple(_data()["gpus"])


def hardware(name: str = DEFAULT_GPU) -> Hardware:
    """The profile ``name`` (case-insensitive; `_` and `-` alike), or a one-line UserError listing the known ones."""
    key = name.strip().lower().replace("_", "-")
    gpus, node = _data()["gpus"], _data()["node"]
    if key not in gpus:
        raise UserError(
            f"--gpu {name!r} is not a known GPU: allowed {', '.join(gpus)} (or give --gpu-memory alone "
            f"for {DEFAULT_GPU}'s speed)"
        )
    g = gpus[key]
    return Hardware(
        name=key,
        label=g["label"],
        memory_bytes=int(g["memory_gib"] * 2**30),
        bf16_flops=g["bf16_tflops"] * 1e12,
        fp8_flops=None if g["fp8_tflops"] is None else g["fp8_tflops"] * 1e12,
        hbm_bps=g["hbm_gbps"] * _GB,
        intra_node_bps=g["intra_node_gbps"] * _GB,
        inter_node_bps=g["inter_node_gbps"] * _GB,
        host_pcie_bps=g["host_pcie_gbps"] * _GB,
        cpu_memory_bps=node["cpu_memory_gbps"] * _GB,
        storage_write_bps=node["storage_write_gbps"] * _GB,
        gemm_efficiency=g.get("gemm_efficiency", _data()["efficiency"][g["architecture"]]["gemm"]),
        attention_efficiency=g.get("attention_efficiency", _data()["efficiency"][g["architecture"]]["attention"]),
        source=g["source"],
    )
