"""train.py's entry point: what must happen before the training libraries load, then hf_scale.train.main.

The libraries print while they are imported (DeepSpeed's accelerator notice), so the quiet filters
(hf_scale.quiet) go in first, unless --verbose or HF_SCALE_VERBOSE=1.
"""

from __future__ import annotations

import sys

from hf_scale import quiet


def main() -> None:
    if not quiet.verbose_requested(sys.argv[1:]):
        quiet.quiet_training()
    from hf_scale.train.main import main as train_main

    train_main()
