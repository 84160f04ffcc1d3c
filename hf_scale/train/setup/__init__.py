"""What is decided before anything loads: train.py's own flags, --help, recipes, the launcher's request and the
process group, --hf_scale_config reconciliation, the run spec, and the guard that proves it at the first step."""
