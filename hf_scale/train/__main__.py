"""`python -m hf_scale.train` == `python train.py` (for launchers' `-m`/`--module` and installed use)."""

from hf_scale.commands.train import main

main()
