"""train.py, top to bottom: parse → find out what the launcher wants → set up the process group →
data → model → train (Trainer or manual loop) → save → prove the save → shut down."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from pathlib import Path

from transformers import HfArgumentParser, TrainingArguments, set_seed

from hf_scale import deepspeed_ops, hub, launch_values
from hf_scale.errors import UserError, exit_with_user_error
from hf_scale.train import (
    attention,
    checkpoint,
    distributed,
    evaluation,
    guard,
    output_lock,
    preemption,
    reconcile,
    reshard,
    sources,
)
from hf_scale.train.args import ModelArguments, ScaleArguments
from hf_scale.train.chat_template import read_chat_template
from hf_scale.train.data import (
    DEFAULT_MAX_SEQ_LENGTH,
    DataArguments,
    check_max_seq_length,
    default_dataloader_workers,
    make_collator,
)
from hf_scale.train.help import GroupedHelp
from hf_scale.train.liger import check_liger
from hf_scale.train.metrics import flops_per_token, matmul_parameters, mean_example_length
from hf_scale.train.model import (
    check_lora_flags,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)
from hf_scale.train.packing import maybe_pack
from hf_scale.train.recipe import add_config_flag, expand_recipe
from hf_scale.train.save import failure_message, save_with_accelerator, verify_saved_model

DEFAULT_OUTPUT_DIR = "outputs/hf_scale-run"
MAX_LEARNING_RATE = 10.0
"""Above any rate that trains (SGD rarely exceeds 1, Adam 1e-2): a larger one is a typo (1e30 for 1e-3)."""


class _OneLineParser(GroupedHelp, HfArgumentParser):
    """argparse prints usage and exits; hf_scale reports bad flags as one line (exit 2) instead. --help leads
    with hf_scale's own flags (hf_scale.train.help)."""

    def error(self, message):
        raise UserError(message)


def build_parser() -> HfArgumentParser:
    parser = _OneLineParser(
        (ModelArguments, DataArguments, sources.SourceArguments, ScaleArguments, TrainingArguments),
        allow_abbrev=False,  # a typo like --learning_rat must not silently mean --learning_rate
        description="Fine-tune a causal LM with the HF Trainer or hf_scale's Accelerator loop. Every "
        "TrainingArguments flag works. With no model/data flags it fine-tunes the tiny Llama shipped with "
        "hf_scale on its sample dataset (CPU, seconds). Launch unchanged with python, torchrun, "
        "accelerate launch or deepspeed. All flags can come from a recipe file: python train.py recipe.yaml "
        "[flags that override it].",
    )
    add_config_flag(parser)
    parser.set_defaults(output_dir=DEFAULT_OUTPUT_DIR, report_to="none", logging_steps=1,
                        dataloader_num_workers=None)
    parser._option_string_actions["--dataloader_num_workers"].help = (
        "Processes that collate micro-batches ahead of the step. Default: 2 per GPU process when the cores "
        "allow, 0 without a GPU."
    )
    # HfArgumentParser types this dict flag as `dict`, which cannot parse a command-line string.
    parser._option_string_actions["--liger_kernel_config"].type = _json_object
    return parser


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def _validate_numbers(ns) -> None:
    """Every float flag finite; the optimizer's numbers in the ranges where they mean something."""
    for name, value in vars(ns).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{name}={value}: must be a finite number")
    if not 0 <= ns.learning_rate <= MAX_LEARNING_RATE:
        raise UserError(f"--learning_rate={ns.learning_rate}: must be in [0, {MAX_LEARNING_RATE:g}]")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(ns, name) < 1:
            raise UserError(f"--{name}={getattr(ns, name)}: must be in [0, 1)")
    for name in ("weight_decay", "adam_epsilon", "max_grad_norm"):
        if getattr(ns, name) < 0:
            raise UserError(f"--{name}={getattr(ns, name)}: must be >= 0")
    if not 0 <= ns.max_bad_row_fraction <= 1:
        raise UserError(f"--max_bad_row_fraction={ns.max_bad_row_fraction}: must be in [0, 1]")


def _validate_flags(ns) -> None:
    _validate_numbers(ns)
    check_lora_flags(ns)
    if ns.bf16 and ns.fp16:
        raise UserError("--bf16 and --fp16 are both set; choose one precision")
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
        ns.warmup_steps = ns.warmup_ratio
    evaluation.check_flags(ns)


def _checked_extras(ns) -> tuple[str | None, hub.HubTarget | None]:
    """The data flags checked, the chat template's text and the Hub target: before anything is launched or loaded."""
    sources.data_sources(_dataclass_from(ns, DataArguments), _dataclass_from(ns, sources.SourceArguments),
                         evaluation.requested_by(ns))  # the data flags, before anything is launched
    chat_template = read_chat_template(ns.chat_template_path) if ns.chat_template_path else None
    hub_target = hub.training_target(ns, ns.output_dir)
    if hub_target is not None:
        hub.check_target(hub_target, "--push_to_hub")
        ns.push_to_hub = False  # hf_scale pushes once, after the save check, in both loops (not the Trainer)
    return chat_template, hub_target


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


def _dataclass_from(namespace, cls):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def _datasets(args, data_args, source_args, tokenizer, state):
    """Training set (one source or a mixture), validation set when evaluation is asked for, and the mixture's
    manifest; built on the main process first (cached), then by the others from the cache."""
    with state.main_process_first():
        data = sources.prepare_datasets(
            data_args, source_args, tokenizer,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            eval_requested_by=evaluation.requested_by(args),
        )
    if state.is_main_process:
        sources.announce(data.manifest)
        if data.unused_validation:
            print("hf_scale: note: validation data is loaded but never evaluated; add --eval_strategy steps|epoch "
                  "or --do_eval", file=sys.stderr)
    return data.train, data.validation, data.manifest


def train(argv: list[str] | None = None) -> int:
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecated, once per step and rank: noise, not news.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    parser = build_parser()
    # A recipe's values become flags before the command line's (which override them), so "given" covers both.
    argv, recipe_path = expand_recipe(parser, sys.argv[1:] if argv is None else list(argv))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)} (see python train.py --help)")
    if ns.verbose:  # e.g. from a recipe: the entry point (hf_scale.train.entry) saw only the command line
        from hf_scale import quiet

        quiet.undo()
    _validate_flags(ns)
    chat_template, hub_target = _checked_extras(ns)

    # 1. What the launcher asks for, and a process group that really delivers it.
    request = distributed.detect_launch(ns.deepspeed)
    argv = sys.argv[1:] if argv is None else argv
    if request.deepspeed_inline is not None:
        # accelerate launch with the DeepSpeed settings inline in the YAML: accelerate's plugin builds the
        # config a JSON would hold; the YAML's accumulation/clipping/precision fill (or must match) the flags.
        from hf_scale.train.inline_deepspeed import apply_to_flags

        ns.deepspeed, from_yaml = apply_to_flags(request.deepspeed_inline, ns, argv)
        argv = [*argv, *from_yaml]  # what the YAML decided counts as given for --hf_scale_config below
    if ns.hf_scale_config:
        request, ns.deepspeed = reconcile.apply_hf_scale_config(ns.hf_scale_config, request, ns, argv)
    elif request.deepspeed_config_file and not ns.deepspeed:
        # accelerate launch with a DeepSpeed YAML: the Trainer's resolver fills the JSON's "auto" values.
        ns.deepspeed = request.deepspeed_config_file
    overrides_warning = _deepspeed_overrides(ns.deepspeed, ns, argv)
    # Precision, batch, clipping and optimizer values the launcher's config fixes: followed when no flag says
    # otherwise, a conflict is one line now (transformers would raise its traceback after the model loads).
    ds_config = distributed.deepspeed_config_dict(ns.deepspeed)
    given = reconcile.typed_flags(ns, argv)
    reconcile.follow_launcher_config(ns, given, request, ds_config,
                                     num_training_steps=ns.max_steps if ns.max_steps > 0 else None)
    if ns.bf16 and not distributed.has_gpu():
        ns.use_cpu = True  # TrainingArguments allows bf16 without a GPU only so (CPU bf16 autocast; DeepSpeed's bf16)
    if ds_config is not None:  # before DeepSpeed loads any compiled op (on CPU the process group does)
        problems = deepspeed_ops.check_config_ops(ds_config, request.deepspeed_config_file or "--hf_scale_config",
                                                  gpu=distributed.has_gpu())
        if problems:
            raise UserError("; ".join(problems))
    state = distributed.init_process_state(request, ddp_timeout_s=ns.ddp_timeout, ddp_backend=ns.ddp_backend)
    if overrides_warning and state.is_main_process:
        print(f"hf_scale: warning: {overrides_warning}", file=sys.stderr, flush=True)
    # From here on SIGTERM/SIGUSR1 mean "checkpoint after the current optimizer step and exit 75".
    stop = checkpoint.StopRequest()
    stop.install()

    model_args = _dataclass_from(ns, ModelArguments)
    data_args = _dataclass_from(ns, DataArguments)
    source_args = _dataclass_from(ns, sources.SourceArguments)
    scale_args = _dataclass_from(ns, ScaleArguments)
    ns.accelerator_config = {"use_configured_state": True}
    if ns.dataloader_num_workers is None:
        import torch

        ns.dataloader_num_workers = default_dataloader_workers(
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
        setattr(ns, ckpt_kwargs, {"use_reentrant": False})
    try:
        # Creating TrainingArguments with --deepspeed registers the DeepSpeed config globally, so that
        # from_pretrained below builds a ZeRO-3 model already partitioned.
        args = _dataclass_from(ns, TrainingArguments)
    except (ValueError, TypeError) as error:
        raise UserError(f"training arguments: {' '.join(str(error).split())}") from None

    # One run per output_dir, locked before anything in it is touched. hf_scale's own interrupted saves are
    # removed (nothing else ever is); `auto` takes the newest checkpoint that verifies.
    output_lock.acquire(args.output_dir, state)
    if state.is_main_process:
        for path in checkpoint.remove_interrupted(args.output_dir):
            print(f"hf_scale: removed interrupted save {path}", file=sys.stderr)
        if hub_target is not None:  # as the Trainer does: a refused token stops the run before training
            hub.create_repo(hub_target, "--push_to_hub")
    state.wait_for_everyone()
    resume_dir = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir, state)
    if resume_dir is not None:  # refuse what cannot resume (another loop, strategy, or world size for the Trainer)
        reshard.check_resumable(resume_dir, loop=scale_args.loop, world_size=request.world_size,
                                strategy=request.strategy, zero_stage=request.zero_stage)
    if resume_dir is not None and state.is_main_process:
        print(f"hf_scale: resuming from {resume_dir}", file=sys.stderr)

    set_seed(args.seed)
    model_path = resolve_model_path(model_args)
    model_config = load_model_config(model_path, model_args.trust_remote_code)
    seq_len_given = data_args.max_seq_length is not None
    data_args.max_seq_length = check_max_seq_length(data_args.max_seq_length, model_config)
    if not seq_len_given and state.is_main_process:
        print(f"hf_scale: --max_seq_length {data_args.max_seq_length} (default: the smaller of "
              f"{DEFAULT_MAX_SEQ_LENGTH} and the model's max_position_embeddings "
              f"{getattr(model_config, 'max_position_embeddings', None)})", file=sys.stderr)
    check_liger(args, zero_stage=request.zero_stage)
    model_args.attn_implementation = attention.resolve(
        model_args.attn_implementation,
        packing=data_args.packing,
        half_precision=args.bf16 or args.fp16 or model_args.torch_dtype in ("bfloat16", "float16"),
        announce=state.is_main_process,
    )
    tokenizer = load_tokenizer(model_args)
    if chat_template is not None:
        tokenizer.chat_template = chat_template  # before tokenization; saved with the tokenizer

    # 2. Data: tokenised (mixed, packed) once on the main process (cached), then read by the others.
    train_examples, eval_dataset, data_manifest = _datasets(args, data_args, source_args, tokenizer, state)
    with state.main_process_first():
        data_seed = args.data_seed if args.data_seed is not None else args.seed
        train_dataset = maybe_pack(train_examples, data_args, seed=data_seed, announce=state.is_main_process)
    if ds_config is not None and "scheduler" in ds_config and args.max_steps <= 0:
        # A DeepSpeed scheduler's step counts are compared with the run's length, known now.
        steps = launch_values.planned_optimizer_steps(
            len(train_dataset), reconcile.training_values(ns, request.world_size), args.num_train_epochs)
        reconcile.follow_launcher_config(ns, given, request, ds_config, num_training_steps=steps, late=True)
    collator = make_collator(
        tokenizer,
        packing=data_args.packing,
        # torch.compile, and flex_attention (a compiled kernel itself): one row shape, hence one compilation.
        pad_to=data_args.max_seq_length if attention.compiles(model_args.attn_implementation, args) else None,
        varlen_kwargs=model_args.attn_implementation in attention.VARLEN_KERNELS,
    )

    # 3. Model.
    model = load_model(model_args, gradient_checkpointing=args.gradient_checkpointing)
    loaded_partitioned = guard.zero3_weights_partitioned(model) if request.zero_stage == 3 else None
    expected = guard.Expected(
        strategy=request.strategy,
        world_size=request.world_size,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        precision=guard.expected_precision(args.bf16, args.fp16),
        zero_stage=request.zero_stage,
        zero3_init=request.zero_stage == 3
        and bool(getattr(args, "deepspeed_plugin", None))
        and bool(args.deepspeed_plugin.zero3_init_flag),
    )
    fpt = flops_per_token(model_config, matmul_parameters(model), mean_example_length(train_examples))

    # 4. Train.
    if scale_args.loop == "accelerate":
        from hf_scale.train import loop

        with reconcile.deepspeed_mismatch_as_user_error():
            result = loop.run(
                args=args,
                model=model,
                tokenizer=tokenizer,
                train_dataset=train_dataset,
                collator=collator,
                expected=expected,
                loaded_partitioned=loaded_partitioned,
                flops_per_token=fpt,
                report_config={"argv": sys.argv[1:]},
                resume_dir=resume_dir,
                stop=stop,
                fsdp_settings=request.fsdp_settings,
                eval_dataset=eval_dataset,
            )
        accelerator, wrapped, metrics, preempted = result.accelerator, result.model, result.metrics, result.preempted
        if not preempted:
            with checkpoint.write_errors_reported("the final model", args.output_dir):
                save_with_accelerator(accelerator, wrapped, tokenizer, args.output_dir)
    else:
        from hf_scale.train.trainer import CheckpointCallback, GuardAndMetricsCallback, HfScaleTrainer

        trainer = HfScaleTrainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=collator,
            processing_class=tokenizer,
            expected=expected,
        )
        callback = GuardAndMetricsCallback(trainer, expected, loaded_partitioned, fpt)
        trainer.add_callback(callback)
        checkpoints = CheckpointCallback(trainer, stop)
        trainer.add_callback(checkpoints)
        with reconcile.deepspeed_mismatch_as_user_error():
            trainer.train(resume_from_checkpoint=str(resume_dir) if resume_dir else None)
        preempted = checkpoints.preempted
        if not preempted and args.do_eval and callback.metrics.last_eval_step != trainer.state.global_step:
            trainer.evaluate()  # at the end (--do_eval, any --eval_strategy), as the manual loop does
        if not preempted:
            with checkpoint.write_errors_reported("the final model", args.output_dir):
                trainer.save_model(args.output_dir)
        accelerator, wrapped, metrics = trainer.accelerator, trainer.model_wrapped, callback.metrics

    if preempted:
        metrics.close()
        preemption.mark_preempted()  # the launch script exits 75 on it (launchers turn 75 into 1)
        if accelerator.is_main_process:
            print(f"hf_scale: stopped by {stop.signal_name or 'a signal on another rank'}; checkpoint saved in "
                  f"{args.output_dir}; run again with --resume_from_checkpoint auto", file=sys.stderr, flush=True)
        distributed.shutdown()
        return checkpoint.EXIT_PREEMPTED

    # 5. Prove the save: tensor by tensor, exactly, against the trained (gathered) weights.
    summary = metrics.summary()  # before the check, which resets the host peak-memory counter to measure itself
    metrics.close()
    trained = accelerator.unwrap_model(wrapped, keep_torch_compile=False)
    report = verify_saved_model(args.output_dir, trained, is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        summary["model_dir"] = os.path.abspath(args.output_dir)
        summary["strategy"] = request.strategy
        summary["world_size"] = request.world_size
        summary["saved_model_verified"] = report["ok"]
        summary["data"] = data_manifest
        if recipe_path is not None:
            summary["recipe"] = os.path.abspath(recipe_path)
        with open(os.path.join(args.output_dir, "train_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"hf_scale: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
            f"{summary['tokens_per_sec']:.0f} tokens/s, peak memory {summary['peak_memory_bytes'] / 2**20:.0f} MiB"
            + (f", MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
            + f"; model saved to {summary['model_dir']}"
            + (f", verified ({report['tensors_checked']} tensors, {report['seconds']:.1f} s)" if report["ok"]
               else ", but the check FAILED"),
            flush=True,
        )
        if not report["ok"]:
            print(f"hf_scale: ERROR: {failure_message(report, args.output_dir)}", file=sys.stderr, flush=True)
    distributed.shutdown()
    # After the group is gone: an upload of a large model outlasts any collective timeout.
    if hub_target is not None and report is not None and report["ok"]:
        hub.push_folder(Path(args.output_dir), hub_target, "--push_to_hub",
                        message=f"hf_scale: {summary['steps']} steps, final loss {summary['final_loss']:.4f}")
    return 0 if report is None or report["ok"] else 1


def _close_progress_bars() -> None:
    """A run stopped mid-training (a diverged step, a failed save) leaves its progress bar open; closing it
    puts the error on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def main(argv: list[str] | None = None) -> None:
    try:
        code = train(argv)
    except UserError as error:
        # Tear the group down without a barrier (other ranks may be gone): a live gloo group aborts the
        # interpreter at exit and would turn exit code 2 into SIGABRT.
        distributed.shutdown(barrier=False)
        _close_progress_bars()
        exit_with_user_error("train.py", error)
    finally:
        output_lock.release()
    sys.exit(code)
