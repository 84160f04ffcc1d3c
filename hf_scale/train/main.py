"""train.py as four stages, read top to bottom in :func:`train`:

- prepare (hf_scale.train.prepare): flags (recipe, command line) checked and reconciled with the launcher,
  TrainingArguments and the run spec (hf_scale.train.setup.run_spec) built once, the process group, the output
  directory locked;
- build: tokenizer, data, collator, model;
- fit: the HF Trainer or the manual Accelerator loop (hf_scale.train.loops.manual);
- finish: save, prove the save, summary, shut down, push.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import set_seed

from hf_scale.contract import checkpoint_layout, launch_values, parallel_refusals
from hf_scale.contract.data_arguments import DEFAULT_MAX_SEQ_LENGTH, check_max_seq_length
from hf_scale.errors import UserError, exit_refusing
from hf_scale.exit_codes import EXIT_PREEMPTED
from hf_scale.files import hub
from hf_scale.knowledge import rules
from hf_scale.train.checkpoint import final_checkpoint, output_lock, preemption, resume, store
from hf_scale.train.checkpoint.save import failure_message, save_with_accelerator, verify_saved_model
from hf_scale.train.data import sources
from hf_scale.train.data.batches import make_collator
from hf_scale.train.data.packing import maybe_pack
from hf_scale.train.loops import evaluation
from hf_scale.train.loops.metrics import flops_per_token, matmul_parameters, mean_example_length
from hf_scale.train.model import attention, context_parallel, parallelize, sequence_parallel
from hf_scale.train.model.liger import check_liger
from hf_scale.train.model.load import (
    load_model,
    load_pretrained_config,
    load_tokenizer,
    resolve_model_path,
)
from hf_scale.train.prepare import Run, prepare
from hf_scale.train.setup import distributed, guard, reconcile
from hf_scale.train.setup.distributed import has_gpu

# --- the stages of train() after prepare(): build -> fit -> finish -------------------------------------------


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
    if built is None:  # resumed at the run's last step: nothing to train (train/checkpoint/resume.py)
        distributed.shutdown()
        return 0
    fitted = fit(run, built)
    return finish(run, built, fitted)


def build(run: Run) -> Built | None:
    """Tokenizer, data (tokenised, mixed, packed once on the main process and cached, then read by the others),
    collator and model; None when the checkpoint resumed from is the run's last step."""
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
    if run.resume_dir and resume.finished(run, len(train_dataset)):
        return None
    collator = make_collator(
        tokenizer,
        packing=data_args.packing,
        # torch.compile, and flex_attention (a compiled kernel itself): one row shape, hence one compilation.
        pad_to=data_args.max_seq_length if attention.compiles(model_args.attn_implementation, run.args) else None,
        varlen_kwargs=model_args.attn_implementation in attention.VARLEN_KERNELS,
    )
    if run.spec.layout.cp > 1:
        collator = context_parallel.collator(collator, run.spec.layout, tokenizer)
    if run.spec.layout.sp > 1:
        collator = sequence_parallel.collator(collator, run.spec.layout, tokenizer,
                                              # The adapter all-gathers each rank's batch; gloo refuses tensors
                                              # of unequal lengths, so on CPU every batch has one length.
                                              pad_to=None if has_gpu() else data_args.max_seq_length)
    sharded = run.spec.precision if run.spec.zero_stage == 3 or run.spec.strategy == "fsdp" else None
    model = load_model(model_args, gradient_checkpointing=run.args.gradient_checkpointing,
                       on_mesh=parallelize.load_kwargs(run.spec.layout, run.spec.fsdp_settings),
                       sharded_precision=sharded)
    if model_args.load_in_4bit and run.state.is_main_process:
        from hf_scale.train.model import quantization

        print(f"hf_scale: {quantization.describe(sharded)}", file=sys.stderr, flush=True)
    if run.spec.fp8_backend and run.state.is_main_process:  # which layers accelerate will convert: said once
        from hf_scale.knowledge import fp8_layers

        line = fp8_layers.describe(fp8_layers.plan(model, run.spec.fp8_backend))
        print(f"hf_scale: {line}", file=sys.stderr, flush=True)
    return Built(
        tokenizer=tokenizer, train_dataset=train_dataset, eval_dataset=eval_dataset, data_manifest=data_manifest,
        collator=collator, model=model,
        # transformers never builds a quantized model inside zero.Init (each process loads the 4-bit base, a
        # quarter of the bf16 size; DeepSpeed partitions it when it wraps the model): nothing for the guard to check.
        loaded_partitioned=(guard.zero3_weights_partitioned(model)
                            if run.spec.zero_stage == 3 and not model_args.load_in_4bit else None),
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
    problem = parallel_refusals.model_problem(run.spec.layout, model_config, "--hf_scale_config: parallelism")
    if problem:  # before the model loads (a local config.json was already asked in prepare)
        raise UserError(problem)
    model_args = dataclasses.replace(model_args, attn_implementation=attention.resolve(
        model_args.attn_implementation,
        packing=data_args.packing,
        half_precision=run.spec.precision != "no" or rules.is_half_dtype(model_args.torch_dtype),
        announce=run.state.is_main_process,
        # Ring attention (cp) and Ulysses (sp) wrap SDPA: `auto` must not pick flash-attention under them.
        required="sdpa" if run.spec.layout.cp > 1 or run.spec.layout.sp > 1 else None,
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
    # The work is saved: a stop request from here on (a preemption racing the end) changes nothing, and one that
    # lands while the interpreter exits must not turn the finished run into a failure (killed by SIGTERM).
    run.stop.settle()
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
    with store.write_errors_reported("the final model", args.output_dir):
        fitted.save_model(args.output_dir)
    summary = fitted.metrics.summary()  # before the check, which resets the host peak-memory counter to measure itself
    fitted.metrics.close()
    trained = accelerator.unwrap_model(fitted.model, keep_torch_compile=False)
    return summary, verify_saved_model(args.output_dir, trained, is_main_process=accelerator.is_main_process)


def _stop_preempted(run: Run, fitted: Fitted) -> int:
    run.stop.settle()
    fitted.metrics.close()
    preemption.mark_preempted()  # the launch script exits 75 on it (launchers turn 75 into 1)
    if fitted.accelerator.is_main_process:
        print(f"hf_scale: stopped by {run.stop.signal_name or 'a signal on another rank'}; checkpoint saved in "
              f"{run.args.output_dir}; run again with --resume_from_checkpoint auto", file=sys.stderr, flush=True)
    distributed.shutdown()
    return EXIT_PREEMPTED


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
        exit_refusing("train.py", reported)
    finally:
        output_lock.release()
    sys.exit(code)
