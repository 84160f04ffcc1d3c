"""What train.py refuses of a launch request before anything is built (hf_scale.contract.launch_request), asked by
train.py's prepare stage and by `hf-scale doctor` with the same words."""

from __future__ import annotations

import socket

import pytest

from hf_scale.config.parallelism import Layout
from hf_scale.contract.launch_request import LaunchRequest, RuntimeGuardError, free_port, refuse_before_prepare


def _fsdp(**fields) -> LaunchRequest:
    values = {"launcher": "accelerate", "world_size": 4, "strategy": "fsdp", "deepspeed_config_file": None,
              "zero_stage": None, "mixed_precision": "bf16", "accelerate_fsdp_version": 2,
              "layout": Layout(dp_replicate=2, dp_shard=2)}
    return LaunchRequest(**{**values, **fields})


def test_fsdp_from_the_accelerate_config_without_a_gpu_is_refused_before_prepare():
    with pytest.raises(RuntimeGuardError) as raised:
        refuse_before_prepare(_fsdp(), has_gpu=False)
    assert str(raised.value) == (
        "runtime guard: FSDP was requested by the accelerate config (distributed_type: FSDP) but this machine has no "
        "GPU: FSDP through accelerate needs GPUs; run on GPUs, or ask for FSDP with --hf_scale_config (sharded by "
        "torch's fully_shard, which runs on CPU)")
    refuse_before_prepare(_fsdp(), has_gpu=True)  # accelerate shards it on GPUs
    refuse_before_prepare(_fsdp(fsdp_settings={"version": 2}), has_gpu=False)  # hf_scale's own fully_shard
    refuse_before_prepare(_fsdp(strategy="ddp"), has_gpu=False)


def test_the_request_says_which_fsdp_shards():
    assert _fsdp().fsdp_version == 2
    assert _fsdp(accelerate_fsdp_version=None).fsdp_version == 1  # accelerate's default
    assert _fsdp(fsdp_settings={"version": 2}, accelerate_fsdp_version=1).fsdp_version == 2
    assert _fsdp(strategy="ddp").fsdp_version is None


def test_a_free_port_can_be_bound():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
