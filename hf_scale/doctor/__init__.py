"""What `hf-scale doctor` (hf_scale.commands.doctor) measures and judges beyond the node report: the all-reduce,
a config's demands, parallelism support, the hardware profile and the SLURM cluster."""
