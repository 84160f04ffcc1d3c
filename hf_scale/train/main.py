"""train.py as four stages, read top to bottom in :func:`train`:

- prepare: flags (recipe, command line) checked and reconciled with the launcher, TrainingArguments and the
  run spec (hf_scale.train.setup.run_spec) built once, the process group, the output directory locked;
- build: tokenizer, data, collator, model;
- fit: the HF Trainer or the manual Accelerator loop (hf_scale.train.loops.manual);
- finish: save, prove the save, summary, shut down, push.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser, TrainingArguments, set_seed

from hf_scale import deepspeed_ops, hub, inputs, launch_values, rules
from hf_scale.errors import UserError, exit_with_user_error
from hf_scale.train.checkpoint import final_checkpoint, output_lock, preemption, reshard
from hf_scale.train.checkpoint import layout as checkpoint_layout
from hf_scale.train.checkpoint import store as checkpoint
from hf_scale.train.checkpoint.save import failure_message, save_with_accelerator, verify_saved_model
from hf_scale.train.data import sources
from hf_scale.train.data.chat_template import read_chat_template
from hf_scale.train.data.packing import maybe_pack
from hf_scale.train.data.pipeline import (
    DEFAULT_MAX_SEQ_LENGTH,
    DataArguments,
    check_max_seq_length,
    default_dataloader_workers,
    make_collator,
)
from hf_scale.train.loops import evaluation
from hf_scale.train.loops.metrics import flops_per_token, matmul_parameters, mean_example_length
from hf_scale.train.model import attention
from hf_scale.train.model.liger import check_liger
from hf_scale.train.model.load import (
    check_lora_flags,
    load_model,
    load_pretrained_config,
    load_tokenizer,
    resolve_model_path,
)
from hf_scale.train.setup import distributed, flag_values, guard, loop_flags, reconcile, run_spec
from hf_scale.train.setup.args import ModelArguments, ScaleArguments
from hf_scale.train.setup.help import GroupedHelp
from hf_scale.train.setup.recipe import add_config_flag, expand_recipe
from hf_scale.train.setup.run_spec import RunSpec

DEFAULT_OUTPUT_DIR = "outputs/hf_scale-run"


class _OneLineParser(GroupedHelp, HfArgumentParser):
    """argparse prints usage and exits; hf_scale reports bad flags as one line (exit 2) instead. --help leads
    with hf_scale's own flags (hf_scale.train.setup.help)."""

    def error(self, message):
        raise UserError(message)


def build_parser() -> HfArgumentParser:
    parser = _OneLineParser(
        (ModelArguments, DataArguments, sources.SourceArguments, ScaleArguments, TrainingArguments),
        allow_abbrev=False,  # a typo like --learning_rat must not silently mean --learning_rate
        description="Fine-tune a causal LM with the HF Trainer or hf_scale's Accelerator loop. Every "
        "TrainingArguments flag works with the Trainer (--loop accelerate refuses those it does not apply). "
        "With no model/data flags it fine-tunes the tiny Llama shipped with "
        "hf_scale on its sample dataset (CPU, seconds). Launch unchanged with python, torchrun, "
        "accelerate launch or deepspeed. All flags can come from a recipe file: python train.py recipe.yaml "
        "[flags that override it].",
    )
    parser._negative_number_matcher = inputs.NEGATIVE_NUMBER  # -1e-8 is a value, not a flag
    add_config_flag(parser)
    parser.set_defaults(output_dir=DEFAULT_OUTPUT_DIR, report_to="none", logging_steps=1,
                        dataloader_num_workers=None)
    parser._option_string_actions["--dataloader_num_workers"].help = (
        "Processes that collate micro-batches ahead of the step. Default: 2 per GPU process when the cores "
        "allow, 0 without a GPU."
    )
    # HfArgumentParser types these dict flags as `dict` or `str`: neither parses (or checks) a JSON object.
    for name in ("--liger_kernel_config", "--lr_scheduler_kwargs", "--activation_checkpointing_kwargs"):
        parser._option_string_actions[name].type = _json_object
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


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


def _checked_extras(ns) -> tuple[str | None, hub.HubTarget | None]:
    """The data flags checked, the chat template's text and the Hub target (checked once the DeepSpeed config is
    known): before anything is launched or loaded."""
    sources.data_sources(_dataclass_from(ns, DataArguments), _dataclass_from(ns, sources.SourceArguments),
                         evaluation.requested_by(ns))  # the data flags, before anything is launched
    chat_template = read_chat_template(ns.chat_template_path) if ns.chat_template_path else None
    return chat_template, hub.training_target(ns, ns.output_dir)


def _deepspeed_overrides(deepspeed, ns, argv: list[str]) -> str | None:
    """The DeepSpeed config's optimizer/scheduler blocks replace --optim / --lr_scheduler_type in both loops:
    refuse when such a flag was given explicitly, else return the warning line (None without such blocks)."""
    from hf_scale import deepspeed_overrides

    config = distributed.deepspeed_config_dict(deepspeed)
    found = deepspeed_overrides.find_overrides(config, argv) if config else []
    where = "the DeepSpeed config"
    refusal = deepspeed_overrides.refusal(found, vars(ns), where)
    if refusal:
        raise UserError(refusal)
    return deepspeed_overrides.startup_message(found, vars(ns), where) if found else None


def _dataclass_from(namespace, cls, **own):
    """`cls` from the flags it takes, with `own` values in place of the flags' (the namespace stays as it is)."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{**{k: v for k, v in vars(namespace).items() if k in names}, **own})


# --- the stages of train(): prepare -> build -> fit -> finish ------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """What the launcher asks for, once the flags are reconciled with it (hf_scale.train.setup.reconcile)."""

    request: distributed.LaunchRequest
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
    source_args: sources.SourceArguments
    launch: Launch
    state: Any
    """accelerate's PartialState: the live process group."""
    stop: checkpoint.StopRequest
    resume_dir: Path | None
    chat_template: str | None
    hub_target: hub.HubTarget | None
    recipe_path: str | None


@dataclass(frozen=True)
class Built:
    """What build() loaded: tokenizer, data and model, and what the guard and the metrics need about them."""

    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    data_manifest: Any
    collator: Any
    model: Any
    loaded_partitioned: bool | None
    """ZeRO-3: whether from_pretrained built the model already partitioned (the guard checks it)."""
    flops_per_token: float | None


@dataclass(frozen=True)
class Fitted:
    """What fit() leaves: the wrapped model, its metrics, and how to write the final model."""

    accelerator: Any
    model: Any
    """The prepared (wrapped) model."""
    metrics: Any
    preempted: bool
    save_model: Callable[[str], None]
    final_checkpoint: Callable[[], Path]
    """ZeRO-3 without 16-bit gathering: the checkpoint that is the final model (checkpoint/final_checkpoint.py)."""


def train(argv: list[str] | None = None) -> int:
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecated, once per step and rank: noise, not news.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    run = prepare(argv)
    built = build(run)
    fitted = fit(run, built)
    return finish(run, built, fitted)


def prepare(argv: list[str] | None) -> Run:
    """Flags (recipe, command line) checked and reconciled with the launcher, the run spec built once, a process
    group that really delivers it, the output directory locked and the checkpoint to resume from found."""
    parsed, argv, recipe_path = _parse(argv)
    _validate_flags(parsed)
    chat_template, hub_target = _checked_extras(parsed)
    launch = _reconcile_with_launcher(parsed, argv)
    guard.refuse_before_prepare(launch.request, has_gpu=distributed.has_gpu())  # before accelerate can fail
    ns = launch.flags  # the parsed flags with what the launcher's config (and --hf_scale_config) filled
    if hub_target is not None:  # first whether there will be a model to push, then the token
        final_checkpoint.refuse_push(launch.deepspeed_config, hub_target.repo_id, ns.output_dir)
        hub.check_target(hub_target, "--push_to_hub")
    state = distributed.init_process_state(launch.request, ddp_timeout_s=ns.ddp_timeout, ddp_backend=ns.ddp_backend)
    if launch.overrides_warning and state.is_main_process:
        print(f"hf_scale: warning: {launch.overrides_warning}", file=sys.stderr, flush=True)
    # From here on SIGTERM/SIGUSR1 mean "checkpoint after the current optimizer step and exit 75".
    stop = checkpoint.StopRequest()
    stop.install()
    args = _training_arguments(ns)
    data_args = _dataclass_from(ns, DataArguments)
    spec = run_spec.build(launch.request, args, loop=ns.loop, packing=data_args.packing)
    if state.is_main_process:
        print(f"hf_scale: run: {spec.describe()}", file=sys.stderr, flush=True)
        if spec.final_save_is_checkpoint:
            print(f"hf_scale: {final_checkpoint.startup_notice(args.output_dir)}", file=sys.stderr, flush=True)
    resume_dir = _claim_output_dir(args, spec, state, hub_target)
    return Run(
        spec=spec, args=args, model_args=_dataclass_from(ns, ModelArguments), data_args=data_args,
        source_args=_dataclass_from(ns, sources.SourceArguments), launch=launch, state=state, stop=stop,
        resume_dir=resume_dir, chat_template=chat_template, hub_target=hub_target, recipe_path=recipe_path,
    )


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], str | None]:
    """The flags, the argv that says which were given (the recipe's values count) and the recipe's path."""
    parser = build_parser()
    # A recipe's values become flags before the command line's (which override them), so "given" covers both.
    argv, recipe_path = expand_recipe(parser, sys.argv[1:] if argv is None else list(argv))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (see python train.py --help)")
    if ns.verbose:  # e.g. from a recipe: the entry point (hf_scale.train.entry) saw only the command line
        from hf_scale import quiet

        quiet.undo()
    # One spelling of activation checkpointing from here on.
    return reconcile.filled(ns, reconcile.checkpointing_spelling(ns)), argv, recipe_path


def _reconcile_with_launcher(parsed: argparse.Namespace, argv: list[str]) -> Launch:
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
        from hf_scale.train.setup.inline_deepspeed import apply_to_flags

        from_yaml = apply_to_flags(request.deepspeed_inline, parsed, argv)
        fills.update(from_yaml.fills)
        argv = [*argv, *from_yaml.words]  # what the YAML decided counts as given for --hf_scale_config below
    if parsed.hf_scale_config:
        from_config = reconcile.apply_hf_scale_config(parsed.hf_scale_config, request,
                                                      reconcile.filled(parsed, fills), argv)
        request = from_config.request
        fills.update(from_config.fills)
    elif request.deepspeed_config_file and not parsed.deepspeed:
        # accelerate launch with a DeepSpeed YAML: the Trainer's resolver fills the JSON's "auto" values.
        fills["deepspeed"] = request.deepspeed_config_file
    ns = reconcile.filled(parsed, fills)
    overrides_warning = _deepspeed_overrides(ns.deepspeed, ns, argv)
    # Precision, batch, clipping and optimizer values the launcher's config fixes: followed when no flag says
    # otherwise.
    ds_config = distributed.deepspeed_config_dict(ns.deepspeed)
    given = reconcile.typed_flags(ns, argv)
    fills.update(reconcile.follow_launcher_config(ns, given, request, ds_config,
                                                  num_training_steps=ns.max_steps if ns.max_steps > 0 else None))
    ns = reconcile.filled(parsed, fills)
    if ds_config is not None:  # before DeepSpeed loads any compiled op (on CPU the process group does)
        problems = deepspeed_ops.check_config_ops(ds_config, request.deepspeed_config_file or "--hf_scale_config",
                                                  gpu=distributed.has_gpu())
        if problems:
            raise UserError("; ".join(problems))
    return Launch(request=request, deepspeed_config=ds_config, given=given, flags=ns,
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


def _claim_output_dir(args, spec: RunSpec, state, hub_target) -> Path | None:
    """One run per output_dir, locked before anything in it is touched; the checkpoint to resume from. hf_scale's
    own interrupted saves are removed (nothing else ever is); `auto` takes the newest checkpoint that verifies."""
    output_lock.acquire(args.output_dir, state)
    if state.is_main_process:
        for path in checkpoint.remove_interrupted(args.output_dir):
            print(f"hf_scale: removed interrupted save {path}", file=sys.stderr)
        if hub_target is not None:  # as the Trainer does: a refused token stops the run before training
            hub.create_repo(hub_target, "--push_to_hub")
    state.wait_for_everyone()
    resume_dir = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir, state)
    if resume_dir is not None:  # refuse what cannot resume (another loop, strategy, or world size for the Trainer)
        reshard.check_resumable(resume_dir, loop=spec.loop, world_size=spec.world_size,
                                strategy=spec.strategy, zero_stage=spec.zero_stage)
        if state.is_main_process:
            print(f"hf_scale: resuming from {resume_dir}", file=sys.stderr)
    return resume_dir


def build(run: Run) -> Built:
    """Tokenizer, data (tokenised, mixed, packed once on the main process and cached, then read by the others),
    collator and model."""
    set_seed(run.args.seed)
    model_config, model_args, data_args = _model_and_data_choices(run)
    tokenizer = load_tokenizer(model_args)
    if run.chat_template is not None:
        tokenizer.chat_template = run.chat_template  # before tokenization; saved with the tokenizer
    train_examples, eval_dataset, data_manifest = _datasets(run, data_args, tokenizer)
    with run.state.main_process_first():
        train_dataset = maybe_pack(train_examples, data_args, seed=run.spec.data_seed,
                                   announce=run.state.is_main_process)
    _check_scheduler_length(run, len(train_dataset))
    collator = make_collator(
        tokenizer,
        packing=data_args.packing,
        # torch.compile, and flex_attention (a compiled kernel itself): one row shape, hence one compilation.
        pad_to=data_args.max_seq_length if attention.compiles(model_args.attn_implementation, run.args) else None,
        varlen_kwargs=model_args.attn_implementation in attention.VARLEN_KERNELS,
    )
    model = load_model(model_args, gradient_checkpointing=run.args.gradient_checkpointing)
    return Built(
        tokenizer=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset, data_manifest=data_manifest,
        collator=collator, model=model,
        loaded_partitioned=guard.zero3_weights_partitioned(model) if run.spec.zero_stage == 3 else None,
        flops_per_token=flops_per_token(model_config, matmul_parameters(model), mean_example_length(train_examples)),
    )


def _model_and_data_choices(run: Run):
    """The model's config, and what it decides: the sequence length, the attention kernel (said in one line)."""
    model_args, data_args = run.model_args, run.data_args
    model_config = load_pretrained_config(resolve_model_path(model_args), model_args.trust_remote_code)
    data_args = dataclasses.replace(data_args,
                                    max_seq_length=check_max_seq_length(data_args.max_seq_length, model_config))
    if run.data_args.max_seq_length is None and run.state.is_main_process:
        print(f"hf_scale: --max_seq_length {data_args.max_seq_length} (default: the smaller of "
              f"{DEFAULT_MAX_SEQ_LENGTH} and the model's max_position_embeddings "
              f"{getattr(model_config, 'max_position_embeddings', None)})", file=sys.stderr)
    check_liger(run.args, zero_stage=run.spec.zero_stage)
    model_args = dataclasses.replace(model_args, attn_implementation=attention.resolve(
        model_args.attn_implementation,
        packing=data_args.packing,
        half_precision=run.spec.precision != "no" or rules.is_half_dtype(model_args.torch_dtype),
        announce=run.state.is_main_process,
    ))
    return model_config, model_args, data_args


def _datasets(run: Run, data_args, tokenizer):
    """Training set (one source or a mixture), validation set when evaluation is asked for, and the mixture's
    manifest; built on the main process first (cached), then by the others from the cache."""
    with run.state.main_process_first():
        data = sources.prepare_datasets(
            data_args, run.source_args, tokenizer,
            seed=run.spec.data_seed,
            eval_requested_by=evaluation.requested_by(run.args),
        )
    if run.state.is_main_process:
        sources.announce(data.manifest)
        if data.unused_validation:
            print("hf_scale: note: validation data is loaded but never evaluated; add --eval_strategy steps|epoch "
                  "or --do_eval", file=sys.stderr)
    return data.train, data.validation, data.manifest


def _check_scheduler_length(run: Run, train_rows: int) -> None:
    """A DeepSpeed scheduler's step counts are compared with the run's length, known now (epoch-based runs)."""
    launch = run.launch
    if launch.deepspeed_config is None or "scheduler" not in launch.deepspeed_config or run.args.max_steps > 0:
        return
    steps = launch_values.planned_optimizer_steps(
        train_rows, reconcile.training_values(launch.flags, launch.request.world_size), run.args.num_train_epochs)
    reconcile.follow_launcher_config(launch.flags, launch.given, launch.request, launch.deepspeed_config,
                                     num_training_steps=steps, late=True)


def fit(run: Run, built: Built) -> Fitted:
    """Train with the HF Trainer or hf_scale's manual Accelerator loop (--loop)."""
    if run.spec.loop == "accelerate":
        return _fit_manual_loop(run, built)
    return _fit_trainer(run, built)


def _fit_manual_loop(run: Run, built: Built) -> Fitted:
    from hf_scale.train.loops import manual as loop

    with reconcile.deepspeed_mismatch_as_user_error():
        result = loop.run(
            args=run.args,
            spec=run.spec,
            model=built.model,
            tokenizer=built.tokenizer,
            train_dataset=built.train_dataset,
            collator=built.collator,
            loaded_partitioned=built.loaded_partitioned,
            flops_per_token=built.flops_per_token,
            report_config={"argv": sys.argv[1:]},
            resume_dir=run.resume_dir,
            stop=run.stop,
            eval_dataset=built.eval_dataset,
        )

    def save_model(output_dir: str) -> None:
        save_with_accelerator(result.accelerator, result.model, built.tokenizer, output_dir)

    return Fitted(accelerator=result.accelerator, model=result.model, metrics=result.metrics,
                  preempted=result.preempted, save_model=save_model, final_checkpoint=result.final_checkpoint)


def _fit_trainer(run: Run, built: Built) -> Fitted:
    from hf_scale.train.loops.trainer import CheckpointCallback, GuardAndMetricsCallback, HfScaleTrainer

    trainer = HfScaleTrainer(
        model=built.model,
        args=run.args,
        train_dataset=built.train_dataset,
        eval_dataset=built.eval_dataset,
        data_collator=built.collator,
        processing_class=built.tokenizer,
        spec=run.spec,
    )
    callback = GuardAndMetricsCallback(trainer, run.spec, built.loaded_partitioned, built.flops_per_token)
    trainer.add_callback(callback)
    checkpoints = CheckpointCallback(trainer, run.stop)
    trainer.add_callback(checkpoints)
    with reconcile.deepspeed_mismatch_as_user_error():
        trainer.train(resume_from_checkpoint=str(run.resume_dir) if run.resume_dir else None)
    if not checkpoints.preempted and run.args.do_eval and callback.metrics.last_eval_step != trainer.state.global_step:
        trainer.evaluate()  # at the end (--do_eval, any --eval_strategy), as the manual loop does
    return Fitted(accelerator=trainer.accelerator, model=trainer.model_wrapped, metrics=callback.metrics,
                  preempted=checkpoints.preempted, save_model=trainer.save_model,
                  final_checkpoint=trainer.final_checkpoint)


def finish(run: Run, built: Built, fitted: Fitted) -> int:
    """Save the final model, prove the save (tensor by tensor, exactly, against the trained weights; ZeRO-3 without
    16-bit gathering: the final step's checkpoint, against its manifest), write the summary, shut down, then push.
    A preempted run stops with its checkpoint instead."""
    args, accelerator = run.args, fitted.accelerator
    if fitted.preempted:
        return _stop_preempted(run, fitted)
    summary, report = _save_and_prove(run, fitted)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_summary(run, built, summary, report)
    distributed.shutdown()
    # After the group is gone: an upload of a large model outlasts any collective timeout.
    if run.hub_target is not None and report is not None and report["ok"]:
        hub.push_folder(Path(args.output_dir), run.hub_target, "--push_to_hub",
                        message=f"hf_scale: {summary['steps']} steps, final loss {summary['final_loss']:.4f}",
                        ignore=checkpoint_layout.TRAINING_STATE_GLOBS)
    return 0 if report is None or report["ok"] else 1


def _save_and_prove(run: Run, fitted: Fitted) -> tuple[dict, dict | None]:
    """The final save and its proof (the report on the main process): a safetensors model compared tensor by tensor
    with the trained one, or, under ZeRO-3 without 16-bit gathering, the final step's checkpoint re-read against its
    manifest. The summary is taken after the save, before the proof."""
    args, accelerator = run.args, fitted.accelerator
    if run.spec.final_save_is_checkpoint:
        saved = fitted.final_checkpoint()  # the loops' own writer: errors reported like every checkpoint's
        summary = fitted.metrics.summary()
        fitted.metrics.close()
        return summary, final_checkpoint.verify(saved, accelerator, output_dir=args.output_dir,
                                                precision=run.spec.precision)
    with checkpoint.write_errors_reported("the final model", args.output_dir):
        fitted.save_model(args.output_dir)
    summary = fitted.metrics.summary()  # before the check, which resets the host peak-memory counter to measure itself
    fitted.metrics.close()
    trained = accelerator.unwrap_model(fitted.model, keep_torch_compile=False)
    return summary, verify_saved_model(args.output_dir, trained, is_main_process=accelerator.is_main_process)


def _stop_preempted(run: Run, fitted: Fitted) -> int:
    fitted.metrics.close()
    preemption.mark_preempted()  # the launch script exits 75 on it (launchers turn 75 into 1)
    if fitted.accelerator.is_main_process:
        print(f"hf_scale: stopped by {run.stop.signal_name or 'a signal on another rank'}; checkpoint saved in "
              f"{run.args.output_dir}; run again with --resume_from_checkpoint auto", file=sys.stderr, flush=True)
    distributed.shutdown()
    return checkpoint.EXIT_PREEMPTED


def _write_summary(run: Run, built: Built, summary: dict, report: dict) -> None:
    """train_summary.json and the run's last line (main process)."""
    output_dir = run.args.output_dir
    as_checkpoint = final_checkpoint.is_report(report)
    summary["model_dir"] = None if as_checkpoint else os.path.abspath(output_dir)
    summary["strategy"] = run.spec.strategy
    summary["world_size"] = run.spec.world_size
    summary["saved_model_verified"] = report["ok"]
    if as_checkpoint:
        summary["final_save"] = final_checkpoint.summary_entry(report)
    summary["data"] = built.data_manifest
    if run.recipe_path is not None:
        summary["recipe"] = os.path.abspath(run.recipe_path)
    with open(os.path.join(output_dir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if as_checkpoint:  # the checkpoint, and the command that makes safetensors of it
        saved = final_checkpoint.saved_clause(report)
    else:
        saved = f"model saved to {summary['model_dir']}" + (
            f", verified ({report['tensors_checked']} tensors, {report['seconds']:.1f} s)" if report["ok"]
            else ", but the check FAILED")
    print(
        f"hf_scale: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['tokens_per_sec']:.0f} tokens/s, peak memory {summary['peak_memory_bytes'] / 2**20:.0f} MiB"
        + (f", MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
        + f"; {saved}",
        flush=True,
    )
    if not report["ok"]:
        message = (final_checkpoint.failure_message(report, output_dir) if as_checkpoint
                   else failure_message(report, output_dir))
        print(f"hf_scale: ERROR: {message}", file=sys.stderr, flush=True)


def _close_progress_bars() -> None:
    """A run stopped mid-training (a diverged step, a failed save) leaves its progress bar open; closing it
    puts the error on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> None:
    try:
        code = train(argv)
    except Exception as error:
        reported = error if isinstance(error, UserError) else distributed.lost_peer(error)  # a rank died: one line
        if reported is None:
            raise
        # Tear the group down without a barrier (other ranks may be gone): a live gloo group aborts the
        # interpreter at exit and would turn exit code 2 into SIGABRT.
        distributed.shutdown(barrier=False)
        _close_progress_bars()
        exit_with_user_error("train.py", reported)
    finally:
        output_lock.release()
    sys.exit(code)
