"""The rules of a run, each computed in ONE place and imported wherever it is needed (config, generators,
`hf-scale check`, `plan`, `export`, `doctor`, train.py's reconcile, model loading and guard).

Pure functions and constant tables only: no I/O, and nothing heavier than the standard library is imported,
so that every layer (the CLI's --help included) can use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hf_scale.contract.shared_values import (
    ACCELERATE_YAML_TO_DEEPSPEED,
    TRAINER_FILLED,
    TRAINER_FILLED_ZERO3_ONLY,
)


def given_flags(argv: Sequence[str], names: Iterable[str]) -> frozenset[str]:
    """The field names among ``names`` whose flag was typed in ``argv`` (``--name`` or ``--name=value``), in any
    spelling train.py's HfArgumentParser accepts: ``--name``, the dashed ``--na-me``, and for booleans that default
    to true ``--no_name`` / ``--no-na-me``. train.py's parser takes no abbreviation (``allow_abbrev=False``), so
    neither does this: an abbreviation is refused there, never "given". Computed once per command line (train.py's
    prepare stage, `hf-scale check`'s training args) and handed down as a set; tests/knowledge/test_rules.py proves the
    spellings against every option of train.py's parser."""
    names = list(names)
    spelled = {}
    for name in names:  # --no_NAME first, so that a field really named no_NAME keeps its own flag
        dashed = name.replace("_", "-")
        spelled.update({f"--no_{name}": name, f"--no-{dashed}": name})
    for name in names:
        dashed = name.replace("_", "-")
        spelled.update({f"--{name}": name, f"--{dashed}": name})
    return frozenset(spelled[word] for arg in argv if (word := arg.split("=", 1)[0]) in spelled)


# --------------------------------------------------------------------------------------------------
# Jobs that restart themselves
# --------------------------------------------------------------------------------------------------


def restart_loop_flags(sp: int) -> list[str]:
    """What the generated scripts of a job that restarts itself (the sbatch, the cluster node script) pass before
    the user's flags: the manual loop under sequence parallelism, the only loop that resumes an sp run (the
    Trainer's data skip cannot pass DeepSpeed's Ulysses adapter: hf_scale.train.checkpoint.reshard)."""
    return ["--loop", "accelerate"] if sp > 1 else []


def restart_loop_problem(sp: int, loop: str) -> str | None:
    """Why a job that restarts itself after a preemption (it resumes `auto` on every start) cannot train `loop` at
    this sp: every restart would be refused, until the scheduler gives up. None when it can."""
    if sp > 1 and loop == "trainer":
        return (f"sp={sp} with --loop trainer in a job that restarts itself: the Trainer path does not resume "
                "sequence-parallel runs, so every restart after a preemption would be refused; use --loop accelerate "
                "(it resumes them exactly)")
    return None


# --------------------------------------------------------------------------------------------------
# Batch and precision
# --------------------------------------------------------------------------------------------------

PRECISIONS = ("no", "bf16", "fp16")
BOTH_PRECISIONS = "--bf16 and --fp16 are both set; choose one precision"


STRATEGY_OF_DISTRIBUTED_TYPE = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp", "MULTI_GPU": "ddp", "NO": "single",
                                "MULTI_CPU": "ddp"}
"""An accelerate YAML's distributed_type -> the config's strategy (the ones hf_scale runs)."""


FP8 = "fp8"
FP8_AUTOCAST = "bf16"
"""accelerate trains fp8 on top of bf16 autocast (Accelerator: native_amp for fp8; DeepSpeedPlugin.set_mixed_precision
enables DeepSpeed's bf16 block; FSDP's mixed-precision map sends fp8 to bfloat16): the precision of everything that
is not an fp8 matmul, the flags' --bf16."""
FP8_BACKENDS = {"torchao": "AO", "te": "TE", "msamp": "MSAMP"}
"""The config's `fp8.backend` -> accelerate's FP8BackendType value (the YAML's fp8_config.backend,
ACCELERATE_FP8_BACKEND)."""
FP8_BACKEND_OF_ACCELERATE = {value: name for name, value in FP8_BACKENDS.items()}
"""accelerate's FP8BackendType value -> the config's fp8.backend. Unset (or NO) means torchao: accelerate tries it
first (Accelerator.__init__'s auto-detection), and hf_scale installs it (hf-scale[fp8])."""


def fp8_backend_of_accelerate(value) -> str:
    """The config's fp8.backend for accelerate's spelling (a YAML's fp8_config.backend, ACCELERATE_FP8_BACKEND)."""
    return FP8_BACKEND_OF_ACCELERATE.get(str(value or "").upper(), "torchao")


def fp8_backend_of_yaml(data: dict) -> str:
    """The config's fp8.backend an accelerate YAML asks for (its fp8_config.backend; torchao when unwritten)."""
    fp8_config = data.get("fp8_config")
    return fp8_backend_of_accelerate(fp8_config.get("backend") if isinstance(fp8_config, dict) else None)


FP8_BACKEND_MODULES = {"torchao": "torchao", "te": "transformer_engine", "msamp": "msamp"}
"""The module each FP8 backend imports as (what `doctor` and train.py's refusal look for)."""
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later; torch._scaled_mm refuses anything older."""


def compute_precision(mixed_precision: str) -> str:
    """The 16-bit precision a mixed precision computes in outside fp8 matmuls: fp8 -> bf16, the rest unchanged."""
    return FP8_AUTOCAST if mixed_precision == FP8 else mixed_precision


def global_batch_size(micro_batch_size: int, gradient_accumulation_steps: int, world_size: int) -> int:
    """Samples per optimizer step: micro batch per process x accumulation x processes (DeepSpeed's
    `train_batch_size`, the Trainer's `train_batch_size` computed in HfTrainerDeepSpeedConfig)."""
    return micro_batch_size * gradient_accumulation_steps * world_size


def precision_from_flags(bf16: bool, fp16: bool) -> str:
    """The precision `--bf16` / `--fp16` ask for: bf16 | fp16 | no. Both set is refused (TrainingArguments and
    DeepSpeed refuse it too): ValueError with :data:`BOTH_PRECISIONS`."""
    if bf16 and fp16:
        raise ValueError(BOTH_PRECISIONS)
    return "bf16" if bf16 else "fp16" if fp16 else "no"


# --------------------------------------------------------------------------------------------------
# Dtype spellings
# --------------------------------------------------------------------------------------------------

# One floating-point format has two spellings: the short one of the config's `precision`, accelerate's
# `mixed_precision` and DeepSpeed's JSON blocks (bf16, fp16, fp32), and torch's name, which transformers'
# `dtype` and train.py's `--torch_dtype` use (bfloat16, float16, float32). Every command that names a dtype
# accepts both and maps them with this one table (rules stay torch-free: `getattr(torch, name)` at the edge).
TORCH_DTYPE_OF = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
"""Every accepted dtype spelling -> torch's name of the dtype."""
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *TORCH_DTYPE_OF)
"""What `hf-scale export --dtype` and train.py's `--torch_dtype` take: auto (the checkpoint's own dtype) or
either spelling."""
PRECISION_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}
"""torch's name -> the `precision` (mixed precision) that computes in it; fp32 is precision "no"."""
PRECISION_CHOICES = (*PRECISIONS, *(s for s in TORCH_DTYPE_OF if s not in PRECISIONS))
"""What `hf-scale plan --precision` takes: the config's no | bf16 | fp16, or a dtype in either spelling."""
DEEPSPEED_PRECISION_BLOCKS = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}
"""The DeepSpeed JSON blocks that switch on each precision (deepspeed/runtime/constants.py: BFLOAT16 = "bf16"
and the older BFLOAT16_OLD = "bfloat16", which DeepSpeed still reads)."""


def torch_dtype_name(spelling: str, what: str, allowed: Sequence[str] = DTYPE_CHOICES) -> str:
    """torch's name of the dtype spelled ``spelling`` ("auto" stays "auto"). Anything else is a ValueError, one
    line naming ``what`` (the flag), the value and every allowed spelling."""
    if spelling not in allowed:
        raise ValueError(f"{what} {spelling!r} is invalid: allowed {', '.join(allowed)}")
    return spelling if spelling == AUTO_DTYPE else TORCH_DTYPE_OF[spelling]


def precision_of(spelling: str, what: str) -> str:
    """The `precision` (no | bf16 | fp16) a precision or dtype spelling asks for, e.g. bfloat16 -> bf16."""
    if spelling in PRECISIONS:
        return spelling
    return PRECISION_OF_DTYPE[torch_dtype_name(spelling, what, PRECISION_CHOICES)]


def is_half_dtype(spelling: str) -> bool:
    """Whether a dtype spelling names a 16-bit float (bf16/bfloat16, fp16/float16)."""
    return TORCH_DTYPE_OF.get(spelling) in ("bfloat16", "float16")


# --------------------------------------------------------------------------------------------------
# DeepSpeed keys: which the libraries fill, and the accelerate YAML <-> DeepSpeed JSON map
# --------------------------------------------------------------------------------------------------

# accelerate's DeepSpeedPlugin.__post_init__ map of the YAML's `deepspeed_config` keys to DeepSpeed JSON paths
# (ACCELERATE_YAML_TO_DEEPSPEED, a view of hf_scale.contract.shared_values' one table):
# :func:`deepspeed_config_from_yaml` writes with it, :func:`yaml_key_of` reads it back.
# tests/knowledge/test_library_tables.py proves every pair against accelerate's source.
_DEEPSPEED_TO_ACCELERATE_YAML = {path: key for key, path in ACCELERATE_YAML_TO_DEEPSPEED.items()}
ACCELERATE_DEFAULT_ZERO_STAGE = 2
"""DeepSpeedPlugin's `zero_stage` when the YAML gives none."""


ZERO3_GATHER_SPELLINGS = (
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)
"""DeepSpeedZeroConfig's `gather_16bit_weights_on_model_save`: its alias, its own name and the deprecated fp16 name
(deepspeed/runtime/zero/config.py)."""


def zero3_without_gathering(ds_config: dict[str, Any] | None) -> bool:
    """ZeRO-3 that gathers no 16-bit weights on save: no spelling of the setting is true ("auto", which
    accelerate fills from `zero3_save_16bit_model`, default false, and a missing key mean false, as in
    DeepSpeed). train.py then ends with the final step's checkpoint instead of a safetensors model."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return False
    return not any(zero.get(name) is True for name in ZERO3_GATHER_SPELLINGS)


def deepspeed_config_from_yaml(section: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed settings a YAML's inline `deepspeed_config` section sets, by accelerate's map (without
    accelerate: for a YAML its own code refuses, so that the values can still be judged)."""
    config: dict[str, Any] = {"zero_optimization": {"stage": ACCELERATE_DEFAULT_ZERO_STAGE}}
    for yaml_key, path in ACCELERATE_YAML_TO_DEEPSPEED.items():
        if yaml_key in section:
            node = config
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = section[yaml_key]
    return config


def yaml_key_of(deepspeed_path: str) -> str | None:
    """The YAML `deepspeed_config` key that sets a DeepSpeed JSON path (None when no key does)."""
    return _DEEPSPEED_TO_ACCELERATE_YAML.get(deepspeed_path)


# Which "auto" values each runner fills in. Hand-listed because the libraries fill them inline (no importable
# list); tests/knowledge/test_library_tables.py checks every entry against the libraries' source,
# tests/knowledge/test_rules.py
# that the generated JSON writes "auto" only there.
# Filled by accelerate's DeepSpeedPlugin.__post_init__, for both the Trainer and an Accelerator loop:
PLUGIN_FILLED = frozenset(ACCELERATE_YAML_TO_DEEPSPEED.values())
# transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process / _finalize (with the plugin's
# fills: TRAINER_FILLED, TRAINER_FILLED_ZERO3_ONLY) are views of hf_scale.contract.shared_values' one table.
# accelerate/accelerator.py Accelerator._prepare_deepspeed (batch sizes from the prepared DataLoader, the
# bucket sizes from model.config.hidden_size, optimizer lr/weight_decay from DummyOptim, scheduler values
# from DummyScheduler) and DeepSpeedPlugin.set_mixed_precision (fp16/bf16). Betas, eps and anything else
# left "auto" make _prepare_deepspeed raise "`...` not found in kwargs".
ACCELERATOR_LOOP_FILLED = (
    PLUGIN_FILLED
    | TRAINER_FILLED_ZERO3_ONLY
    | {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.reduce_bucket_size",
        "optimizer.params.lr",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "fp16.enabled",
        "bf16.enabled",
    }
)


def trainer_fills(path: str, zero_stage: int | None) -> bool:
    """Whether the HF Trainer (and train.py) fills an "auto" at this DeepSpeed path."""
    return path in TRAINER_FILLED or (path in TRAINER_FILLED_ZERO3_ONLY and zero_stage == 3)


AUTOTUNING_EXITS = (
    "DeepSpeed's autotuning profiles the first steps and then exits the training with exit code 0 "
    "(DeepSpeedEngine._autotuning_exit): nothing is trained further and nothing is saved"
)
"""Why `autotuning.enabled: true` has no place in a training job (`hf-scale check` and train.py refuse it)."""


def autotuning_enabled(ds_config: dict[str, Any] | None) -> bool:
    autotuning = (ds_config or {}).get("autotuning")
    return isinstance(autotuning, dict) and autotuning.get("enabled") is True


ZERO_SECTION_REFUSED = (
    "accelerate's DeepSpeedPlugin (the HF Trainer's and an Accelerator loop's) refuses the config at start"
)
"""Why a DeepSpeed config without `zero_optimization` cannot run under train.py (`hf-scale check` and train.py
refuse it, with :data:`ZERO_SECTION_FIX`); raw deepspeed.initialize would run it as stage 0."""
ZERO_SECTION_FIX = 'add `"zero_optimization": {"stage": 0}` (or the ZeRO stage you want)'


def zero_section_missing(ds_config: dict[str, Any] | None) -> bool:
    return ds_config is not None and "zero_optimization" not in ds_config


# --------------------------------------------------------------------------------------------------
# Secrets: what is never written into a generated file nor echoed in a message
# --------------------------------------------------------------------------------------------------

_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY",
                   "SECRET_KEY", "AUTH_KEY", "_PAT", "_PASS", "_PWD", "_CREDENTIALS", "_CREDENTIAL")
"""Name endings of credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, GITHUB_PAT, DB_PASSWORD, ...). Hand-
written: no library lists them. The short words (PAT, PASS, PWD) only as a whole last word: COMPAT and the shell's
PWD are not secrets."""
_SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PAT", "APIKEY", "CREDENTIALS"})
_POINTER_WORDS = frozenset({"PATH", "FILE", "DIR", "URL", "ENDPOINT", "HOST", "PORT", "USER", "USERNAME", "NAME",
                            "ID", "TYPE", "PARALLELISM", "LENGTH", "LEN", "LIMIT", "COUNT", "ENABLED", "DISABLED"})
"""A secret word followed by one of these names where the secret lives or a setting about it (HF_TOKEN_PATH,
TOKEN_URL), not the secret; followed by anything else (DB_PASSWORD_PROD, GITHUB_TOKEN_RO) it is the secret."""
SECRET_SWITCH_VALUES = ("", "0", "1", "true", "false", "yes", "no", "on", "off")
"""Values that are switches, not secrets (HF_HUB_DISABLE_IMPLICIT_TOKEN=1)."""
_SECRET_VALUE_PREFIXES = (("hf_", 30), ("ghp_", 30), ("gho_", 30), ("ghu_", 30), ("ghs_", 30), ("ghr_", 30),
                          ("github_pat_", 40), ("glpat-", 20), ("sk-", 32), ("xoxb-", 20), ("xoxp-", 20))
"""Documented prefixes of access tokens (Hugging Face, GitHub, GitLab, OpenAI-style keys, Slack) and the least
length of what follows: a value so spelled is a token whatever it is passed as."""


def is_secret_name(name: str) -> bool:
    """Whether a variable, key or flag named ``name`` (any case, '-' or '_') holds a credential."""
    upper = name.upper().replace("-", "_").strip("_")
    words = upper.split("_")
    if upper.endswith(_SECRET_ENDINGS) or upper in ("PAT", "PASS"):
        return True
    return any(word in _SECRET_WORDS for word in words[:-1]) and words[-1] not in _POINTER_WORDS


def looks_like_token(value: str) -> bool:
    """Whether ``value`` is spelled like an access token (hf_..., ghp_..., github_pat_..., ...)."""
    return any(value.startswith(prefix) and len(value) >= len(prefix) + least
               and all(c.isalnum() or c in "_-" for c in value) for prefix, least in _SECRET_VALUE_PREFIXES)


def is_secret_setting(name: str, value: Any) -> bool:
    """Whether ``name=value`` passes a secret: a credential's name with a value that is not a switch, or a value
    spelled like a token under any name."""
    if isinstance(value, bool):
        return False
    text = str(value)
    return (is_secret_name(name) and text.strip().lower() not in SECRET_SWITCH_VALUES) or looks_like_token(text)


def secret_advice(variable: str) -> str:
    """How to pass the secret ``variable`` to every node instead of writing it into a generated file."""
    return (f"pass {variable} from a Kubernetes secret (kubectl create secret generic ...; env valueFrom."
            f"secretKeyRef in the manifest) or with sky jobs launch --secret {variable}")
