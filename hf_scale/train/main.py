"""train.py, top to bottom: parse → find out what the launcher wants → set up the process group →
data → model → train (Trainer or manual loop) → save → prove the save → shut down."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

from transformers import HfArgumentParser, TrainingArguments, set_seed

from hf_scale import hub
from hf_scale.errors import UserError, exit_with_user_error
from hf_scale.train import checkpoint, distributed, evaluation, guard, preemption, reshard, sources
from hf_scale.train.args import ModelArguments, ScaleArguments
from hf_scale.train.chat_template import read_chat_template
from hf_scale.train.data import DataArguments, check_max_seq_length, make_collator
from hf_scale.train.help import GroupedHelp
from hf_scale.train.metrics import flops_per_token, matmul_parameters, mean_example_length
from hf_scale.train.model import (
    default_attn_implementation,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)
from hf_scale.train.recipe import add_config_flag, expand_recipe
from hf_scale.train.save import live_logits, save_with_accelerator, verify_saved_model

DEFAULT_OUTPUT_DIR = "outputs/hf_scale-run"
PROBE_TOKENS = 16


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
    parser.set_defaults(output_dir=DEFAULT_OUTPUT_DIR, report_to="none", logging_steps=1)
    return parser


def _validate_flags(ns) -> None:
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
    if ns.learning_rate < 0:
        raise UserError(f"--learning_rate={ns.learning_rate}: must be >= 0")
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
        from hf_scale.train.reconcile import apply_hf_scale_config

        request, ns.deepspeed = apply_hf_scale_config(ns.hf_scale_config, request, ns, argv)
    elif request.deepspeed_config_file and not ns.deepspeed:
        # accelerate launch with a DeepSpeed YAML: the Trainer's resolver fills the JSON's "auto" values.
        ns.deepspeed = request.deepspeed_config_file
    overrides_warning = _deepspeed_overrides(ns.deepspeed, ns, argv)
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

    # Interrupted saves are removed before anything picks a checkpoint; `auto` takes the newest complete one.
    if state.is_main_process:
        for path in checkpoint.remove_incomplete(args.output_dir):
            print(f"hf_scale: removed incomplete checkpoint {path}", file=sys.stderr)
        if hub_target is not None:  # as the Trainer does: a refused token stops the run before training
            hub.create_repo(hub_target, "--push_to_hub")
    state.wait_for_everyone()
    resume_dir = checkpoint.resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume_dir is not None:  # refuse what cannot resume (another loop, strategy, or world size for the Trainer)
        reshard.check_resumable(resume_dir, loop=scale_args.loop, world_size=request.world_size,
                                strategy=request.strategy, zero_stage=request.zero_stage)
    if resume_dir is not None and state.is_main_process:
        print(f"hf_scale: resuming from {resume_dir}", file=sys.stderr)

    set_seed(args.seed)
    model_path = resolve_model_path(model_args)
    model_config = load_model_config(model_path, model_args.trust_remote_code)
    check_max_seq_length(data_args.max_seq_length, model_config)
    tokenizer = load_tokenizer(model_args)
    if chat_template is not None:
        tokenizer.chat_template = chat_template  # before tokenization; saved with the tokenizer

    # 2. Data: tokenised (and mixed) once on the main process (cached), then read by the others.
    train_dataset, eval_dataset, data_manifest = _datasets(args, data_args, source_args, tokenizer, state)
    collator = make_collator(tokenizer, packing=data_args.packing)
    attn = model_args.attn_implementation or default_attn_implementation()
    if data_args.packing and attn != "flash_attention_2" and state.is_main_process:
        # Correct either way (packed examples never attend to each other), but only flash-attention skips the
        # masked-out blocks: sdpa/eager compute attention over the whole packed row.
        print(f"hf_scale: warning: --packing with attn_implementation={attn} masks attention over the whole "
              "packed row (cost grows with the row length squared); install flash-attn for the full speed-up",
              file=sys.stderr)

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
    fpt = flops_per_token(model_config, matmul_parameters(model), mean_example_length(train_dataset))
    is_lora = model_args.lora_r > 0

    # 4. Train.
    if scale_args.loop == "accelerate":
        from hf_scale.train import loop

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
        )
        callback = GuardAndMetricsCallback(trainer, expected, loaded_partitioned, fpt)
        trainer.add_callback(callback)
        checkpoints = CheckpointCallback(trainer, stop, expected)
        trainer.add_callback(checkpoints)
        trainer.train(resume_from_checkpoint=str(resume_dir) if resume_dir else None)
        preempted = checkpoints.preempted
        if not preempted and args.do_eval and callback.metrics.last_eval_step != trainer.state.global_step:
            trainer.evaluate()  # at the end (--do_eval, any --eval_strategy), as the manual loop does
        if not preempted:
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

    # 5. Prove the save: the reloaded directory reproduces the trained model's logits.
    probe = train_dataset[0]["input_ids"][:PROBE_TOKENS]
    import torch

    probe_ids = torch.tensor([probe])
    logits = live_logits(wrapped, probe_ids, accelerator.device)
    report = None
    if accelerator.is_main_process:
        report = verify_saved_model(args.output_dir, probe_ids, logits, is_lora=is_lora)
    summary = metrics.summary()
    metrics.close()
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
            + f"; model saved to {summary['model_dir']}",
            flush=True,
        )
        if not report["ok"]:
            print(
                f"hf_scale: ERROR: the saved model does not reproduce the trained logits "
                f"(max abs diff {report['max_abs_diff']:.3g} > {report['tolerance']})",
                file=sys.stderr,
            )
    distributed.shutdown()
    # After the group is gone: an upload of a large model outlasts any collective timeout.
    if hub_target is not None and report is not None and report["ok"]:
        hub.push_folder(Path(args.output_dir), hub_target, "--push_to_hub",
                        message=f"hf_scale: {summary['steps']} steps, final loss {summary['final_loss']:.4f}")
    return 0 if report is None or report["ok"] else 1


def main(argv: list[str] | None = None) -> None:
    try:
        code = train(argv)
    except UserError as error:
        # Tear the group down without a barrier (other ranks may be gone): a live gloo group aborts the
        # interpreter at exit and would turn exit code 2 into SIGABRT.
        distributed.shutdown(barrier=False)
        exit_with_user_error("train.py", error)
    sys.exit(code)
