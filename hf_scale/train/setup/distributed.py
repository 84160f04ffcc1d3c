"""What the launcher asked for, and the process group that makes it real.

train.py is started by `python`, `torchrun`, `accelerate launch` or `deepspeed`. Each launcher says
what it wants in a different place (environment variables, `--deepspeed`, an accelerate YAML turned
into `ACCELERATE_*` variables). :func:`detect_launch` reads all of them into one LaunchRequest
(hf_scale.contract.launch_request); :func:`init_process_state` then creates accelerate's `PartialState` so that the
requested engine really runs — on a machine without GPUs that needs the gloo backend, which
accelerate does not pick by itself (without it each of N processes silently trains alone, which
`guard.py` would then stop).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch

from hf_scale.config import parallelism
from hf_scale.contract.inline_deepspeed import is_inline, plugin_for
from hf_scale.contract.launch_request import LaunchRequest, Strategy, free_port
from hf_scale.errors import UserError
from hf_scale.files.reading import not_a_regular_file
from hf_scale.knowledge import rules


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes"}


def has_gpu() -> bool:
    return torch.cuda.is_available()


def _read_deepspeed_json(path: str, flag: str) -> dict:
    file = Path(path)
    problem = not_a_regular_file(file)
    if problem is not None:
        raise UserError(f"{flag}={path}: {problem}; expected a DeepSpeed JSON config file")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{flag}={path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(
            f"{flag}={path}: a DeepSpeed config must be a JSON object, got {type(config).__name__}"
        )
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{flag}={path}: zero_optimization.stage={stage!r} is not allowed; use 0, 1, 2 or 3")
    return config


def deepspeed_config_dict(value: str | dict | None) -> dict | None:
    """The DeepSpeed config that will run, as `--deepspeed` holds it by now: a JSON path, or the dict built
    from an inline accelerate YAML or from --hf_scale_config."""
    if value is None or isinstance(value, dict):
        return value
    return _read_deepspeed_json(value, "--deepspeed")


def detect_launch(deepspeed_flag: str | None) -> LaunchRequest:
    """Read the launcher's request from the environment and `--deepspeed`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    launched_layout = parallelism.launch_layout(dict(os.environ))  # refused without --hf_scale_config (prepare)
    if by_accelerate:
        launcher = "accelerate"
    elif "CROSS_RANK" in os.environ:  # set by deepspeed/launcher/launch.py only
        launcher = "deepspeed"
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = "torchrun"
    else:
        launcher = "python"

    accelerate_ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if by_accelerate else None
    if deepspeed_flag and is_inline(os.environ):
        # accelerate's DeepSpeedPlugin refuses a config next to the YAML's DeepSpeed keys (ValueError later).
        raise UserError(
            f"--deepspeed={deepspeed_flag} while the accelerate config sets DeepSpeed inline (deepspeed_config: "
            f"{os.environ.get('ACCELERATE_CONFIG_DS_FIELDS', '')}); use one of them"
        )
    if (
        deepspeed_flag
        and accelerate_ds_file
        and Path(deepspeed_flag).resolve() != Path(accelerate_ds_file).resolve()
    ):
        raise UserError(
            f"--deepspeed={deepspeed_flag} conflicts with the accelerate config's deepspeed_config_file="
            f"{accelerate_ds_file}; pass only one of them"
        )
    ds_file = deepspeed_flag or accelerate_ds_file
    use_deepspeed = bool(ds_file) or (by_accelerate and _env_true("ACCELERATE_USE_DEEPSPEED"))
    inline = None
    zero_stage = None
    if ds_file:
        flag = "--deepspeed" if deepspeed_flag else "deepspeed_config_file"
        zero_stage = _read_deepspeed_json(ds_file, flag).get("zero_optimization", {}).get("stage", 0)
    elif use_deepspeed and is_inline(os.environ):
        # The YAML's settings sit inline under deepspeed_config: accelerate's DeepSpeedPlugin reads them.
        inline = plugin_for(os.environ)
        zero_stage = inline.zero_stage

    if use_deepspeed:
        strategy: Strategy = "deepspeed"
    elif by_accelerate and _env_true("ACCELERATE_USE_FSDP"):
        strategy = "fsdp"
    elif world_size > 1:
        strategy = "ddp"
    else:
        strategy = "single"
    if launched_layout.model_parallel_size > 1:
        # accelerate launch with a TP/CP/SP parallelism_config: train.py builds the mesh itself from
        # --hf_scale_config (which must say the same), as under torchrun: the model on the mesh by transformers
        # (model/parallel.py), CP and Ulysses through the ParallelismConfig it hands accelerate
        # (model/context_parallel.py, sequence_parallel.py). accelerate must not build its own from these variables
        # (refused without GPUs), nor under TP shard with its FSDP plugin the model transformers has already sharded.
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        if launched_layout.tp > 1:
            os.environ["ACCELERATE_USE_FSDP"] = "false"
    return LaunchRequest(
        launcher=launcher,
        world_size=world_size,
        strategy=strategy,
        deepspeed_config_file=ds_file,
        zero_stage=zero_stage,
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION") if by_accelerate else None,
        deepspeed_inline=inline,
        fp8_backend=_fp8_backend_from_env() if by_accelerate else None,
        layout=launched_layout,
        accelerate_fsdp_version=int(os.environ.get("FSDP_VERSION") or 1) if strategy == "fsdp" else None,
        cp_comm_strategy=os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY") if launched_layout.cp > 1 else None,
        sp_attn_implementation=(os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
                                if launched_layout.sp > 1 else None),
    )


def _fp8_backend_from_env() -> str | None:
    """The backend `accelerate launch` exports for a YAML with mixed_precision fp8 (its fp8_config.backend); without
    one accelerate picks torchao first, as here."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION") != "fp8":
        return None
    return rules.fp8_backend_of_accelerate(os.environ.get("ACCELERATE_FP8_BACKEND"))


def init_process_state(request: LaunchRequest, *, ddp_timeout_s: int, ddp_backend: str | None):
    """Create accelerate's `PartialState` for the request, before `TrainingArguments` exists.

    `TrainingArguments(accelerator_config={"use_configured_state": True})` then reuses it, and so does the
    manual loop's `Accelerator`. Without a GPU: DeepSpeed runs over gloo (accelerate would otherwise
    pick no backend and report `DistributedType.NO` in every process) and DDP runs as accelerate's
    MULTI_CPU (`cpu=True`), which wraps the model in real DDP over gloo.
    """
    from accelerate import PartialState

    if request.strategy == "deepspeed":
        # What TrainingArguments does for `--deepspeed` too: accelerate decides DEEPSPEED from this variable.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    if (request.strategy == "deepspeed" or request.fsdp_settings is not None) and "MASTER_ADDR" not in os.environ:
        # `python train.py --deepspeed …` or with a one-process FSDP --hf_scale_config: DeepSpeed and FSDP (torch's
        # fully_shard, accelerate's plugin) need a process group even for one process; give them the
        # single-process rendezvous a launcher would have set (what the HF docs do in notebooks), as
        # `torchrun --nproc_per_node 1` would. Without it fully_shard dies in its own traceback (RANK not set).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    kwargs: dict = {"timeout": timedelta(seconds=ddp_timeout_s)}
    if not has_gpu():
        # FSDP from --hf_scale_config is sharded by torch's fully_shard on CPU (train/fsdp.py); accelerate
        # then only needs its MULTI_CPU state. FSDP from an accelerate YAML stays as asked, and the
        # runtime guard reports that accelerate cannot shard on CPU.
        if request.strategy in ("ddp", "single") or request.fsdp_settings is not None:
            kwargs["cpu"] = True
        if request.world_size > 1 or request.strategy == "deepspeed":
            kwargs["backend"] = "gloo"
    elif ddp_backend:
        kwargs["backend"] = ddp_backend
    state = PartialState(**kwargs)
    _register_peers()
    return state


class PeerLost(UserError):
    """Another rank's process died mid-run: the survivors stop with one line naming it (exit 1, a failed run as
    before, not bad input)."""

    exit_code = 1


_PEERS: list[dict] = []
"""Every rank's host, pid and log file (None: the launcher's console), gathered once at start (gloo runs)."""
PEER_EXIT_WAIT_S = 3.0
"""How long a survivor waits for a peer whose connection closed to show as exited on this machine."""
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe")
"""What gloo raises in a collective whose peer process is gone."""


def _register_peers() -> None:
    """Gather who every rank is, while all are alive: once a rank dies, the others can name it. gloo only: that is
    where a dead peer surfaces as a connection error (NCCL has its own watchdog)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or \
            dist.get_backend() != "gloo":
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # torchrun's per-rank folder; with --log-dir and
    log = Path(error_file).parent / "stderr.log" if error_file else None  # --redirects/--tee it holds the log
    me = {"host": socket.gethostname(), "pid": os.getpid(), "log": str(log) if log and log.exists() else None}
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, me)
    _PEERS[:] = peers


def _alive(pid: int) -> bool:
    """Whether process `pid` (on this machine) still runs; a zombie (killed, not yet reaped) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def lost_peer(error: BaseException) -> PeerLost | None:
    """The one line for a collective that failed because another rank's process is gone, naming the dead ranks and
    where each one's output is; None for any other error."""
    chain, cause = [], error
    while cause is not None and len(chain) < 10:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    found = next((m for e in chain if (m := _PEER_GONE.search(str(e)))), None)
    if found is None or not _PEERS:
        return None
    me, host = int(os.environ.get("RANK", "0")), socket.gethostname()
    deadline = time.monotonic() + PEER_EXIT_WAIT_S
    while True:  # the connection closes as the peer's process exits, slightly before it is a zombie
        dead = [r for r, p in enumerate(_PEERS) if r != me and p["host"] == host and not _alive(p["pid"])]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    elsewhere = sorted({p["host"] for p in _PEERS if p["host"] != host})
    if not dead:
        where = f"on {', '.join(elsewhere)}" if elsewhere else "that dropped its connection"
        return PeerLost(f"rank {me}: a collective failed because another rank is gone (gloo: {found.group(0)}): a "
                        f"rank {where}; its log, and the launcher's summary, say why")
    logs = "; ".join(f"rank {r} was pid {_PEERS[r]['pid']} on {host}, its log: "
                     f"{_PEERS[r]['log'] or 'the launcher console (torchrun --log-dir DIR --tee 3 keeps a file)'}"
                     for r in dead)
    return PeerLost(f"rank {me}: rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died during the run, "
                    f"so this rank's collective failed (gloo: {found.group(0)}); {logs}")


def shutdown(*, barrier: bool = True) -> None:
    """End the process group cleanly.

    A gloo/DeepSpeed run that exits with the group alive aborts at interpreter exit (SIGABRT) although
    training finished, and the launcher reports failure.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
