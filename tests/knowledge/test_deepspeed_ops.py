"""hf_scale.knowledge.deepspeed_ops: which compiled DeepSpeed ops a config loads, and whether they load here."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from train_helpers import stale_lock

from hf_scale.knowledge.deepspeed_ops import (
    LOCK_SETTLE_S,
    arch_list_problem,
    check_config_ops,
    op_status,
    required_ops,
    stale_build_lock,
)

REPO = Path(__file__).resolve().parents[2]


def preset(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_presets_without_offload_load_no_op_on_a_gpu_node(name):
    """No optimizer block: the loop's torch AdamW; nothing is JIT-built, whatever TORCH_CUDA_ARCH_LIST says."""
    assert required_ops(preset(name), gpu=True) == []
    assert [need.op for need in required_ops(preset(name), gpu=False)] == ["deepspeed_shm_comm"]  # CPU-only comm


@pytest.mark.parametrize(
    ("config", "ops"),
    [
        (preset("zero2_offload"), ["cpu_adam"]),
        (preset("zero3_offload"), ["cpu_adam"]),
        (preset("zero3_nvme"), ["cpu_adam", "async_io"]),
        ({"optimizer": {"type": "AdamW", "params": {}}, "zero_optimization": {"stage": 2}}, ["fused_adam"]),
        ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, []),
        ({"optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 1}}, ["fused_lion"]),
        ({"optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 1}}, []),
    ],
    ids=["zero2_offload", "zero3_offload", "zero3_nvme", "fused_adam", "torch_adam-offload", "lion", "torch-sgd"],
)
def test_ops_follow_the_engine_choices(config, ops):
    needs = required_ops(config, gpu=True)
    assert [need.op for need in needs] == ops
    if ops and ops[0] == "cpu_adam":
        assert needs[0].reason.startswith("optimizer.type=AdamW with zero_optimization.offload_optimizer.device=")


def test_arch_list_that_deepspeed_cannot_parse():
    assert arch_list_problem(None) is None and arch_list_problem("8.0;9.0+PTX") is None
    assert arch_list_problem("8.0 9.0") is None
    assert arch_list_problem("8.0;9.0a") == (
        "TORCH_CUDA_ARCH_LIST='8.0;9.0a': DeepSpeed's JIT build cannot parse '9.0a' (it reads MAJOR.MINOR or "
        "MAJOR.MINOR+PTX); export TORCH_CUDA_ARCH_LIST='8.0;9.0' for DeepSpeed builds"
    )


def test_an_op_without_a_compiler_is_not_usable_and_says_why(tmp_path, monkeypatch):
    """Real probes of this machine: first with its tools, then with PATH emptied of compilers and an empty
    JIT cache (ninja stays reachable through the interpreter's folder on this machine, if installed)."""
    assert op_status("cpu_adam").usable or shutil.which("c++") is None
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("CXX", raising=False)
    status = op_status("cpu_adam")
    assert not status.usable and status.how == "not usable"
    assert "a C++ compiler (c++ is not on PATH)" in status.missing
    (problem,) = check_config_ops(preset("zero2_offload"), "zero2_offload.json", gpu=True)
    assert problem.startswith("zero2_offload.json: optimizer.type=AdamW with zero_optimization.offload_optimizer."
                              "device=cpu needs DeepSpeed's cpu_adam op, which is not prebuilt and cannot be JIT-built")
    assert "deepspeed.torch_adam=true" in problem and "\n" not in problem
    assert not (tmp_path / "jit").exists()  # probing creates nothing in the JIT cache


def test_a_stale_jit_build_lock_is_named_and_a_held_one_is_waited_for(tmp_path, monkeypatch):
    """A real lock file in a temporary TORCH_EXTENSIONS_DIR: nobody holds it, so loading cpu_adam would wait forever
    (torch polls until it is gone): said with the file, its age and how to clear it. Held open by a live process (a
    build in progress), it is torch's to wait for."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("cpu_adam"):
        pytest.skip("cpu_adam is prebuilt here: it never goes through the JIT lock")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    lock = stale_lock(tmp_path / "jit")
    status = op_status("cpu_adam")
    assert not status.usable and status.how == "locked"
    assert status.stale_lock.startswith(f"torch's JIT-build lock {lock} exists since ")
    assert "(2 h 0 min ago) and no process on this machine holds it" in status.stale_lock
    assert f"remove it (rm {lock}) unless another machine sharing {tmp_path / 'jit'} is building" in status.stale_lock
    (problem,) = check_config_ops(preset("zero2_offload"), "zero2_offload.json", gpu=True)
    assert problem == ("zero2_offload.json: optimizer.type=AdamW with zero_optimization.offload_optimizer.device=cpu "
                       f"needs DeepSpeed's cpu_adam op, but {status.stale_lock}")
    held = os.open(lock, os.O_RDONLY)  # what the building process does with it
    try:
        assert op_status("cpu_adam").stale_lock is None
    finally:
        os.close(held)


def test_a_lock_nobody_holds_for_a_moment_is_not_stale(tmp_path, monkeypatch):
    """torch's FileBaton.release closes the lock before it removes it: while the ranks of one run load the op in
    turn, a live lock is held by nobody for a moment. A lock gone (or replaced) within LOCK_SETTLE_S is no stale lock;
    one still there and unheld is."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit"))
    lock = stale_lock(tmp_path / "jit", op="deepspeed_shm_comm", age_s=0)
    remover = threading.Timer(LOCK_SETTLE_S / 10, lock.unlink)  # the releasing rank's os.remove, just after close
    remover.start()
    try:
        assert stale_build_lock("deepspeed_shm_comm") is None
    finally:
        remover.join()
    stale_lock(tmp_path / "jit2", op="deepspeed_shm_comm", age_s=0)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "jit2"))
    assert "and no process on this machine holds it" in stale_build_lock("deepspeed_shm_comm")
