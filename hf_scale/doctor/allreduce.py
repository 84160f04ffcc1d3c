"""`hf-scale doctor`'s all-reduce test: NCCL bus bandwidth among this node's GPUs (one fresh process per GPU), set
against the figure of the GPU's link."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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


def link_figure(gpu_name: str) -> tuple[float, str] | None:
    return next(((gbps, link) for key, gbps, link in LINK_GBPS if key in gpu_name), None)


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

    from hf_scale.contract.launch_request import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_allreduce_worker, args=(nprocs, free_port(), backend, size_bytes, iters, out),
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
