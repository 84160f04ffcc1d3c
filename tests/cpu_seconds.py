"""Opt-in pytest plugin (`-p cpu_seconds`, with CPU_SECONDS_LOG=FILE): one JSON line per test with its CPU
seconds, to measure what a test costs on a shared machine where the wall clock counts other jobs' time too.

CPU = user + sys of the test process and of the children it waited for, plus the preloaded fork server's
(tests/preloaded.py) own and its reaped children's: the runs it served, which the test process never waits for.
The first test of a module also carries the module-scoped fixtures it set up."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _fork_server_cpu() -> float:
    """utime + stime + cutime + cstime of this worker's fork server (0 before it starts)."""
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid  # multiprocessing keeps no public accessor for it
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / _TICK


def _own_cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Writes {"id", "worker", "cpu", "served", "wall"} for the test (setup, call and teardown)."""
    cpu, server, wall = _own_cpu(), _fork_server_cpu(), time.time()
    yield
    served = _fork_server_cpu() - server if server else _fork_server_cpu()  # a server started by this test
    if log := os.environ.get("CPU_SECONDS_LOG"):
        with open(log, "a") as out:
            out.write(json.dumps({"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                                  "cpu": round(_own_cpu() - cpu + served, 1), "served": round(served, 1),
                                  "wall": round(time.time() - wall, 1)}) + "\n")
