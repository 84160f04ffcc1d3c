"""The inputs of `hf-scale check` (:class:`CheckInputs`) and how they are read: the accelerate YAML (with
accelerate's own loader and launch code), the DeepSpeed JSON it names, and the training args after `--`.
The only I/O of the command besides printing.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_scale.check.findings import TRAINING_ARGS, Source, is_int
from hf_scale.check.train_flags import TrainFlags, against_config, parse_train_flags
from hf_scale.errors import UserError
from hf_scale.files.reading import get_path, load_json, load_yaml, read_text
from hf_scale.knowledge import rules

RUNNERS = ("trainer", "accelerate", "deepspeed")
"""What resolves DeepSpeed's "auto" values: the HF Trainer (hf_scale's train.py resolves "auto" with the
Trainer's resolver for both of its loops), a hand-written Accelerator loop, or raw
``deepspeed.initialize`` (resolves nothing)."""


@dataclass(frozen=True)
class CheckInputs:
    """Everything the checks look at, already read and parsed (the checks do no I/O)."""

    runner: str
    accelerate_file: str | None
    """None when no accelerate YAML is checked (a DeepSpeed JSON or an hf_scale config alone)."""
    accelerate: dict[str, Any]
    """The accelerate YAML as a plain mapping (empty without one)."""
    accelerate_loader_error: str | None = None
    """The message of accelerate's own loader when it rejects the YAML."""
    deepspeed_file: str | None = None
    deepspeed: dict[str, Any] | None = None
    """The DeepSpeed JSON that is checked, if any."""
    deepspeed_refs: tuple[tuple[str, str, str], ...] = ()
    """Every place naming a DeepSpeed JSON: (``file:key``, path as written, resolved path)."""
    deepspeed_path_note: str | None = None
    """How the YAML's relative ``deepspeed_config_file`` resolves: ``yaml_dir_only`` / ``cwd_only`` /
    ``layout_only`` / None (see :func:`_resolve_yaml_reference`)."""
    training: dict[str, Any] | None = None
    """Parsed ``TrainingArguments`` fields (defaults included) when training args were given."""
    training_given: frozenset[str] = frozenset()
    """The training flags given, as train.py decides it once: a recipe's and the command line's, and the flags
    ``--hf_scale_config`` filled (they count as typed, as in train.py)."""
    hf_scale_config_file: str | None = None
    """``--hf_scale_config FILE`` of the training args, as written."""
    hf_scale_config: Any = None
    """That file's DistributedConfig, when given."""
    hf_scale_config_contradictions: tuple[str, ...] = ()
    """Where the flags contradict that DistributedConfig: train.py's own one-line messages (it stops on them)."""
    gpus_per_machine: int | None = None
    """``--gpus-per-machine N``: GPUs per machine on the target cluster; None = not assumed (no GPU findings)."""
    launch_env: dict[str, str] | None = None
    """The environment `accelerate launch` would give the training processes for this YAML (computed by
    accelerate's own launch code, nothing started); None when it could not be computed."""
    launch_error: str | None = None
    """Why accelerate's launch code refuses the YAML (a value it cannot use), if it does."""
    inline_deepspeed: dict[str, Any] | None = None
    """For a DeepSpeed YAML without ``deepspeed_config_file``: the DeepSpeed config accelerate's
    DeepSpeedPlugin builds from it, exactly as train.py builds it (hf_scale.contract.inline_deepspeed)."""


def world_size_of(inp: CheckInputs) -> int | None:
    """accelerate's ``num_processes`` is the total over all machines; ``-1`` (its default) means unknown."""
    num = inp.accelerate.get("num_processes")
    if is_int(num) and num > 0:
        return num
    return 1 if inp.accelerate.get("distributed_type") == "NO" else None


def local_model_config(inp: CheckInputs):
    """The training's model config (``--model_name_or_path``, else train.py's embedded demo model) when its
    config.json is on this machine (a Hub id is not fetched), else None; None too when transformers cannot read
    it (train.py says so itself)."""
    if inp.training is None:
        return None
    from transformers import AutoConfig

    from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR

    path = inp.training.get("model_name_or_path") or str(EMBEDDED_MODEL_DIR)
    if not (Path(path) / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None


FSDP_VERSION_KEY = "fsdp_config.fsdp_version"


def fsdp_version_of(inp: CheckInputs) -> int | None:
    """The FSDP version `accelerate launch` runs this YAML with: the FSDP_VERSION its launch code exports, else the
    YAML's ``fsdp_config.fsdp_version``, 1 (accelerate's default) when left out; None when the YAML is not FSDP."""
    if inp.accelerate.get("distributed_type") != "FSDP":
        return None
    written = (inp.launch_env or {}).get("FSDP_VERSION") or get_path(inp.accelerate, FSDP_VERSION_KEY, 1)
    return 2 if str(written) == "2" else 1


def is_deepspeed_yaml(inp: CheckInputs) -> bool:
    return inp.accelerate.get("distributed_type") == "DEEPSPEED"


@dataclass(frozen=True)
class DeepSpeedView:
    """The DeepSpeed settings the job will run with: the JSON when there is one, else what accelerate
    builds from the YAML's ``deepspeed_config`` (DeepSpeedPlugin's no-config-file branch)."""

    config: dict[str, Any]
    file: str
    from_yaml: bool

    def where(self, path: str) -> tuple[str, str]:
        if not self.from_yaml:
            return self.file, path
        yaml_key = rules.yaml_key_of(path)
        return self.file, f"deepspeed_config.{yaml_key}" if yaml_key else "deepspeed_config"


def deepspeed_view(inp: CheckInputs) -> DeepSpeedView | None:
    if inp.deepspeed is not None:
        return DeepSpeedView(inp.deepspeed, inp.deepspeed_file or "", from_yaml=False)
    if not is_deepspeed_yaml(inp):
        return None
    if inp.inline_deepspeed is not None:
        return DeepSpeedView(inp.inline_deepspeed, inp.accelerate_file, from_yaml=True)
    # accelerate's launch code could not read the YAML (reported as such): map its keys by accelerate's table.
    section = inp.accelerate.get("deepspeed_config")
    section = section if isinstance(section, dict) else {}  # not a mapping: `accelerate-value-invalid`
    config = rules.deepspeed_config_from_yaml(section)
    return DeepSpeedView(config, inp.accelerate_file, from_yaml=True)


def training_source(inp: CheckInputs, name: str) -> Source | None:
    if inp.training is None:
        return None
    given = name in inp.training_given
    return Source(TRAINING_ARGS, f"--{name}" + ("" if given else " (default)"), inp.training[name])


def only_a_default_flag_differs(inp: CheckInputs, sources: list[Source], flags: tuple[str, ...]) -> bool:
    """The values written in the DeepSpeed settings (a JSON, or an inline DeepSpeed YAML) agree, and only a
    training flag left at its default differs: train.py then takes the file's value (hf_scale.contract.launch_values,
    hf_scale.contract.inline_deepspeed), a plain HF Trainer script stops."""
    written = [s for s in sources if s.file != TRAINING_ARGS]
    defaults = [s for s in sources if s.file == TRAINING_ARGS]
    return (
        (is_deepspeed_yaml(inp) or inp.deepspeed is not None)
        and bool(written and defaults)
        and len({repr(s.value) for s in written}) == 1
        and not inp.training_given & set(flags)
    )


DEFAULT_FLAG_NOTE = (
    " train.py takes the file's value; a plain HF Trainer script stops at start on this mismatch."
)


_EXPECTED = {"--accelerate-config": "an accelerate config YAML", "DeepSpeed config": "a DeepSpeed JSON config"}


def _read_mapping(path: Path, what: str, parse: Callable[[str, str], Any]) -> dict[str, Any]:
    # Strict reading: no FIFO/directory/non-UTF-8, no duplicate keys, no alias bombs, no NaN in JSON.
    data = parse(read_text(path, what, expected=_EXPECTED.get(what, "")), f"{what} {path}")
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise UserError(f"{what} {path}: expected a mapping of keys at the top level, got {got}")
    return data


@dataclass(frozen=True)
class _TrainingArgs:
    values: dict[str, Any]
    given: frozenset[str]
    hf_scale_config: str | None = None
    contradictions: tuple[str, ...] = ()
    config: Any = None


def _parse_training_args(argv: list[str], cwd: Path, hf_scale_file: str | None = None) -> _TrainingArgs:
    """Parse exactly as train.py does (hf_scale.check.train_flags: train.py's own parser, a recipe expanded before
    the flags, the value ranges it checks first). ``--loop accelerate`` changes nothing here: train.py resolves
    "auto" like the Trainer."""
    try:
        flags = parse_train_flags(argv)
    except UserError as error:
        raise UserError(f"training args: {error} (train.py refuses them the same way)") from None
    namespace, given = flags.namespace, flags.given
    if hf_scale_file is not None:
        if "hf_scale_config" in given:
            raise UserError(f"check: {hf_scale_file} and --hf_scale_config in the training args: give the hf_scale "
                            "config once")
        namespace.hf_scale_config, given = hf_scale_file, given | {"hf_scale_config"}  # as train.py would read it
    if not namespace.hf_scale_config:
        return _TrainingArgs(vars(namespace), given)
    named = "training args: --hf_scale_config" if hf_scale_file is None else "check: hf_scale config"
    written = namespace.hf_scale_config
    path = Path(written).expanduser()
    from hf_scale.config.distributed_config import load_config

    try:
        config = load_config(path if path.is_absolute() else cwd / path)
    except UserError as error:
        raise UserError(f"{named} {written}: {error}") from None
    # --hf_scale_config fills the flags as train.py fills them; the filled flags then count as typed, as in train.py.
    checked = against_config(TrainFlags(namespace, given), config, f"--hf_scale_config={written}")
    return _TrainingArgs(checked.values, checked.given, written, checked.contradictions, config)


GENERATED_YAML_DIR = "accelerate_configs"
"""`hf-scale generate` writes DIR/accelerate_configs/NAME.yaml naming `ds_configs/NAME.json` relative to DIR, and
its launch scripts run `accelerate launch` from DIR."""


def _resolve_yaml_reference(written: str, yaml_dir: Path, cwd: Path) -> tuple[Path, str | None]:
    """The JSON a relative ``deepspeed_config_file`` names, and a note when a launch could miss it.

    accelerate resolves it relative to the directory `accelerate launch` is started from (what it reads from
    here, when it exists here); a hand-written YAML usually means its own directory; hf-scale's layout means
    the directory holding ``accelerate_configs/``, where its launch scripts start. Notes: ``yaml_dir_only``
    (a launch from here fails), ``cwd_only`` (only a launch from here works), ``layout_only`` (the generated
    scripts work, a launch started here does not); None when the launch from here and the intended one agree."""
    path = Path(written).expanduser()
    if path.is_absolute():
        return path, None
    beside_yaml, from_cwd = yaml_dir / path, cwd / path
    layout_root = yaml_dir.parent if yaml_dir.name == GENERATED_YAML_DIR else None
    from_layout = layout_root / path if layout_root is not None else None
    # exists(), not is_file(): a directory or FIFO there is reported as what it is when it is read.
    if from_cwd.exists():
        intended = beside_yaml.exists() or (from_layout is not None and from_layout.resolve() == from_cwd.resolve())
        return from_cwd, None if intended else "cwd_only"
    if from_layout is not None and from_layout.exists():
        return from_layout, "layout_only"
    if beside_yaml.exists():
        return beside_yaml, "yaml_dir_only"
    searched = f"the YAML's directory ({yaml_dir}) nor the current directory ({cwd})"
    if layout_root is not None:
        searched = f"{layout_root} (where generated launch scripts start), " + searched
    raise UserError(f"deepspeed_config.deepspeed_config_file={written!r}: file not found relative to {searched}")


def accelerate_launch_env(yaml_path: Path, raw: dict[str, Any]) -> tuple[dict[str, str] | None, str | None]:
    """The environment `accelerate launch --config_file YAML train.py` gives the training processes,
    computed by accelerate's own launch code up to where it would start them (nothing is started), so that
    values are read exactly as accelerate reads them (it int()s a quoted `machine_rank`, not `num_machines`).
    (None, message) when that code refuses the file; (None, None) when it fails for a reason of the machine
    running the check (a port in use here, no FP8 here), which says nothing about the target."""
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    argv = ["--config_file", str(yaml_path)]
    if raw.get("num_processes") in (None, -1):
        argv += ["--num_processes", "1"]  # a template that leaves it to the launch command (SLURM)
    logger = logging.getLogger("accelerate")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = launch_command_parser().parse_args([*argv, "train.py"])
            args, defaults, mp_from_config = _validate_launch_command(parsed)
            if args.use_deepspeed and not args.cpu:  # accelerate.commands.launch.launch_command's dispatch
                fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]
                args.deepspeed_fields_from_accelerate_config = ",".join(fields)
                return launch_utils.prepare_deepspeed_cmd_env(args)[1], None
            if not args.cpu and (args.use_fsdp or args.use_megatron_lm or args.multi_gpu):
                return launch_utils.prepare_multi_gpu_env(args), None
            if args.tpu or raw.get("compute_environment") == "AMAZON_SAGEMAKER":
                return None, None
            # An MPI YAML (mpirun_config) needs mpirun on the cluster, not here: it changes the command, not the
            # environment, and accelerate looks for mpirun while building the command (docs/check.md: the machine
            # running check is never the cluster).
            args.mpirun_hostfile = None
            return launch_utils.prepare_simple_launcher_cmd_env(args)[1], None
    except (ConnectionError, RuntimeError):  # a port in use here, FP8 not installed here
        return None, None
    except Exception as error:  # noqa: BLE001 -- any refusal of accelerate's code is a finding, never a traceback
        return None, " ".join(f"{type(error).__name__}: {error}".split())
    finally:
        logger.setLevel(level)


def _inline_deepspeed(env: dict[str, str] | None, yaml_file: str) -> dict[str, Any] | None:
    """The DeepSpeed config train.py builds for a YAML with inline `deepspeed_config` (the same function)."""
    from hf_scale.contract import inline_deepspeed

    if env is None or not inline_deepspeed.is_inline(env):
        return None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "zero3_init_flag is only applicable for ZeRO Stage 3"
        try:
            inline = inline_deepspeed.plugin_for(env, yaml_file)
        except UserError:
            return None  # a value accelerate's plugin cannot read: the value checks report it
        return copy.deepcopy(inline_deepspeed.deepspeed_config(inline, inline.mixed_precision))


def _display(path: Path, cwd: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(cwd.resolve()))
    return str(path)


def load_inputs(
    accelerate_config: str | None,
    deepspeed_config: str | None = None,
    training_args: list[str] | tuple[str, ...] = (),
    runner: str = "trainer",
    cwd: Path | None = None,
    gpus_per_machine: int | None = None,
    hf_scale_file: str | None = None,
) -> CheckInputs:
    """Read and parse every input; :class:`UserError` when one is unreadable or invalid. ``hf_scale_file``: an
    hf_scale config given as a file (`hf-scale check my_run.yaml`), read as train.py's --hf_scale_config."""
    if runner not in RUNNERS:
        raise UserError(f"--runner {runner!r} is not one of: {', '.join(RUNNERS)}")
    cwd = cwd or Path.cwd()
    accelerate: dict[str, Any] = {}
    loader_error, launch_env, launch_error = None, None, None
    if accelerate_config is not None:
        yaml_path = Path(accelerate_config)
        accelerate = _read_mapping(yaml_path, "--accelerate-config", load_yaml)
        from accelerate.commands.config.config_args import load_config_from_file

        try:
            load_config_from_file(str(yaml_path))
        except (ValueError, TypeError, KeyError) as error:
            loader_error = " ".join(str(error).split())
        if loader_error is None:
            launch_env, launch_error = accelerate_launch_env(yaml_path, accelerate)

    wanted = training_args or hf_scale_file is not None
    parsed = _parse_training_args(list(training_args), cwd, hf_scale_file) if wanted else None
    training = parsed.values if parsed else None

    refs: list[tuple[str, str, str]] = []  # (file:key, as written, resolved)
    chosen: Path | None = None
    path_note = None
    if deepspeed_config is not None:
        chosen = Path(deepspeed_config)
        refs.append(("--deepspeed-config", deepspeed_config, str(chosen.resolve())))
    written = get_path(accelerate, "deepspeed_config.deepspeed_config_file", None)
    # accelerate opens the file only for distributed_type DEEPSPEED (its launch code reads deepspeed_config then).
    if accelerate_config is not None and isinstance(written, str) and written and accelerate.get(
            "distributed_type") == "DEEPSPEED":
        resolved, path_note = _resolve_yaml_reference(written, Path(accelerate_config).resolve().parent, cwd)
        refs.append(
            (f"{accelerate_config}:deepspeed_config.deepspeed_config_file", written, str(resolved.resolve()))
        )
        chosen = chosen or resolved
    if training and training.get("deepspeed"):
        flag_path = Path(training["deepspeed"])
        if not flag_path.is_absolute():
            flag_path = cwd / flag_path
        refs.append((f"{TRAINING_ARGS}:--deepspeed", training["deepspeed"], str(flag_path.resolve())))
        chosen = chosen or flag_path

    deepspeed = _read_mapping(chosen, "DeepSpeed config", load_json) if chosen is not None else None
    return CheckInputs(
        runner=runner,
        accelerate_file=accelerate_config,
        accelerate=accelerate,
        accelerate_loader_error=loader_error,
        deepspeed_file=_display(chosen, cwd) if chosen is not None else None,
        deepspeed=deepspeed,
        deepspeed_refs=tuple(refs),
        deepspeed_path_note=path_note,
        training=training,
        training_given=parsed.given if parsed else frozenset(),
        hf_scale_config_file=parsed.hf_scale_config if parsed else None,
        hf_scale_config_contradictions=parsed.contradictions if parsed else (),
        hf_scale_config=parsed.config if parsed else None,
        gpus_per_machine=gpus_per_machine,
        launch_env=launch_env,
        launch_error=launch_error,
        inline_deepspeed=_inline_deepspeed(launch_env, accelerate_config or ""),
    )
