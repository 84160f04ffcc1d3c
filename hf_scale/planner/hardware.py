"""GPU profiles the time model runs on (`hf-scale plan --gpu NAME`): the data file hf_scale/planner/data/hardware.yaml,
one entry per GPU with the datasheet each number comes from, and the node-level assumptions (CPU memory bandwidth
for the offloaded optimizer step, checkpoint write bandwidth)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from hf_scale.errors import UserError
from hf_scale.files.reading import load_yaml, read_text

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
    step_correction: float = 1.0
    """Factor on every term of the predicted step, from `hf-scale plan --calibrate RUN_DIR` (measured / predicted of
    a run on this hardware); 1 uncalibrated."""


@functools.cache
def _data() -> dict:
    return yaml.safe_load(DATA.read_text())


def gpu_names() -> tuple[str, ...]:
    return tuple(_data()["gpus"])


def architecture(name: str) -> str:
    """The architecture of the known GPU ``name`` (the key of its efficiencies)."""
    return _data()["gpus"][name]["architecture"]


def efficiency_architecture(arch: str) -> str:
    """The architecture whose efficiencies ``arch`` uses: itself, or the one the data file assumes it is like (an
    architecture no published row was fitted on)."""
    entry = _data()["efficiency"][arch]
    return entry if isinstance(entry, str) else arch


def efficiencies() -> dict[str, tuple[float, float]]:
    """(gemm, attention) efficiency per architecture, as the data file holds them (an assumed one: those it is like)."""
    table = _data()["efficiency"]
    return {arch: (table[efficiency_architecture(arch)]["gemm"], table[efficiency_architecture(arch)]["attention"])
            for arch in table}


def hardware(name: str = DEFAULT_GPU) -> Hardware:
    """The profile ``name`` (case-insensitive; `_` and `-` alike), or a one-line UserError listing the known ones."""
    key = name.strip().lower().replace("_", "-")
    gpus = _data()["gpus"]
    if key not in gpus:
        raise UserError(
            f"--gpu {name!r} is not a known GPU: allowed {', '.join(gpus)} (or give --gpu-memory alone "
            f"for {DEFAULT_GPU}'s speed)"
        )
    return _profile(key, gpus[key])


def _profile(name: str, g: dict) -> Hardware:
    node = _data()["node"]
    return Hardware(
        name=name,
        label=g["label"],
        memory_bytes=int(g["memory_gib"] * 2**30),
        bf16_flops=g["bf16_tflops"] * 1e12,
        fp8_flops=None if g["fp8_tflops"] is None else g["fp8_tflops"] * 1e12,
        hbm_bps=g["hbm_gbps"] * _GB,
        intra_node_bps=g["intra_node_gbps"] * _GB,
        inter_node_bps=g["inter_node_gbps"] * _GB,
        host_pcie_bps=g["host_pcie_gbps"] * _GB,
        cpu_memory_bps=g.get("cpu_memory_gbps", node["cpu_memory_gbps"]) * _GB,
        storage_write_bps=g.get("storage_write_gbps", node["storage_write_gbps"]) * _GB,
        gemm_efficiency=g.get("gemm_efficiency", efficiencies()[g["architecture"]][0]),
        attention_efficiency=g.get("attention_efficiency", efficiencies()[g["architecture"]][1]),
        source=g["source"],
    )


_NUMBERS = {
    "memory_gib": "GiB", "bf16_tflops": "TFLOP/s", "fp8_tflops": "TFLOP/s, or null without FP8", "hbm_gbps": "GB/s",
    "intra_node_gbps": "GB/s", "inter_node_gbps": "GB/s", "host_pcie_gbps": "GB/s",
}
_OPTIONAL = {"gemm_efficiency": "fraction of the peak, 0 < e <= 1", "attention_efficiency":
             "fraction of the peak, 0 < e <= 1", "cpu_memory_gbps": "GB/s", "storage_write_gbps": "GB/s"}
FIELDS = ("architecture", "label", *_NUMBERS, "source", *_OPTIONAL)
"""The fields of a profile (one entry of hardware.yaml; the last four optional: the architecture's efficiencies and the
data file's node assumptions when absent)."""


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value and value != float("inf")


def hardware_from_file(path: str) -> Hardware:
    """The profile in the YAML file ``path`` (`hf-scale plan --hardware FILE`: a user's own node, in the schema of one
    entry of hardware.yaml), checked strictly: a one-line UserError naming the field, its value and what is allowed."""
    flag = f"--hardware {path}"
    g = load_yaml(read_text(path, "--hardware", expected="a GPU profile (YAML)"), flag, finite=False)
    if not isinstance(g, dict):
        raise UserError(f"{flag}: expected a mapping of the fields {', '.join(FIELDS)} (one entry of {DATA.name})")
    for key in g:
        if key not in FIELDS:
            raise UserError(f"{flag}: unknown field {key!r}: allowed {', '.join(FIELDS)}")
    architectures = tuple(_data()["efficiency"])
    required = {"architecture": f"one of {', '.join(architectures)}", "label": "a name", **_NUMBERS,
                "source": "where the numbers come from"}
    for key, allowed in required.items():
        if key not in g:
            raise UserError(f"{flag}: missing field {key!r} ({allowed})")
    if g["architecture"] not in architectures:
        raise UserError(f"{flag}: architecture {g['architecture']!r} is invalid: allowed {', '.join(architectures)}")
    for key in ("label", "source"):
        if not isinstance(g[key], str) or not g[key].strip():
            raise UserError(f"{flag}: {key} {g[key]!r} is invalid: allowed a non-empty string")
    for key, unit in {**_NUMBERS, **_OPTIONAL}.items():
        if key not in g or (key == "fp8_tflops" and g[key] is None):
            continue
        value, bound = g[key], 1 if key.endswith("_efficiency") else float("inf")
        if not _is_number(value) or not 0 < value <= bound:
            raise UserError(f"{flag}: {key} {value!r} is invalid: allowed a positive number ({unit})")
    return _profile(Path(path).stem, g)
