"""What the tests' fork server (tests/preloaded.py) does once before it forks any run: import train.py's runtime,
torchrun, accelerate's launcher and DeepSpeed (accelerate imports it in every run, to unwrap the model), fill
transformers' checkpoint-conversion table (built on first use from ~1,000 regular expressions, more than `re`'s
cache holds), and freeze what is loaded, so that a run's `gc.collect()` (accelerate calls it when it frees memory)
walks only the run's own objects. Measured on a 2-step tiny run forked from it: 2.9 s without these three, 1.2 s
with them."""

import gc

import accelerate.commands.launch  # noqa: F401
import deepspeed  # noqa: F401
import torch.distributed.run  # noqa: F401
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

import hf_scale.commands.train  # noqa: F401
import hf_scale.train.main  # noqa: F401

get_checkpoint_conversion_mapping("llama")  # builds and keeps transformers' table (a module-level cache)
gc.freeze()
