"""What the launcher asked train.py for (:class:`LaunchRequest`), and what train.py refuses of it before anything is
built (:func:`refuse_before_prepare`, the runtime guard's first words).

hf_scale.train.setup.distributed reads the request from the launcher's variables and makes it real; `hf-scale doctor`
asks :func:`refuse_before_prepare` with a request of its own, so both say the same words.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

from hf_scale.config import parallelism
from hf_scale.contract.inline_deepspeed import InlineDeepSpeed
from hf_scale.errors import UserError

Strategy = Literal["single", "ddp", "deepspeed", "fsdp"]


@dataclass(frozen=True)
class LaunchRequest:
    """The strategy and sizes the launcher (and the flags) ask for, before anything is initialised."""

    launcher: str
    """Which launcher started this process, for messages: python | torchrun | accelerate | deepspeed."""
    world_size: int
    """`WORLD_SIZE` set by the launcher (1 when started with plain `python`)."""
    strategy: Strategy
    deepspeed_config_file: str | None
    """DeepSpeed JSON from `--deepspeed` or from the accelerate YAML's `deepspeed_config_file`."""
    zero_stage: int | None
    """`zero_optimization.stage` of that JSON (0 when the JSON has no zero section)."""
    mixed_precision: str | None
    """accelerate's `mixed_precision` from the YAML (`ACCELERATE_MIXED_PRECISION`), None if not launched by it."""
    fsdp_settings: dict | None = None
    """The `fsdp` section of a `--hf_scale_config` when it (not accelerate's YAML) asks for FSDP."""
    deepspeed_inline: InlineDeepSpeed | None = None
    """DeepSpeed from an accelerate YAML's inline `deepspeed_config` (no JSON file): see inline_deepspeed."""
    layout: parallelism.Layout = parallelism.Layout()
    """The mesh sizes (tp, dp_shard, ...): `accelerate launch`'s parallelism_config, then the `--hf_scale_config`'s
    (which must agree); one data-parallel dimension otherwise."""
    cp_comm_strategy: str | None = None
    """How context-parallel ranks exchange keys/values: `accelerate launch`'s parallelism_config (None: not given),
    then the `--hf_scale_config`'s (which must agree)."""
    sp_attn_implementation: str | None = None
    """The kernel `accelerate launch`'s parallelism_config asks Ulysses to run around (None: not launched with sp)."""
    fp8_backend: str | None = None
    """FP8 training's backend (torchao | te | msamp: the config's fp8.backend) when the YAML's mixed_precision or
    the --hf_scale_config asks for fp8; None otherwise."""
    accelerate_fsdp_version: int | None = None
    """`accelerate launch`'s FSDP_VERSION for a YAML with distributed_type FSDP (its fsdp_version, default 1)."""

    @property
    def fsdp_version(self) -> int | None:
        """The FSDP this run shards with: the --hf_scale_config's fsdp.version when hf_scale sets FSDP up
        (fsdp_settings: torch's fully_shard on CPU, version 2 only; accelerate's plugin with that version on GPUs;
        hf_scale.train.model.fsdp), else accelerate's plugin for the YAML's FSDP; None without FSDP."""
        if self.strategy != "fsdp":
            return None
        if self.fsdp_settings is not None:
            return self.fsdp_settings["version"]
        return self.accelerate_fsdp_version or 1


class RuntimeGuardError(UserError):
    """What runs is not what was requested."""


def refuse_before_prepare(request: LaunchRequest, *, has_gpu: bool) -> None:
    """What the guard would find after accelerate's prepare, known before anything is built: FSDP from an accelerate
    YAML on a machine without GPUs. accelerate cannot shard there (it runs DistributedType.NO or DDP), and with
    `fsdp_sync_module_states: true` it dies in its own traceback before the guard could speak. ``request``: the
    launch request; its fsdp_settings are set when FSDP comes from
    --hf_scale_config."""
    if request.strategy == "fsdp" and request.fsdp_settings is None and not has_gpu:
        raise RuntimeGuardError(
            "runtime guard: FSDP was requested by the accelerate config (distributed_type: FSDP) but this machine "
            "has no GPU: FSDP through accelerate needs GPUs; run on GPUs, or ask for FSDP with --hf_scale_config "
            "(sharded by torch's fully_shard, which runs on CPU)"
        )


def free_port() -> int:
    """A TCP port free on this host now: MASTER_PORT of a process group one process starts itself (train.py under
    plain `python`, `hf-scale doctor`'s all-reduce test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
