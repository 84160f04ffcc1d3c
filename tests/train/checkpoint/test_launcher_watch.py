"""Ranks stop when their launcher dies (hf_scale.train.checkpoint.launcher_watch): a real torchrun whose agent
alone is killed with SIGKILL, as an OOM killer or a scheduler that signals only the launcher would, and a real
`deepspeed` runner killed alone (its per-node agent lives on); and a rank
whose stop cannot finish, ended after the grace time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import child_env, launcher_command

from hf_scale.contract import checkpoint_layout, checkpoint_verification
from hf_scale.train.checkpoint import output_lock

STOPPED_WITHIN_S = 60


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (torchrun starts each rank in its own session: no group to ask)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _ranks(launcher: str, pid: int) -> list[int]:
    """The training processes under launcher `pid`: torchrun's children; under the `deepspeed` runner the children of
    its per-node agent (deepspeed.launcher.launch)."""
    if launcher == "torchrun":
        return _children(pid)
    return [rank for agent in _children(pid) for rank in _children(agent)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_ranks_stop_with_a_checkpoint_and_release_the_lock_when_the_launcher_is_killed(launcher, tmp_path):
    """The launcher alone killed: torchrun's agent (its ranks are in sessions of their own), or the `deepspeed`
    runner, whose per-node agent then lives on as the ranks' parent: the ranks notice all the same."""
    out, log = tmp_path / "out", tmp_path / "log"
    command = launcher_command(launcher) + ["--max_steps", "100000", "--save_steps", "100000",
                                            "--output_dir", str(out)]
    with open(log, "w") as log_file:  # a file, not a pipe: the ranks keep writing after the launcher is gone
        agent = subprocess.Popen(command, env=child_env(), stdout=log_file, stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):  # training started
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = _ranks(launcher, agent.pid)
        assert len(ranks) == 2, ranks
        alive = [*_children(agent.pid), *ranks]  # with deepspeed also its agent: it ends once its ranks have
        agent.send_signal(signal.SIGKILL)  # the launcher only
        agent.wait()
        deadline = time.monotonic() + STOPPED_WITHIN_S
        while any(map(_alive, alive)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [pid for pid in alive if _alive(pid)]
        assert not left, f"{left} still running {STOPPED_WITHIN_S} s after their launcher died\n" + \
            log.read_text()[-3000:]
    finally:
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    # At least one rank notices the launcher's exit itself; the first to notice stops the others through the
    # run's stop agreement, so a slower rank may say "stopped by a signal on another rank" instead (a race, not a
    # defect): every rank stopping in time is what the loop above holds.
    assert "the exit of its launcher" in text and "checkpoint saved in" in text, text[-3000:]
    saved = checkpoint_layout.complete_checkpoints(out)
    assert len(saved) == 1 and checkpoint_verification.verify(saved[0]) is None, (saved, text[-3000:])
    lock = output_lock.OutputDirLock(out)  # not refused "another run is using it"
    lock.acquire()
    lock.release()


_ORPHAN = """
import sys, time
from hf_scale.train.checkpoint import launcher_watch
from hf_scale.train.checkpoint.store import StopRequest
assert launcher_watch.watch(StopRequest(), "python") is None  # plain python: never watched
launcher_watch.watch(StopRequest(), "torchrun", poll_s=0.1, grace_s=float(sys.argv[1]))
print("watching", flush=True)
while True:  # a rank stuck where no stop check comes (a collective waiting for a dead peer)
    time.sleep(0.1)
"""


def test_a_rank_whose_stop_never_ends_exits_after_the_grace_time(tmp_path):
    """A real parent (the launcher) with a real child (the rank) that never reaches a stop check: killed parent,
    child gone once the grace time is over, saying why."""
    log = tmp_path / "stderr"
    parent_code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', sys.argv[1], '2']); "
                   "print(child.pid, flush=True); time.sleep(600)")
    with open(log, "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", parent_code, _ORPHAN], env=child_env(),
                                  stdout=subprocess.PIPE, stderr=stderr, text=True)
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "watching", log.read_text()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), log.read_text()
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
    text = log.read_text()
    assert f"the exit of its launcher (pid {parent.pid}); saving a checkpoint" in text, text
    assert "did not end within 2 s; exiting without it" in text, text
