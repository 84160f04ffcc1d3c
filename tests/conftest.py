"""Suite-wide settings.

Under pytest-xdist (the README's `-n 2`) two workers share the machine's cores, and each test's training
processes already run one OpenMP thread per rank (train_helpers.child_env). A worker's own in-process torch
work then takes one thread as well: two workers with a thread per core each, instead of OpenMP teams that
spin-wait on cores the other worker is using.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
