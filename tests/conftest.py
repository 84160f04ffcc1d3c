"""Suite-wide settings.

Under pytest-xdist (the README's `-n 2`) two workers share the machine's cores, and each test's training
processes already run one OpenMP thread per rank (train_helpers.child_env). A worker's own in-process torch
work then takes one thread as well: two workers with a thread per core each, instead of OpenMP teams that
spin-wait on cores the other worker is using.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# How `-n 2` deals the tests (pyproject's addopts: `--dist loadgroup --no-loadscope-reorder`). xdist's default
# `load` deals consecutive tests to alternating workers, so a module's tests end up on both workers and each
# worker builds the module's shared runs (module-scoped reference runs, generated configs, DeepSpeed's prebuilt
# comm op) and the session's SLURM cluster again. Here every module that launches training processes (a test
# marked `multiprocess` or `slurm`) is one xdist group, all of tests/slurm one more (one cluster), so each shared
# run is made once; those groups come first, the most launches first, and the cheap one-process tests
# (thousands, each dealt on its own) fill both workers' tails.
HEAVY_MARKERS = ("multiprocess", "slurm")


def _group(item) -> str:
    """The xdist group of a test in a module that launches processes: its module (tests/slurm: one group)."""
    path = item.nodeid.split("::")[0]
    return "tests/slurm" if path.startswith("tests/slurm/") else path


@pytest.hookimpl(tryfirst=True)  # before xdist adds each test's group to its id
def pytest_collection_modifyitems(config, items):
    """Group the launching modules (see above) and put them first, the module with the most launches first;
    within a module the collection order is kept. Without xdist the groups only change the order."""
    launches: dict[str, int] = {}
    for item in items:
        if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
            launches[_group(item)] = launches.get(_group(item), 0) + 1
    for item in items:
        if _group(item) in launches:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    first = {group: rank for rank, group in enumerate(sorted(launches, key=lambda group: -launches[group]))}
    items.sort(key=lambda item: first.get(_group(item), len(first)))  # stable: each module keeps its order
