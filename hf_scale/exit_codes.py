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

REFUSED_MARKER_ENV = "HF_SCALE_REFUSED_MARKER"
"""A launcher turns a training process's exit 2 into its own traceback (torchrun and accelerate: ChildFailedError,
exit 1) and every rank that refuses prints the same line. The generated launch scripts point this variable at a
file: the first rank to refuse writes its one line there (and prints nothing), and the script prints that line
once, holds back what the launcher adds after it, and exits EXIT_BAD_INPUT."""

STARTED_MARKER_ENV = "HF_SCALE_STARTED_MARKER"
"""The launchers print their own start-up lines (the deepspeed launcher's [INFO] block, DeepSpeed's accelerator notice)
before train.py has judged its flags. The generated launch scripts point this variable at a file that train.py creates
once its start checks (flags, config, launcher, machine) have passed, before the process group; until it exists (or
a refusal's marker, or HOLD_START_S), the scripts' filter holds the launcher's output back: a start-time refusal is
then the one line alone, and a run that starts shows those lines, late by its start checks."""

HOLD_START_S = 120
"""Seconds the generated launch scripts hold the launcher's output back at most, waiting for STARTED_MARKER_ENV's file
(a training that never gets there still shows its output; a TRAIN_SCRIPT of one's own ends the hold by creating the
file, as it may create the preemption marker)."""

TERMINAL_ENV = "HF_SCALE_TERMINAL"
"""Set to 1 by the generated launch scripts when their own stderr is a terminal: the launcher's output reaches it
through the scripts' filter (a pipe), and train.py draws progress bars only on a terminal (hf_scale.quiet)."""

RESUME_DEFAULT_ENV = "HF_SCALE_RESUME"
"""Set to ``auto`` by the generated cluster scripts (the sbatch, the node script): a restarted job continues from the
newest intact checkpoint, unless train.py's own flags (in any spelling, or its recipe) say where to resume from.
train.py decides it after parsing its flags (hf_scale.contract.parser.resume_default): a script appending
``--resume_from_checkpoint auto`` would replace an explicit ``--resume-from-checkpoint X`` (the last flag wins)."""
