"""Quiet by default: the libraries' known noise is filtered at hf_scale's entry points, never a real warning.

What is filtered, and why it is noise:

- DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
  it.``, logged whenever DeepSpeed is imported where it finds no GPU. `hf-scale` commands need no GPU
  (they read and write files), so it is dropped there; in train.py it is dropped only where the machine has
  no GPU device at all (``/dev/nvidiactl``, ``/dev/kfd``), since on a GPU machine it is real news: CUDA
  is broken there.
- torchao's ``Failed to load .../_C_*.so`` (its CUDA kernels, which cannot load where there is no GPU) and
  bitsandbytes' ``Failed to load CPU gemm_4bit_forward from kernels-community`` (the optional `kernels` package;
  it falls back to its own CPU path): transformers imports torchao whenever it is installed, peft imports
  bitsandbytes. Dropped where the machine has no GPU (hf_scale's commands: always, they use no kernel).
- torch's ``<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile``,
  logged for torchao's enums on import: a deprecation inside torchao, nothing a user can act on.
- transformers' ``is_gradient_checkpointing is deprecated``, raised by peft's own `PeftModel.__init__` (peft
  0.21 reads the renamed property of transformers 5): a deprecation inside peft, nothing a user can act on.
- transformers' ``The modules are dequantized in torch.float32 and casted to torch.float32.``, logged when
  `hf-scale export --merge` dequantizes a QLoRA base as it asked to (its own line says what it reads).
- torch's DataLoader ``'pin_memory' argument is set as true but no accelerator is found`` (the Trainer's
  default ``--dataloader_pin_memory`` on a CPU-only machine: pinning is simply skipped).
- On every process but the first of a multi-process run (``RANK`` > 0), the libraries follow their own
  convention of logging on the main process: transformers and datasets log errors only
  (``TRANSFORMERS_VERBOSITY``, ``DATASETS_VERBOSITY``), their progress bars are off
  (``HF_HUB_DISABLE_PROGRESS_BARS``, ``HF_DATASETS_DISABLE_PROGRESS_BARS``) and DeepSpeed's logger shows
  errors only (rank 0 shows the same notices once).

Two more kinds of library output would stand before train.py's one-line refusal of a bad input, and are kept
out of it without losing anything a run needs:

- Log records written while a library reads an input hf_scale then refuses (datasets' ``Failed to load JSON
  from file ...``, transformers' load report): `held` keeps them back, replays them when the step is accepted
  and drops them when it ends in a one-line refusal (hf_scale.errors.UserError), whose line names the problem.
- Progress bars (datasets' ``Generating train split`` and map bars, transformers' ``Loading weights``): drawn
  only when stderr is a terminal (`progress_bars_on_a_terminal_only`, unless ``--verbose``). In a log file (a
  cluster job's, CI's, a pipe) tqdm's carriage-return redraws are not progress anyone reads, and they would
  stand before the refusal of a later step; hf_scale's own ``hf_scale:`` lines say what each stage did.
  `hf-scale export` does the same for transformers' bars and its own (`transformers_progress_bars_on_a_terminal`).

``--verbose`` (train.py and every `hf-scale` command) or ``HF_SCALE_VERBOSE=1`` keeps everything. Environment
variables the user set explicitly are never overridden.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from hf_scale.errors import UserError
from hf_scale.exit_codes import TERMINAL_ENV

VERBOSE_ENV = "HF_SCALE_VERBOSE"
VERBOSE_FLAG = "--verbose"
_TRUE = ("1", "true", "yes", "on")

DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_NO_GPU = "Setting accelerator to CPU"
TORCHAO_LOGGER, TORCHAO_NO_KERNEL = "torchao", "Failed to load "
BNB_CPU_LOGGER, BNB_NO_KERNELS = "bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"
PYTREE_LOGGER, PYTREE_ENUM = "torch.utils._pytree", "%s is an Enum subclass"
PEFT_CHECKPOINTING_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"
BNB_DEQUANTIZE_LOGGER, BNB_DEQUANTIZED = "transformers.integrations.bitsandbytes", "The modules are dequantized in "
PIN_MEMORY_ON_CPU = r"'pin_memory' argument is set as true but no accelerator is found"
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")
"""Device nodes of the NVIDIA and AMD (ROCm) kernel drivers: present on any machine with a usable GPU."""

_REPLICA_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def verbose_requested(argv: Sequence[str] = ()) -> bool:
    """``--verbose`` among the arguments (also ``--verbose=true``), or ``HF_SCALE_VERBOSE=1``."""
    if os.environ.get(VERBOSE_ENV, "").strip().lower() in _TRUE:
        return True
    return any(arg == VERBOSE_FLAG or arg.lower() in (f"{VERBOSE_FLAG}={v}" for v in _TRUE) for arg in argv)


def gpu_device_present() -> bool:
    return any(Path(path).exists() for path in GPU_DEVICE_FILES)


class _Drop(logging.Filter):
    """Drops records below ``min_level`` or whose message starts with one of ``prefixes``. A filter on the
    logger object survives DeepSpeed's own logger setup at import (which sets the level and adds a handler)."""

    def __init__(self, *, prefixes: tuple[str, ...] = (), min_level: int = logging.NOTSET):
        super().__init__()
        self.prefixes, self.min_level = prefixes, min_level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.min_level and not str(record.msg).startswith(self.prefixes)


_installed: list[tuple[logging.Logger, _Drop]] = []


def _add_filter(logger_name: str, **kwargs) -> None:
    logger = logging.getLogger(logger_name)
    new = _Drop(**kwargs)
    if not any(isinstance(f, _Drop) and vars(f) == vars(new) for f in logger.filters):
        logger.addFilter(new)
        _installed.append((logger, new))


def undo() -> None:
    """Show the libraries' log records again (``--verbose`` read from a recipe, after the entry point filtered);
    what they printed while loading is gone."""
    while _installed:
        logger, installed = _installed.pop()
        logger.removeFilter(installed)


def is_replica(environ=os.environ) -> bool:
    """A process other than the first of a launched job (torchrun, accelerate launch and the deepspeed launcher
    all set RANK); a single process is the main one."""
    rank = environ.get("RANK", "0").strip()
    return rank.isdigit() and int(rank) > 0


def quiet_command() -> None:
    """For `hf-scale` commands: they never need a GPU, so DeepSpeed's "no GPU" notice is never news."""
    _add_filter(DEEPSPEED_LOGGER, prefixes=(DEEPSPEED_NO_GPU,))
    _add_filter(PYTREE_LOGGER, prefixes=(PYTREE_ENUM,))
    _add_filter(BNB_DEQUANTIZE_LOGGER, prefixes=(BNB_DEQUANTIZED,))
    warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
    _quiet_kernels()


def _quiet_kernels() -> None:
    _add_filter(TORCHAO_LOGGER, prefixes=(TORCHAO_NO_KERNEL,))
    _add_filter(BNB_CPU_LOGGER, prefixes=(BNB_NO_KERNELS,))


def quiet_training(*, replica: bool | None = None) -> None:
    """For train.py, before the libraries are imported (their import-time notices included)."""
    _add_filter(PYTREE_LOGGER, prefixes=(PYTREE_ENUM,))
    warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
    if not gpu_device_present():
        _add_filter(DEEPSPEED_LOGGER, prefixes=(DEEPSPEED_NO_GPU,))
        _quiet_kernels()
        warnings.filterwarnings("ignore", message=PIN_MEMORY_ON_CPU, category=UserWarning)
    if is_replica() if replica is None else replica:
        ours = [name for name in _REPLICA_ENV if name not in os.environ]
        for name in ours:
            os.environ[name] = _REPLICA_ENV[name]
        _quiet_loaded_libraries(ours)
        _add_filter(DEEPSPEED_LOGGER, min_level=logging.ERROR)


def _quiet_loaded_libraries(names: Sequence[str]) -> None:
    """The libraries read those variables once, when they are imported: where they are loaded already (a Ray
    Train worker that unpickled the loop, a process forked from one that imported them), the same settings through
    their own APIs. Only the variables set here (`names`): the user's own choice stays."""
    transformers, datasets = sys.modules.get("transformers"), sys.modules.get("datasets")
    if transformers is not None:
        from transformers.utils import logging as transformers_logging

        if "TRANSFORMERS_VERBOSITY" in names:
            transformers_logging.set_verbosity_error()
        if "HF_HUB_DISABLE_PROGRESS_BARS" in names:
            transformers_logging.disable_progress_bar()
    if "HF_HUB_DISABLE_PROGRESS_BARS" in names and "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if datasets is not None:
        if "DATASETS_VERBOSITY" in names:
            datasets.utils.logging.set_verbosity_error()
        if "HF_DATASETS_DISABLE_PROGRESS_BARS" in names:
            datasets.disable_progress_bars()


@contextlib.contextmanager
def held(*logger_names: str) -> Iterator[None]:
    """Hold the records of these loggers and of their children while the block runs: dropped when it raises
    UserError, replayed through their loggers otherwise."""
    records: dict[int, logging.LogRecord] = {}

    def hold(record: logging.LogRecord) -> bool:
        records.setdefault(id(record), record)
        return False

    # A logger's filter sees only that logger's own records; its handlers' filters also see its children's,
    # created lazily while a library loads (datasets' builder modules). Both get the filter.
    loggers = [logging.getLogger(name) for name in logger_names]
    targets = [*loggers, *(handler for logger in loggers for handler in logger.handlers)]
    for target in targets:
        target.addFilter(hold)
    try:
        yield
    except UserError:
        records.clear()
        raise
    finally:
        for target in targets:
            target.removeFilter(hold)
        for record in records.values():
            logging.getLogger(record.name).handle(record)


def draw_progress_bars(verbose: bool) -> bool:
    """Whether a command draws progress bars: on a terminal, or with ``--verbose`` (see the module docstring)."""
    return verbose or sys.stderr.isatty()


@contextlib.contextmanager
def transformers_progress_bars_on_a_terminal(verbose: bool) -> Iterator[None]:
    """transformers' progress bars (``Loading weights``, ``Writing model shards``) off while the block runs, unless
    :func:`draw_progress_bars` or the user chose with HF_HUB_DISABLE_PROGRESS_BARS; then as they were (a command also
    runs in-process: tests, notebooks)."""
    from transformers.utils import logging as transformers_logging

    if draw_progress_bars(verbose) or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        yield
        return
    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            transformers_logging.enable_progress_bar()


def progress_bars_on_a_terminal_only() -> None:
    """datasets' and transformers' progress bars off unless stderr is a terminal (see the module docstring);
    a choice the user made with HF_DATASETS_DISABLE_PROGRESS_BARS / HF_HUB_DISABLE_PROGRESS_BARS stands. The
    choice is applied here, not left to the libraries: they read the variable once, at import, and a process that
    imported them before it was set (a test run, a notebook) would otherwise keep the state some earlier code
    left."""
    # TERMINAL_ENV: a launch script's filter (a pipe) with a terminal behind it.
    terminal = sys.stderr.isatty() or os.environ.get(TERMINAL_ENV) == "1"
    for variable, library in (("HF_DATASETS_DISABLE_PROGRESS_BARS", "datasets"),
                              ("HF_HUB_DISABLE_PROGRESS_BARS", "transformers")):
        chosen = os.environ.get(variable)
        if chosen is None and terminal:
            continue
        _PROGRESS_BARS[library](chosen is None or chosen.strip().lower() in _TRUE)


def _datasets_progress_bars(disable: bool) -> None:
    import datasets

    (datasets.disable_progress_bars if disable else datasets.enable_progress_bars)()


def _transformers_progress_bars(disable: bool) -> None:
    from transformers.utils import logging as transformers_logging

    (transformers_logging.disable_progress_bar if disable else transformers_logging.enable_progress_bar)()


_PROGRESS_BARS = {"datasets": _datasets_progress_bars, "transformers": _transformers_progress_bars}
"""Turns a library's progress bars off (True) or on (False)."""
