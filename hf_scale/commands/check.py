"""`hf-scale check`: find the inconsistencies between an accelerate YAML, a DeepSpeed JSON and the training
arguments *before* a job starts.

The command reads existing files (hand-written ones from other projects too), never rewrites them, and reports every
problem it finds as a :class:`Finding`. Each check is one small function in the module of its family (accelerate_yaml,
deepspeed_file, batch, precision, deepspeed_json, trainer_values, topology, zero, parallelism);
:mod:`hf_scale.check.checks` lists them in the order they run, :mod:`hf_scale.check.codes` catalogues the codes they
report. Wherever a library already knows the answer the check asks it (:mod:`hf_scale.knowledge.library_tables`):
accelerate's config loader and ``accelerate launch`` parser, DeepSpeed's config parser, transformers'
``HfArgumentParser``. :mod:`~hf_scale.check.inputs` reads the files (:mod:`~hf_scale.check.kinds` tells an accelerate
YAML, a DeepSpeed JSON and an hf_scale config given as ``hf-scale check FILE...`` apart by their content),
:mod:`~hf_scale.check.report` prints and registers the command. The heavy libraries are imported lazily so that the
other sub-commands of ``hf-scale`` start fast.

Exit codes: 0 clean (warnings alone are printed but do not fail), 1 at least one finding of severity
``error``, 2 unreadable or invalid input (one-line message).
"""

from hf_scale.check.checks import CHECKS, Check, run_checks
from hf_scale.check.codes import CATALOGUE, CODES
from hf_scale.check.findings import ERROR, TRAINING_ARGS, WARNING, Finding, is_comment_key
from hf_scale.check.inputs import RUNNERS, CheckInputs, load_inputs
from hf_scale.check.report import (
    format_findings_table,
    register,
    run_check,
    summarize,
    summary_line,
)
from hf_scale.check.topology import address_problem
from hf_scale.knowledge.library_tables import (
    ACCELERATE_RESOLVED,
    DS_FILE_CONFLICTING_YAML_KEYS,
    OFFLOAD_DEVICES,
    TRAINER_RESOLVED,
    TRAINER_RESOLVED_ZERO3_ONLY,
    YAML_TO_DS_PATH,
    ZERO_STAGES,
    known_section_keys,
)

__all__ = [
    "ACCELERATE_RESOLVED",
    "CATALOGUE",
    "CHECKS",
    "CODES",
    "DS_FILE_CONFLICTING_YAML_KEYS",
    "ERROR",
    "OFFLOAD_DEVICES",
    "RUNNERS",
    "TRAINER_RESOLVED",
    "TRAINER_RESOLVED_ZERO3_ONLY",
    "TRAINING_ARGS",
    "WARNING",
    "YAML_TO_DS_PATH",
    "ZERO_STAGES",
    "Check",
    "CheckInputs",
    "Finding",
    "address_problem",
    "format_findings_table",
    "is_comment_key",
    "known_section_keys",
    "load_inputs",
    "register",
    "run_check",
    "run_checks",
    "summarize",
    "summary_line",
]
