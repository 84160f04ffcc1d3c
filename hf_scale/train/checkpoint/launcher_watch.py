"""Ranks stop when their launcher dies.

A launcher killed alone (an OOM killer, or a scheduler that signals only the process it started) leaves its
ranks running: torchrun starts each rank in its own session, so nothing reaches them, and they would train to
the end unsupervised, holding the devices and the output-directory lock (every restart refused). A rank
started by a launcher therefore watches its parent: when it changes (the rank was re-parented), the rank asks
for a stop as SIGTERM would, so it saves a checkpoint after the current optimizer step and exits 75, and the
lock goes with it. Every rank polls its own parent, so all of them notice within the poll interval and agree
on the same step (the loops' stop check is a collective). If that stop does not end the process within
GRACE_S (a collective that waits for a rank that died with the launcher), the process exits anyway: the kernel
releases the lock then, and the save in progress, being atomic, leaves the previous checkpoint intact.

The `deepspeed` runner starts one agent per node (deepspeed.launcher.launch, found by the CROSS_RANK it sets),
which starts the ranks: killing the runner alone re-parents the agent and leaves the ranks' parent alive. A rank
under that agent therefore also watches the agent's parent (AGENT_LAUNCHERS), and stops when the agent is
re-parented as when its own parent dies.

A thread polling os.getppid(), not prctl(PR_SET_PDEATHSIG): the death signal fires when the *thread* that
forked the process exits, which in a launcher need not be the launcher's end.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 1.0
AGENT_LAUNCHERS = frozenset({"deepspeed"})
"""Launchers (LaunchRequest.launcher) whose ranks are started by a per-node agent the launcher started: the agent's
parent is watched too."""
GRACE_S = 600.0
"""Time for the stop checkpoint once the launcher is gone: a large model's save takes minutes, a hang never ends."""


def watch(stop, launcher: str, *, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the watchdog when this process was started by a launcher (None otherwise). ``stop``: the run's
    checkpoint.StopRequest; ``launcher``: LaunchRequest.launcher, read from the launcher's variables before
    train.py sets LOCAL_RANK itself (a one-process DeepSpeed run under plain python)."""
    if launcher == "python":
        return None  # `nohup python train.py &`: the shell that started it may exit, the run goes on
    if threading.current_thread() is not threading.main_thread():
        return None  # Ray Train's worker thread: Ray stops and restarts its workers itself (as StopRequest.install)
    parent = os.getppid()
    runner = parent_of(parent) if launcher in AGENT_LAUNCHERS else None
    thread = threading.Thread(target=_watch, args=(stop, parent, runner, poll_s, grace_s),
                              name="hf_scale-launcher-watch", daemon=True)
    thread.start()
    return thread


def parent_of(pid: int) -> int | None:
    """The parent of process `pid` (None when it is gone or /proc cannot say: then only the own parent is watched)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            return int(stat.read().rpartition(")")[2].split()[1])  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _watch(stop, launcher: int, runner: int | None, poll_s: float, grace_s: float) -> None:
    while os.getppid() == launcher and (runner is None or parent_of(launcher) == runner):
        time.sleep(poll_s)
    reason = f"the exit of its launcher (pid {launcher if os.getppid() != launcher else runner})"
    print(f"hf_scale: rank {os.environ.get('RANK', '?')}: {reason}; saving a checkpoint after the current step, "
          f"then exiting (at most {grace_s:.0f} s from now)", file=sys.stderr, flush=True)
    stop.request(reason)
    time.sleep(grace_s)
    print(f"hf_scale: rank {os.environ.get('RANK', '?')}: the stop after {reason} did not end within "
          f"{grace_s:.0f} s; exiting without it (the newest complete checkpoint is intact)",
          file=sys.stderr, flush=True)
    os._exit(1)  # the main thread may be blocked in a collective forever: only a hard exit ends it
