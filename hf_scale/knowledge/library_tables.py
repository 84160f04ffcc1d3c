"""What `hf-scale check` knows about accelerate, DeepSpeed and transformers: read from the libraries' own code
where they expose it (accelerate's launch parser, DeepSpeed's pydantic config), hand-kept tables where they fill
values inline (which "auto" values each runner resolves), each proved against the libraries by the tests.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import re
import sys
import typing
from collections.abc import Iterator
from typing import Any

from hf_scale.files.reading import get_path
from hf_scale.knowledge import rules


def auto_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from auto_paths(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix[:-1]


YAML_TO_DS_PATH = rules.ACCELERATE_YAML_TO_DEEPSPEED


# accelerate's DeepSpeedPlugin._deepspeed_config_checks (accelerate/utils/dataclasses.py) raises at launch
# when the YAML sets one of these next to `deepspeed_config_file` (it derives them from a hard-coded list
# of ACCELERATE_* variable names inside the method, so there is nothing to import);
# tests/knowledge/test_library_tables.py proves the list against the real DeepSpeedPlugin.
DS_FILE_CONFLICTING_YAML_KEYS = (*YAML_TO_DS_PATH, "mixed_precision")


@functools.cache
def _launch_option_groups() -> dict[str, frozenset[str]]:
    """`accelerate launch` options by argument group. accelerate copies every key of a YAML section onto the
    launch arguments (``_validate_launch_command``), so the options of the matching group are the keys
    that have an effect; anything else is copied silently and ignored."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    return {group.title: frozenset(a.dest for a in group._group_actions) for group in parser._action_groups}


@functools.cache
def known_section_keys(section: str) -> frozenset[str]:
    """Keys accelerate acts on under the YAML's ``deepspeed_config`` / ``fsdp_config`` / ``parallelism_config``."""
    if section == "deepspeed_config":
        return _launch_option_groups()["DeepSpeed Arguments"]
    if section == "parallelism_config":
        return _launch_option_groups()["ParallelismConfig Arguments"]
    from accelerate.utils.launch import prepare_multi_gpu_env

    # prepare_multi_gpu_env also reads some fsdp_* attributes that have no launch option
    # (e.g. fsdp_ignored_modules): collect every fsdp_* name it mentions.
    read = set(re.findall(r"\b(fsdp_[a-z0-9_]+)", inspect.getsource(prepare_multi_gpu_env)))
    return _launch_option_groups()["FSDP Arguments"] | read


def accelerate_config_fields(raw: dict[str, Any]) -> frozenset[str]:
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    cls = SageMakerConfig if raw.get("compute_environment") == "AMAZON_SAGEMAKER" else ClusterConfig
    # `fp16` and `dynamo_backend` are legacy keys that BaseConfig.process_config converts.
    return frozenset(cls.__dataclass_fields__) | {"fp16", "dynamo_backend"}


# Which "auto" values each runner fills in: hf_scale.knowledge.rules, the one table (also behind the generated JSON's
# "auto").
PLUGIN_RESOLVED = rules.PLUGIN_FILLED
TRAINER_RESOLVED = rules.TRAINER_FILLED
TRAINER_RESOLVED_ZERO3_ONLY = rules.TRAINER_FILLED_ZERO3_ONLY
ACCELERATE_RESOLVED = rules.ACCELERATOR_LOOP_FILLED


def resolvable(runner: str, path: str, ds: dict[str, Any]) -> bool:
    if runner == "trainer":
        return rules.trainer_fills(path, get_path(ds, "zero_optimization.stage"))
    if runner == "accelerate":
        return path in ACCELERATE_RESOLVED
    return False  # raw deepspeed.initialize resolves nothing


@contextlib.contextmanager
def deepspeed_off_stdout() -> Iterator[None]:
    """DeepSpeed's logger writes to the ``sys.stdout`` of the moment it is first imported: import it with
    stdout pointing at stderr so that ``--json`` output stays parseable, and keep its warnings quiet
    while it parses the config."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed.runtime.config  # noqa: F401  (the first import creates the logger)

        ds_logger = logging.getLogger("DeepSpeed")
        level = ds_logger.level
        ds_logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            ds_logger.setLevel(level)


class ReadTracker(dict):
    """A dict that records which keys DeepSpeedConfig reads: a top-level key it never reads has no
    effect. ``__copy__`` returns itself because DeepSpeedConfig copies the dict before reading it."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def __copy__(self) -> ReadTracker:
        return self

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def with_sample_values(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy DeepSpeed's parser accepts: "auto" -> a sample value; batch sizes -> 1 (DeepSpeedConfig checks
    them against a world size of 1 outside a job; the real arithmetic is the `train-batch-mismatch` check);
    bf16 off when fp16 is on too (already the `fp16-and-bf16` finding)."""

    def substitute(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: substitute(v, k) for k, v in node.items()}
        if node == "auto":
            return {"betas": [0.9, 0.999], "enabled": False}.get(key, 1)
        return node

    sample = substitute(copy.deepcopy(ds))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in sample:
            sample[key] = 1
    if get_path(sample, "fp16.enabled") is True and get_path(sample, "bf16.enabled") is True:
        sample["bf16"]["enabled"] = False
    return sample


def pydantic_names(model: Any, loc: tuple[Any, ...]) -> set[str]:
    """Field names and aliases of the (nested) pydantic model at ``loc``, for suggestions."""
    from pydantic import BaseModel

    for part in loc:
        field_info = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if field_info is None:
            return set()
        candidates = [field_info.annotation, *typing.get_args(field_info.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return set()
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


PARSE_ERRORS = (AssertionError, ValueError, TypeError, KeyError, AttributeError)


@functools.cache
def _deepspeed_models() -> dict[str, Any]:
    """DeepSpeed's pydantic config classes by name (a ValidationError names its model in ``title``)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    found, todo = {}, [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


# Sections DeepSpeedConfig's cross-section checks read while judging another one (_do_error_check: fp16/bf16
# master weights need ZeRO stage 1-3, gradient_allreduce_op "sum" refuses ZeRO-3, ZenFlow and DeepCompile).
CONTEXT_SECTIONS = ("zero_optimization", "compile")


def section_errors(
    sample: dict[str, Any], key: str, context: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], Any, str | None]:
    """Parse one top-level section with DeepSpeedConfig, beside the batch keys and the ``context`` sections
    (those of CONTEXT_SECTIONS that parse cleanly themselves) only, so that an invalid key elsewhere cannot hide
    it while the checks that span sections still see what they read: (pydantic error items, the model that
    raised, or another parse error's message)."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    alone = {k: sample[k] for k in BATCH_KEYS if k in sample} or {"train_batch_size": 1}
    alone.update(context or {})
    alone[key] = sample[key]
    try:
        DeepSpeedConfig(alone)
    except pydantic.ValidationError as error:
        return error.errors(), _deepspeed_models().get(error.title), None
    except (DeepSpeedConfigError, *PARSE_ERRORS) as error:
        return [], None, " ".join(str(error).split())
    return [], None, None


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


# Optimizer offload with no DeepSpeed `optimizer` block: accelerate's map_pytorch_optim_to_deepspeed
# (accelerate/utils/deepspeed.py) builds DeepSpeed's CPU optimizer from the client optimizer's param_groups, so
# every group's lr, betas, eps and weight_decay reach DeepSpeedCPUAdam's update. The algorithm is kept for the
# classes it recognizes: torch.optim.AdamW (CPUAdam in AdamW mode), torch Adagrad (DeepSpeedCPUAdagrad), and
# bitsandbytes' 32-bit AdamW and Lion. These --optim values build those classes (transformers'
# _OPTIMIZER_HANDLERS; tests/test_check_zero.py proves the torch ones against both libraries). Every other
# optimizer (SGD, Adafactor, 8-bit AdamW, ...) runs as OFFLOAD_REPLACEMENT instead.
OFFLOAD_KEEPS_OPTIM = ("adamw_torch", "adamw_torch_fused", "adagrad", "paged_adamw_32bit", "lion_32bit",
                       "paged_lion_32bit")
OFFLOAD_REPLACEMENT = ("DeepSpeedCPUAdam in Adam mode (L2 weight decay; the parameter groups' lr and "
                       "weight_decay, and betas/eps where the optimizer has them, carry over)")


ZERO_STAGES = (0, 1, 2, 3)


# --- the accelerate YAML's fp8_config --------------------------------------------------------------------------


def fp8_launch_name(key: str) -> str:
    """The launch argument `accelerate launch` copies an ``fp8_config`` key onto: ``fp8_`` + the key unless it starts
    with ``fp8`` already (commands/launch.py _validate_launch_command); setup_fp8_env (utils/launch.py) then exports
    every ``fp8_*`` argument as ACCELERATE_FP8_*, for the Accelerator and its recipe kwargs to read."""
    return key if key.startswith("fp8") else f"fp8_{key}"


def _fp8_recipes() -> tuple[Any, ...]:
    from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs

    return AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs


@functools.cache
def known_fp8_names() -> frozenset[str]:
    """The launch names of ``fp8_config`` keys that have an effect: the options of accelerate launch's FP8 group, and
    every ACCELERATE_FP8_* variable accelerate's recipe kwargs read (setup_fp8_env exports an ``fp8_*`` argument
    whether or not it is an option, e.g. ``use_mxfp8_block_scaling``). Any other key is exported and never read:
    `accelerate config`'s own ``amax_history_length`` is one (the recipe reads AMAX_HISTORY_LEN)."""
    read = {f"fp8_{name.lower()}" for cls in _fp8_recipes()
            for name in re.findall(r'env_prefix \+ "([A-Z0-9_]+)"', inspect.getsource(cls))}
    return _launch_option_groups()["FP8 Arguments"] | read


def _fp8_field(name: str) -> tuple[Any, Any] | None:
    """(recipe kwargs class, field type) of the recipe field a launch name sets (``fp8_margin`` -> TERecipeKwargs'
    ``margin``, ``fp8_format`` -> its ``fp8_format``), None for a name no field holds."""
    import dataclasses

    for cls in _fp8_recipes():
        types = {field.name: field.type for field in dataclasses.fields(cls)}
        for field_name in (name.removeprefix("fp8_"), name):
            if field_name in types:
                return cls, types[field_name]
    return None


def fp8_value_problem(name: str, value: Any) -> str | None:
    """Why accelerate refuses ``value`` for the ``fp8_config`` key of launch name ``name`` once the processes start
    (None when it takes it), as the end of a sentence. `accelerate launch` exports ``str(value)``; the Accelerator
    reads the backend as its FP8BackendType, and each recipe value in the recipe kwargs' __post_init__: asked here by
    constructing the enum and MSAMPRecipeKwargs themselves. AORecipeKwargs and TERecipeKwargs refuse to construct
    without torchao / TransformerEngine installed, so their values are read as their fields declare them: a Literal's
    values (which TERecipeKwargs compares after upper-/lower-casing), int() for an int, accelerate's str_to_bool (what
    parse_flag_from_env applies) for a bool."""
    from accelerate.utils import MSAMPRecipeKwargs
    from accelerate.utils.dataclasses import FP8BackendType
    from accelerate.utils.environment import str_to_bool

    if value is None:
        return None  # setup_fp8_env exports nothing for it: accelerate's default
    text = str(value)
    if name == "fp8_backend":
        try:
            FP8BackendType(text)
        except ValueError:
            allowed = ", ".join(member.value for member in FP8BackendType)
            return f"is not one of accelerate's FP8BackendType values ({allowed}): the Accelerator raises at start"
        return None
    field = _fp8_field(name)
    if field is None:
        return None
    cls, hint = field
    raises = f"accelerate's {cls.__name__} raises at start"
    if cls is MSAMPRecipeKwargs:
        try:
            MSAMPRecipeKwargs(**{name.removeprefix("fp8_"): text})
        except ValueError as error:
            return f"is refused: {raises} ({error})"
        return None
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    if typing.get_origin(hint) is typing.Literal:
        allowed = typing.get_args(hint)
        if text.lower() in {a.lower() for a in allowed}:
            return None
        return f"must be one of {', '.join(allowed)}: {raises}"
    if typing.get_origin(hint) is tuple:
        ok = isinstance(value, list | tuple) and len(value) == len(args) and all(isinstance(v, bool) for v in value)
        return None if ok else f"must be a list of {len(args)} booleans (fprop, dgrad, wgrad)"
    if args[0] is int:
        try:
            number = int(text)
        except ValueError:
            return f"must be an integer: {raises}"
        minimum = FP8_MINIMUMS.get(name)
        if minimum is not None and number < minimum:
            return f"must be an integer >= {minimum}: {FP8_MINIMUM_WHY[name]}"
        return None
    if args[0] is bool:
        try:
            str_to_bool(text)
        except ValueError:
            return f"must be true or false: {raises}"
    return None


# Ranges accelerate passes on to the backend unchecked.
FP8_MINIMUMS = {"fp8_amax_history_len": 1}
FP8_MINIMUM_WHY = {"fp8_amax_history_len": "TransformerEngine's delayed scaling keeps the last amax_history_len "
                                           "amaxes of each tensor and scales by them; a shorter history holds none"}


# --- the accelerate YAML's parallelism_config ------------------------------------------------------------------


def parallelism_value_problem(key: str, value: Any) -> str | None:
    """Why accelerate refuses a non-size ``parallelism_config_*`` value (None when it takes it, or when no dataclass of
    accelerate holds it), asked by constructing the dataclass that reads it with that value: ParallelismConfig
    (cp_backend, sp_backend), TorchContextParallelConfig (cp_comm_strategy), DeepSpeedSequenceParallelConfig
    (sp_attn_implementation). The Accelerator builds them from what `accelerate launch` exports
    (prepare_extend_env_parallelism_config: the backends always, the cp / sp settings when that size is > 1)."""
    import dataclasses

    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    name = key.removeprefix("parallelism_config_")
    if value is None or name not in PARALLELISM_STRING_SETTINGS:
        return None  # accelerate's default; the sizes have their own check (`parallelism-value-invalid`)
    for cls in (ParallelismConfig, TorchContextParallelConfig, DeepSpeedSequenceParallelConfig):
        if name in {field.name for field in dataclasses.fields(cls)}:
            # a fixed sp sequence length is another setting's question: this one is judged alone
            extra = {"sp_seq_length_is_variable": True} if cls is DeepSpeedSequenceParallelConfig else {}
            try:
                cls(**{name: str(value)}, **extra)
            except ValueError as error:
                return f"is refused by accelerate's {cls.__name__}: {' '.join(str(error).split())}"
    return None


PARALLELISM_STRING_SETTINGS = ("cp_backend", "sp_backend", "cp_comm_strategy", "sp_attn_implementation")
"""The ``parallelism_config`` settings `accelerate launch` exports as text and accelerate's dataclasses read as text
(the sizes are checked as integers; sp_seq_length / sp_seq_length_is_variable are read by their own conversions)."""
