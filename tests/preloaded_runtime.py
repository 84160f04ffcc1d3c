"""What the tests' fork server (tests/preloaded.py) imports once: train.py's runtime and torchrun."""

import torch.distributed.run  # noqa: F401

import hf_scale.commands.train  # noqa: F401
import hf_scale.train.main  # noqa: F401
