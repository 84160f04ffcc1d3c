"""How hf_scale's processes tell whoever started them how they ended: exit codes and the preemption marker (and
how a restarted one is told to continue: the resume default).

A low-level module (no imports): the training runtime (hf_scale.train) sets these, the generated launch
scripts (hf_scale.generators.launch) test them, and neither depends on the other for it.
"""

EXIT_BAD_INPUT = 2
"""Bad input (a config value, a CLI flag, a dataset, a model path): one line on stderr, no traceback."""

EXIT_PREEMPTED = 75
"""train.py's exit code after saving a checkpoint on SIGTERM/SIGUSR1 (EX_TEMPFAIL: run again to resume);
the generated SLURM script requeues the job on it."""

PREEMPTED_MARKER_ENV = "HF_SCALE_PREEMPTED_MARKER"
"""Every launcher reports a training process's exit code 75 as its own failure (torchrun and accelerate: 1),
so the generated launch scripts point this variable at a file that train.py creates after saving the
checkpoint on a stop request (hf_scale.train.checkpoint.preemption); the script then exits EXIT_PREEMPTED."""

RESUME_DEFAULT_ENV = "HF_SCALE_RESUME"
"""Set to ``auto`` by the generated cluster scripts (the sbatch, the node script): a restarted job continues from the
newest intact checkpoint, unless train.py's own flags (in any spelling, or its recipe) say where to resume from.
train.py decides it after parsing its flags (hf_scale.train.setup.parser.resume_default): a script appending
``--resume_from_checkpoint auto`` would replace an explicit ``--resume-from-checkpoint X`` (the last flag wins)."""
