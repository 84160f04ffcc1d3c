"""train.py's entry point: what must happen before the training libraries load, then hf_scale.train.main.

`--help` is answered from the parser's snapshot (hf_scale.contract.help_snapshot) before anything heavy is
imported. The libraries print while they are imported (DeepSpeed's accelerator notice), so the quiet filters
(hf_scale.quiet) go in first, unless --verbose or HF_SCALE_VERBOSE=1.
"""

from __future__ import annotations

import sys

from hf_scale import quiet
from hf_scale.contract import help_snapshot


def main() -> None:
    if help_snapshot.help_requested(sys.argv[1:]):
        help_snapshot.print_help(sys.argv[1:])  # exits: neither transformers nor torch is loaded for --help
    if not quiet.verbose_requested(sys.argv[1:]):
        quiet.quiet_training()
    from hf_scale.train.main import main as train_main

    train_main()
