"""The checks of `hf-scale check` (the command: hf_scale.commands.check): one module per concern, registered in
checks.CHECKS, each finding's code declared in codes.py."""
