"""The first stage of train.py (:func:`prepare`): the flags (recipe, command line) checked and reconciled with
the launcher, TrainingArguments and the run spec built once, the process group, the output directory locked and
the checkpoint to resume from found. Nothing is loaded yet; every later stage reads the :class:`Run` it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from hf_scale import quiet
from hf_scale.config import parallelism
from hf_scale.contract import config_flags, flag_values
from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.launch_request import LaunchRequest, refuse_before_prepare
from hf_scale.contract.model_arguments import ModelArguments
from hf_scale.contract.parser import build_parser, parse_flags, resume_default
from hf_scale.errors import UserError, announce_started
from hf_scale.exit_codes import RESUME_DEFAULT_ENV
from hf_scale.files import hub
from hf_scale.knowledge import deepspeed_ops, rules
from hf_scale.train.checkpoint import final_checkpoint, launcher_watch, ownership, store
from hf_scale.train.data import sources
from hf_scale.train.data.batches import default_dataloader_workers
from hf_scale.train.data.chat_template import read_chat_template
from hf_scale.train.loops import evaluation
from hf_scale.train.model.load import check_lora_flags
from hf_scale.train.setup import distributed, loop_flags, reconcile, run_spec
from hf_scale.train.setup.run_spec import RunSpec


def _validate_flags(ns) -> None:
    flag_values.check(ns)
    check_lora_flags(ns)
    if ns.bf16 and ns.fp16:
        raise UserError(rules.BOTH_PRECISIONS)
    if ns.gradient_accumulation_steps < 1:
        raise UserError(f"--gradient_accumulation_steps={ns.gradient_accumulation_steps}: must be >= 1")
    if ns.per_device_train_batch_size < 1:
        raise UserError(f"--per_device_train_batch_size={ns.per_device_train_batch_size}: must be >= 1")
    if ns.max_steps <= 0 and ns.num_train_epochs <= 0:
        raise UserError(f"--num_train_epochs={ns.num_train_epochs}: must be > 0 (or set --max_steps)")
    if ns.warmup_ratio is not None:
        if not 0 <= ns.warmup_ratio < 1:
            raise UserError(f"--warmup_ratio={ns.warmup_ratio}: must be in [0, 1)")
        if ns.warmup_steps:
            raise UserError(
                f"--warmup_ratio={ns.warmup_ratio} and --warmup_steps={ns.warmup_steps}: set only one"
            )
    evaluation.check_flags(ns)
    loop_flags.check(ns, build_parser())  # --loop accelerate: a flag it would ignore is refused


def check_flags_alone(ns) -> None:
    """What train.py refuses from its parsed flags alone, before a process group starts or a file is read: each value
    and combination, and an explicit --resume_from_checkpoint that is no directory. The driver of a run whose
    train.py starts elsewhere (hf_scale.commands.ray_train: a refusal in a worker would be retried by Ray) calls it
    too."""
    _validate_flags(ns)
    store.check_resume_path(ns.resume_from_checkpoint)


def _checked_extras(ns) -> tuple[str | None, hub.HubTarget | None]:
    """The data flags checked, the chat template's text and the Hub target (checked once the DeepSpeed config is
    known): before anything is launched or loaded."""
    sources.data_sources(_dataclass_from(ns, DataArguments), _dataclass_from(ns, SourceArguments),
                         evaluation.requested_by(ns))  # the data flags, before anything is launched
    chat_template = read_chat_template(ns.chat_template_path) if ns.chat_template_path else None
    return chat_template, hub.training_target(ns, ns.output_dir)


def _deepspeed_overrides(deepspeed, ns, given: Set[str]) -> str | None:
    """The DeepSpeed config's optimizer/scheduler blocks replace --optim / --lr_scheduler_type in both loops:
    refuse when such a flag was given explicitly (in ``given``), else return the warning line (None without such
    blocks)."""
    from hf_scale.knowledge import deepspeed_overrides

    config = distributed.deepspeed_config_dict(deepspeed)
    where = "the DeepSpeed config"
    if rules.autotuning_enabled(config):
        raise UserError(f"{where}: autotuning.enabled=true: {rules.AUTOTUNING_EXITS}; set it to false (autotuning "
                        "runs through `deepspeed --autotuning tune`, not in a training job)")
    if rules.zero_section_missing(config):
        named = f"--deepspeed={deepspeed}" if isinstance(deepspeed, str) else where
        raise UserError(f"{named}: no `zero_optimization` section: {rules.ZERO_SECTION_REFUSED}; "
                        f"{rules.ZERO_SECTION_FIX}")
    found = deepspeed_overrides.find_overrides(config, given) if config else []
    refusal = deepspeed_overrides.refusal(found, vars(ns), where)
    if refusal:
        raise UserError(refusal)
    return deepspeed_overrides.startup_message(found, vars(ns), where) if found else None


def _dataclass_from(namespace, cls, **own):
    """`cls` from the flags it takes, with `own` values in place of the flags' (the namespace stays as it is)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{**{k: v for k, v in vars(namespace).items() if k in names}, **own})


@dataclass(frozen=True)
class Launch:
    """What the launcher asks for, once the flags are reconciled with it (hf_scale.train.setup.reconcile)."""

    request: LaunchRequest
    deepspeed_config: dict | None
    """The DeepSpeed config that will run (None without DeepSpeed)."""
    given: set[str]
    """The launch_values flags the user typed (or --hf_scale_config fixed)."""
    flags: argparse.Namespace
    """The flags as reconciled; read only from here on (a late comparison with the DeepSpeed scheduler)."""
    overrides_warning: str | None = None


@dataclass(frozen=True)
class Run:
    """What prepare() decided, before anything is loaded: every later stage reads it and changes none of it."""

    spec: RunSpec
    args: TrainingArguments
    model_args: ModelArguments
    data_args: DataArguments
    source_args: SourceArguments
    launch: Launch
    state: Any
    """accelerate's PartialState: the live process group."""
    stop: store.StopRequest
    resume_dir: Path | None
    chat_template: str | None
    hub_target: hub.HubTarget | None
    recipe_path: str | None


def prepare(argv: list[str] | None) -> Run:
    """Flags (recipe, command line) checked and reconciled with the launcher, the run spec built once, a process
    group that really delivers it, the output directory locked and the checkpoint to resume from found."""
    parsed, given, recipe_path = _parse(argv)
    check_flags_alone(parsed)
    chat_template, hub_target = _checked_extras(parsed)
    launch = _reconcile_with_launcher(parsed, given)
    if parsed.load_in_4bit:  # QLoRA: what it cannot be combined with (on any machine), before the process group
        from hf_scale.contract import qlora_refusals
        from hf_scale.train.model import quantization

        request = launch.request
        problem = (qlora_refusals.refusal(load_in_4bit=True, lora_r=parsed.lora_r, fp8_backend=request.fp8_backend)
                   or qlora_refusals.sharding_refusal(request.fsdp_version, qlora_refusals.installed_versions(),
                                                      from_hf_scale_config=request.fsdp_settings is not None))
        if problem:
            raise UserError(problem)
        quantization.check_installed()
    refuse_before_prepare(launch.request, has_gpu=distributed.has_gpu())  # before accelerate can fail
    if launch.request.fp8_backend is not None:  # before the process group and the model: one line, exit 2
        from hf_scale.train.model import fp8

        fp8.check_can_run(launch.request.fp8_backend)
    ns = launch.flags  # the parsed flags with what the launcher's config (and --hf_scale_config) filled
    if hub_target is not None:  # first whether there will be a model to push, then the token
        final_checkpoint.refuse_push(launch.deepspeed_config, hub_target.repo_id, ns.output_dir)
        hub.check_target(hub_target, "--push_to_hub")
    announce_started()  # the start checks passed: a launch script shows what it held back (hf_scale.exit_codes)
    state = distributed.init_process_state(launch.request, ddp_timeout_s=ns.ddp_timeout, ddp_backend=ns.ddp_backend)
    if launch.overrides_warning and state.is_main_process:
        print(f"hf_scale: warning: {launch.overrides_warning}", file=sys.stderr, flush=True)
    # From here on SIGTERM/SIGUSR1 mean "checkpoint after the current optimizer step and exit 75".
    stop = store.StopRequest()
    stop.install()
    launcher_watch.watch(stop, launch.request.launcher)  # and so does the death of the launcher that started this rank
    args = _training_arguments(ns)
    data_args = _dataclass_from(ns, DataArguments)
    spec = run_spec.build(launch.request, args, loop=ns.loop, packing=data_args.packing, load_in_4bit=ns.load_in_4bit)
    restarts = os.environ.get(RESUME_DEFAULT_ENV)  # a job that restarts itself: it must be able to resume
    if restarts and (problem := rules.restart_loop_problem(spec.layout.sp, spec.loop)):
        raise UserError(problem)
    if state.is_main_process:
        print(f"hf_scale: run: {spec.describe()}", file=sys.stderr, flush=True)
        if spec.final_save_is_checkpoint:
            print(f"hf_scale: {final_checkpoint.startup_notice(args.output_dir)}", file=sys.stderr, flush=True)
    resume_dir = ownership.claim(args, spec, state, hub_target, overwrite=ns.overwrite_output_dir)
    if not (ns.verbose or quiet.verbose_requested()):  # nothing but hf_scale's lines before a refusal in a log
        quiet.progress_bars_on_a_terminal_only()
    return Run(
        spec=spec, args=args, model_args=_dataclass_from(ns, ModelArguments), data_args=data_args,
        source_args=_dataclass_from(ns, SourceArguments), launch=launch, state=state, stop=stop,
        resume_dir=resume_dir, chat_template=chat_template, hub_target=hub_target, recipe_path=recipe_path,
    )


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, frozenset[str], str | None]:
    """The flags, which of them were given (the recipe's count) and the recipe's path. The only reader of the
    command line: from here on "was --x given" is a question to the set, never to the raw argv again."""
    ns, given, recipe_path = parse_flags(sys.argv[1:] if argv is None else argv)
    resume_default(ns, given)
    if ns.verbose:  # e.g. from a recipe: the entry point (hf_scale.commands.train) saw only the command line
        quiet.undo()
    # One spelling of activation checkpointing from here on.
    return config_flags.filled(ns, config_flags.checkpointing_spelling(ns)), given, recipe_path


def _refuse_launched_layout(request: LaunchRequest) -> None:
    """The layout rules (parallelism.layout_problems, as for a config) applied to the sizes `accelerate launch`
    exported from its YAML's parallelism_config, under the engine it launched: e.g. a MULTI_GPU (DDP) YAML with
    dp_shard=4 shards nothing, a DEEPSPEED one with dp_replicate=2 describes replicas DeepSpeed never makes; and its
    sp_attn_implementation, when hf_scale's Ulysses does not run that kernel (parallelism.sp_attn_problem)."""
    if request.layout == parallelism.Layout():
        return
    problem = parallelism.sp_attn_problem(request.layout, request.sp_attn_implementation,
                                          "the accelerate config's parallelism_config")
    if problem:  # never Ulysses on sdpa behind the YAML's back
        raise UserError(problem)
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE") or request.world_size)
    errors, _ = parallelism.layout_problems(request.layout, strategy=request.strategy,
                                            fsdp_version=request.accelerate_fsdp_version,
                                            processes_per_machine=per_machine,
                                            where="the accelerate config's parallelism_config")
    if errors:
        raise UserError(errors[0])


def _reconcile_with_launcher(parsed: argparse.Namespace, given: frozenset[str]) -> Launch:
    """What the launcher asks for; the flags it leaves open filled from its config (and --hf_scale_config), a
    conflict one line now (transformers would raise its traceback after the model loads). ``parsed`` stays as
    it is: each step returns its fills, and the flags of the run (``Launch.flags``) are a new namespace."""
    request = distributed.detect_launch(parsed.deepspeed)
    fills: dict[str, Any] = {}
    if parsed.warmup_ratio is not None:  # transformers 4's flag; transformers 5 takes the fraction in --warmup_steps
        fills["warmup_steps"] = parsed.warmup_ratio
    if request.deepspeed_inline is not None:
        # accelerate launch with the DeepSpeed settings inline in the YAML: accelerate's plugin builds the
        # config a JSON would hold; the YAML's accumulation/clipping/precision fill (or must match) the flags.
        from hf_scale.contract.inline_deepspeed import apply_to_flags

        from_yaml = apply_to_flags(request.deepspeed_inline, parsed, given)
        fills.update(from_yaml.fills)
        given |= from_yaml.decided  # what the YAML decided counts as given for --hf_scale_config below
    if request.layout.model_parallel_size > 1 and not parsed.hf_scale_config:
        _refuse_launched_layout(request)  # what the sizes cannot be under the engine, before what this machine lacks
        request = reconcile.apply_launched_layout(request, config_flags.filled(parsed, fills), os.environ,
                                                  gpu_present=distributed.has_gpu())
    launched = request  # the launcher's own sizes, judged after --hf_scale_config had its say on them
    if parsed.hf_scale_config:
        from_config = reconcile.apply_hf_scale_config(parsed.hf_scale_config, request,
                                                      config_flags.filled(parsed, fills), given)
        request = from_config.request
        fills.update(from_config.fills)
    elif request.deepspeed_config_file and not parsed.deepspeed:
        # accelerate launch with a DeepSpeed YAML: the Trainer's resolver fills the JSON's "auto" values.
        fills["deepspeed"] = request.deepspeed_config_file
    _refuse_launched_layout(launched)
    ns = config_flags.filled(parsed, fills)
    overrides_warning = _deepspeed_overrides(ns.deepspeed, ns, given)
    # Precision, batch, clipping and optimizer values the launcher's config fixes: followed when no flag says
    # otherwise.
    ds_config = distributed.deepspeed_config_dict(ns.deepspeed)
    typed = reconcile.typed_flags(ns, given)
    fills.update(reconcile.follow_launcher_config(ns, typed, request, ds_config,
                                                  num_training_steps=ns.max_steps if ns.max_steps > 0 else None))
    ns = config_flags.filled(parsed, fills)
    if ds_config is not None:  # before DeepSpeed loads any compiled op (on CPU the process group does)
        problems = deepspeed_ops.check_config_ops(ds_config, request.deepspeed_config_file or "--hf_scale_config",
                                                  gpu=distributed.has_gpu())
        if problems:
            raise UserError("; ".join(problems))
    return Launch(request=request, deepspeed_config=ds_config, given=typed, flags=ns,
                  overrides_warning=overrides_warning)


def _training_arguments(ns) -> TrainingArguments:
    """TrainingArguments, built once from the reconciled flags and train.py's own choices below (it validates)."""
    own = {
        # The Trainer reuses the process group of distributed.init_process_state.
        "accelerator_config": {"use_configured_state": True},
        "push_to_hub": False,  # hf_scale pushes once, after the save check, in both loops (not the Trainer)
    }
    if ns.bf16 and not distributed.has_gpu():
        # TrainingArguments allows bf16 without a GPU only so (CPU bf16 autocast; DeepSpeed's bf16).
        own["use_cpu"] = True
    if ns.dataloader_num_workers is None:
        import torch

        own["dataloader_num_workers"] = default_dataloader_workers(
            torch.cuda.is_available(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")), os.cpu_count()
        )
    # Non-reentrant checkpointing (works with LoRA's frozen inputs and ZeRO-3 hooks); the flag was
    # renamed activation_checkpointing_kwargs in transformers 5.
    ckpt_kwargs = (
        "activation_checkpointing_kwargs"
        if hasattr(ns, "activation_checkpointing_kwargs")
        else "gradient_checkpointing_kwargs"
    )
    if getattr(ns, ckpt_kwargs) is None:
        own[ckpt_kwargs] = {"use_reentrant": False}
    try:
        # Creating TrainingArguments with --deepspeed registers the DeepSpeed config globally, so that
        # from_pretrained builds a ZeRO-3 model already partitioned.
        return _dataclass_from(ns, TrainingArguments, **own)
    except (ValueError, TypeError) as error:
        raise UserError(f"training arguments: {' '.join(str(error).split())}") from None

