"""How train.py tells the generated launch script that it stopped with a checkpoint on a stop request.

Every launcher reports a training process's exit code 75 (EXIT_PREEMPTED) as its own failure (torchrun and
accelerate: 1), so the exit code cannot carry it. The launch scripts (hf_scale/generators/launch.py) point
``HF_SCALE_PREEMPTED_MARKER`` at a file in a private temporary directory; train.py creates that file after
saving the checkpoint, on every rank of the machine; the script then exits 75 and the SLURM script
requeues the job.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hf_scale.exit_codes import PREEMPTED_MARKER_ENV


def mark_preempted() -> None:
    """Create the marker file if a launch script asked for one (nothing to do otherwise)."""
    marker = os.environ.get(PREEMPTED_MARKER_ENV)
    if marker:
        # The script's directory is gone if it was killed; nothing is waiting for the marker then.
        with contextlib.suppress(OSError):
            Path(marker).touch()
