"""hf_scale's own flags of train.py (`ScaleArguments`: the loop, --hf_scale_config, ...).

Parsed together with transformers' `TrainingArguments`, the model's (`model/arguments.py`) and the data's
(`data/arguments.py`) by `HfArgumentParser`, so every Trainer flag users know keeps working in both loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ScaleArguments:
    loop: Literal["trainer", "accelerate"] = field(
        default="trainer",
        metadata={"help": "'trainer': the HF Trainer. 'accelerate': hf_scale's manual Accelerator loop."},
    )
    hf_scale_config: str | None = field(
        default=None,
        metadata={
            "help": "A DistributedConfig YAML (see `hf-scale generate`). Its strategy, world size, batch and "
            "precision are checked against the launcher and the flags; a conflict is an error."
        },
    )
    warmup_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Fraction of the steps used for linear warmup (the transformers 4 flag; transformers 5 "
            "takes a fraction < 1 in --warmup_steps, which this sets)."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let this run replace files in --output_dir that hf_scale did not write (a model's config.json "
            "and safetensors, tokenizer files, metrics.jsonl) and remove directories named like its temporary ones "
            "(.tmp-checkpoint-*) that it did not create. Without it such a directory is refused. Checkpoints of "
            "other tools are never deleted either way: a save of the same step moves them aside."
        },
    )
    verbose: bool = field(
        default=False,
        metadata={
            "help": "Show the libraries' own notices (DeepSpeed, transformers, datasets) on every process; by "
            "default known noise is filtered and processes other than the first log errors only. Also "
            "HF_SCALE_VERBOSE=1; on the command line or in the environment it also covers what the libraries "
            "print while they load."
        },
    )
