"""`python train.py FLAGS` that also records the trained model's logits on train_helpers.PROBE_IDS: computed by the
live (still sharded) model after the last optimizer step, right before train.py's final save. What a model made
later from the run's checkpoint (`hf-scale export`) must reproduce when train.py itself writes no safetensors
(ZeRO-3 without 16-bit gathering, tests/train/checkpoint/test_save.py). train.py's own code runs unchanged,
exit code included.

Usage: python tests/_trained_logits_worker.py LOGITS_FILE [train.py flags...]
"""

from __future__ import annotations

import sys

import torch
from train_helpers import PROBE_IDS, TRAIN_PY

from hf_scale import quiet


def main() -> None:
    logits_file, flags = sys.argv[1], sys.argv[2:]
    sys.argv = [TRAIN_PY, *flags]
    if not quiet.verbose_requested(flags):  # as hf_scale.commands.train does, before the libraries load
        quiet.quiet_training()
    from hf_scale.train import main as train_main

    finish = train_main.finish

    def record_logits_then_finish(run, built, fitted):
        with torch.no_grad():  # a forward through the DeepSpeed engine: ZeRO-3 gathers each layer for it
            logits = fitted.model(input_ids=PROBE_IDS.to(fitted.accelerator.device)).logits.float().cpu()
        if fitted.accelerator.is_main_process:
            torch.save(logits, logits_file)
        return finish(run, built, fitted)

    train_main.finish = record_logits_then_finish
    train_main.main()


if __name__ == "__main__":
    main()
