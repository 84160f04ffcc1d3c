"""Training runs started from a process that has imported train.py's runtime once.

A tiny training run is mostly imports: torch, transformers and what transformers itself imports when it is
installed (peft and bitsandbytes through TrainingArguments, torchao through modeling_utils) take ~10 s of CPU per
process, the steps of the tiny model a few. Every `python train.py` and every rank of `torchrun ... train.py` that
a test starts through `train_helpers.run` paid them again; here they start from a multiprocessing fork server that
imported them once (per pytest worker):

- `python train.py ARGS` is train.py run by runpy in a fork of the server (and so is `python WORKER ARGS`, a
  worker script of the tests, a .py file under tests/: `torchrun` of one too; and `python benchmarks/SCRIPT ARGS`,
  whose variants stay its own subprocesses);
- `torchrun ARGS` is torchrun's own `main` in a fork of the server, given its `--run-path` and
  `--start-method fork` (torchrun's documented way to run the script in its own interpreter), so the ranks are forks
  of the preloaded agent, with the rendezvous, environment and supervision torchrun gives them;
- `python -m hf_scale ARGS` (the `hf-scale` commands: export, demo, ...) is the package's `__main__` run by runpy
  in a fork of the server, as `-m` runs it, and so is `python -m hf_scale.MODULE ARGS` (ray_train's driver);
- `python -m accelerate.commands.launch ARGS` is accelerate's own argument processing and launcher in a fork of the
  server: accelerate hands its multi-process and single-node DeepSpeed runs to torchrun's `run` with the torchrun
  options of the same name (`_filter_args`), so the parsed arguments are given torchrun's `run_path` and
  `start_method="fork"` and the ranks are forks again, with the environment accelerate prepared for them. A
  one-process config (accelerate's `simple_launcher`) still starts `python train.py` as a subprocess from there.

What keeps the real subprocess: the `deepspeed` launcher (its runner and per-node `launch.py` start each rank with
`subprocess.Popen`), any environment that differs from the server's in a variable read at import (HF_DATASETS_CACHE
among them: the preloaded value would be stale; PATH and the build variables are read only when something is built,
AT_BUILD, a launcher's variables when the run starts, AT_START), and the tests of a launcher's or the interpreter's
own behaviour (signals, exit at interpreter shutdown, output filtering), which call `subprocess` themselves.
HF_SCALE_TESTS_PRELOAD=0 turns it off.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
PYTHON_M = [sys.executable, "-m"]
# What the server imports before it forks anything: train.py's runtime, torchrun and accelerate's launcher.
PRELOAD = ["preloaded_runtime"]

# Variables that may differ between the server's environment and a run's without any preloaded import reading them:
# pytest's per-test name; what libraries set in os.environ when the test process imports them (DeepSpeed, torch's
# inductor, tensorboardX, Ray's client mode); and gloo's interface, read when a process group starts, not at import.
PER_TEST = {"PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK", "CRC32C_SW_MODE", "RAY_CLIENT_MODE",
            "GLOO_SOCKET_IFNAME"}  # and inductor's own (TORCHINDUCTOR_*, _TORCHINDUCTOR_*), set when something compiles
# Read when something is built or a program is looked up, never at import (checked in DeepSpeed's and
# torch.utils.cpp_extension's module-level code): the DeepSpeed runs on a PATH without compilers may be served.
AT_BUILD = {"PATH", "CC", "CXX", "TORCH_EXTENSIONS_DIR", "TORCH_CUDA_ARCH_LIST"}
# What a launcher sets for its ranks, read when the run starts (torch.distributed's process group, accelerate's
# PartialState and Accelerator, CUDA's initialisation: a CPU build has none), never at import: no module-level read of
# them in torch.distributed, accelerate (its one is USE_TORCH_XLA), DeepSpeed, transformers, peft or hf_scale
# (checked by grep). A test that runs train.py under a launcher's environment by hand may be served.
AT_START = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES"}
AT_START_PREFIXES = ("ACCELERATE_", "PARALLELISM_CONFIG_")
_server: dict = {}
TESTS = os.path.dirname(os.path.abspath(__file__))
"""This folder: the worker scripts under it may be run from the server (and the server imports PRELOAD from it)."""
BENCHMARKS = os.path.join(os.path.dirname(TESTS), "benchmarks")
"""The benchmark scripts, which the smoke tests run end to end (the variants they start are their own subprocesses)."""


def _script(path: str, train_py: str) -> bool:
    """train.py, a worker script of the tests (a .py file under tests/) or a benchmark script: what the server may
    run."""
    return path == train_py or (path.endswith(".py") and any(
        os.path.abspath(path).startswith(folder + os.sep) for folder in (TESTS, BENCHMARKS)))


def _kind(command: list[str], train_py: str) -> tuple[str, str | None] | None:
    """How the server runs `command`, and the script it runs (None for `python -m MODULE`); None where it cannot."""
    if len(command) >= 2 and command[0] == sys.executable and _script(command[1], train_py):
        return "python", command[1]
    if command[:3] == TORCHRUN:
        script = next((word for word in command[3:] if _script(word, train_py)), None)
        return ("torchrun", script) if script else None
    if command[:3] == ACCELERATE_LAUNCH and train_py in command:
        return "accelerate", train_py
    if command[:2] == PYTHON_M and len(command) > 2 and command[2].split(".")[0] == "hf_scale":
        return "module", None  # python -m hf_scale (the hf-scale commands) or -m hf_scale.commands.ray_train, ...
    return None


def server_context(server_env: dict[str, str], env: dict[str, str] | None = None):
    """The fork server's context (started in `server_env` by the first call), where `env` (default: `server_env`)
    is the server's; None where it is not."""
    env = server_env if env is None else env
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        # Python 3.11's forkserver.main takes the parent's sys.path but does not apply it before the preload (3.12
        # does), and a failed preload is an ImportError it passes over in silence: the server would import nothing
        # and every run would import everything again. PYTHONPATH puts this folder on the server's own sys.path;
        # each run gets the test process's sys.path from multiprocessing, and its own environment (_child).
        os.environ.update(server_env, PYTHONPATH=os.pathsep.join(
            filter(None, [TESTS, server_env.get("PYTHONPATH")])))
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server.update(context=context, env=dict(server_env))
    return _server["context"] if _comparable(_server["env"]) == _comparable(env) else None


def _comparable(env: dict[str, str]) -> dict[str, str]:
    """The environment but for PER_TEST, AT_BUILD, AT_START and torch inductor's variables."""
    return {key: value for key, value in env.items()
            if key not in PER_TEST | AT_BUILD | AT_START and not key.startswith(AT_START_PREFIXES)
            and not key.lstrip("_").startswith("TORCHINDUCTOR_")}


def _log(how: str, command: list[str]) -> None:
    """With HF_SCALE_TESTS_PRELOAD_LOG=FILE, one line per run: how it started (to see what the server serves)."""
    if log := os.environ.get("HF_SCALE_TESTS_PRELOAD_LOG"):
        with open(log, "a") as out:
            out.write(f"{how}\t{os.environ.get('PYTEST_CURRENT_TEST', '')}\t{' '.join(command)[:200]}\n")


def limit_file_size(limit: int) -> None:
    """RLIMIT_FSIZE of this process and what it starts (the hard limit kept)."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _child(kind: str, argv: list[str], first: str, cwd: str, env: dict[str, str], out: str, err: str,
           file_size_limit: int | None = None) -> None:
    """In the fork: what `subprocess` would have given the command (its own session, directory, environment,
    standard streams, the interpreter's default signal dispositions, `file_size_limit` as its RLIMIT_FSIZE, and
    `first` first on sys.path: the script's folder as `python SCRIPT` puts it, the directory as `python -m` does),
    then the command (`argv` after `python` or `python -m MODULE`)."""
    os.setsid()  # one process group: a timeout kills the ranks with it
    for fd, path in ((1, out), (2, err)):  # first: whatever fails next is in the run's output
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    if file_size_limit is not None:  # the captured output files too: a run under a limit must print less than it
        limit_file_size(file_size_limit)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    sys.path.insert(0, first)
    if kind == "python":
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    elif kind == "module":
        sys.argv = [sys.argv[0], *argv[1:]]  # run_module replaces sys.argv[0] with the module's file, as -m does
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    elif kind == "torchrun":
        from torch.distributed.run import main

        main(["--run-path", "--start-method", "fork", *argv])
    else:
        from accelerate.commands.launch import launch_command, launch_command_parser

        args = launch_command_parser().parse_args(argv)
        # torchrun's options, which accelerate's _filter_args copies by name into the arguments it gives torchrun.
        args.run_path, args.start_method = True, "fork"
        launch_command(args)
    sys.exit(0)


def preload_state() -> None:
    """In a fork of the server: exit 0 if the server imported PRELOAD, 3 if it did not (multiprocessing's forkserver
    passes over a preload's ImportError in silence)."""
    sys.exit(0 if all(name in sys.modules for name in PRELOAD) else 3)


def run(command: list[str], *, cwd: Path | None, env: dict[str, str], timeout: float, train_py: str,
        server_env: dict[str, str], file_size_limit: int | None = None):
    """The CompletedProcess of `command` run from the preloaded server, or None where it must be a subprocess.
    The server runs in `server_env` (the tests' usual child environment)."""
    how = _kind(command, train_py)
    if how is None or os.environ.get("HF_SCALE_TESTS_PRELOAD") == "0":
        if train_py in command:
            _log("subprocess (launcher)" if how is None else "subprocess (HF_SCALE_TESTS_PRELOAD=0)", command)
        return None
    kind, script = how
    context = server_context(server_env, env)
    if context is None:
        base, given = _comparable(_server["env"]), _comparable(env)
        _log(f"subprocess ({sorted(k for k in base.keys() | given.keys() if base.get(k) != given.get(k))})", command)
        return None
    _log("preloaded", command)
    # After `python`, `python -m` (the module and its arguments) or `python -m MODULE` (a launcher's arguments).
    argv = command[1:] if kind == "python" else command[2:] if kind == "module" else command[3:]
    directory = str(cwd or os.getcwd())
    first = directory if script is None else os.path.dirname(os.path.abspath(script))
    with tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = context.Process(target=_child, args=(kind, argv, first, directory, env, out, err,
                                                                  file_size_limit))
        process.start()
        process.join(timeout)
        timed_out = process.exitcode is None
        if timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.join()
        # Text mode as subprocess.run(text=True) reads it: universal newlines (a progress bar's \r is a line end).
        stdout = Path(out).read_text(errors="backslashreplace")
        stderr = Path(err).read_text(errors="backslashreplace")
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)
