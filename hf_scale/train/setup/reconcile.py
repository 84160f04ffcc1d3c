"""`--hf_scale_config`: a DistributedConfig supplies what the launcher and the flags leave open, and
anything it disagrees with is an error — never a silent override.

- world size: the config's num_machines x processes_per_machine must equal the launcher's WORLD_SIZE;
- strategy: an engine chosen by the launcher (accelerate's YAML, `--deepspeed`) must be the config's;
  under plain `torchrun`/`python` a `deepspeed` config supplies the DeepSpeed JSON itself ("auto" mode,
  resolved by the Trainer's resolver from the flags below);
- ZeRO stage of a launcher-supplied JSON must be the config's;
- micro batch, gradient accumulation, precision, gradient clipping, activation checkpointing and the AdamW
  values (lr, betas, eps, weight decay) fill the flags left unset and must match the flags that were given
  (a recipe's values count as given); the global batch is micro x accumulation x WORLD_SIZE, each checked;
- what train.py cannot deliver is refused: --auto_find_batch_size (it would change the micro batch at run
  time), an --optim that ignores the betas/eps, FSDP's own activation checkpointing and fsdp.version 1 where
  train.py shards with torch's fully_shard (no GPU), FSDP2's hybrid_shard where train.py sets FSDP up itself (no
  accelerate launch: no HSDP mesh).

:func:`follow_launcher_config` does the same for the launcher's own config (accelerate YAML precision,
every value the Trainer compares in the DeepSpeed JSON) with the rule of hf_scale.contract.launch_values.

Pure: every function here reads train.py's parsed flags (an argparse namespace) and returns the values to fill
(flag name -> value); none writes into the namespace it is given. train.py's prepare stage builds the filled
namespace, a new one, from the parsed flags and these fills (hf_scale.train.prepare).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from hf_scale.config import parallelism
from hf_scale.contract import launch_values
from hf_scale.errors import UserError
from hf_scale.knowledge.rules import compute_precision, precision_from_flags
from hf_scale.train.setup.distributed import LaunchRequest, has_gpu

# Flags an --hf_scale_config fixes (apply_hf_scale_config below): the launcher's config must agree with them.
FIXED_BY_HF_SCALE_CONFIG = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "bf16",
                            "fp16", "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay")
"""And activation checkpointing, under the name checkpointing_flag() gives."""


def filled(ns, fills: Mapping[str, Any]) -> argparse.Namespace:
    """A new namespace: the flags of ``ns`` with ``fills`` in place of theirs (``ns`` stays as it is)."""
    return argparse.Namespace(**{**vars(ns), **fills})


@dataclasses.dataclass(frozen=True)
class ConfigFills:
    """What `--hf_scale_config` decides: the (possibly completed) launch request and the flag values to fill
    (`deepspeed` among them where the config supplies or confirms the DeepSpeed config)."""

    request: LaunchRequest
    fills: Mapping[str, Any]

    @property
    def deepspeed(self):
        """The value for `--deepspeed` (what the flags held, if the config leaves it)."""
        return self.fills["deepspeed"]


def apply_hf_scale_config(path: str, request: LaunchRequest, ns, given: Set[str]) -> ConfigFills:
    """The launch request completed by the config and the flag values it fills (``ns`` is only read; ``given``:
    the flags typed)."""
    from hf_scale.config.distributed_config import load_config
    from hf_scale.contract.deepspeed_json import deepspeed_config

    cfg = load_config(path)
    where = f"--hf_scale_config={path}"
    _refuse_layout(cfg.layout, ns, f"{where}: parallelism", gpu_present=has_gpu())
    refusal = launched_layout_mismatch(cfg, request.layout, request.cp_comm_strategy, where)
    if refusal:  # accelerate launch's parallelism_config
        raise UserError(refusal)
    request = dataclasses.replace(request, layout=cfg.layout, cp_comm_strategy=cfg.parallelism.cp_comm_strategy)

    refusal = world_size_mismatch(cfg, request.launcher, request.world_size, where)
    if refusal:
        raise UserError(refusal + (_how_to_launch(cfg, path) if request.launcher == "python" else ""))

    launcher_chose_engine = request.strategy in ("deepspeed", "fsdp")
    wanted = cfg.strategy
    deepspeed_value = ns.deepspeed
    refusal = engine_mismatch(cfg, request.launcher, request.strategy, where)
    if refusal:
        raise UserError(refusal)
    if launcher_chose_engine and wanted == "fsdp" and (cfg.layout.tp > 1 or cfg.layout.ep > 1):
        # accelerate launch's FSDP under TP or EP: transformers shards at load (under TP detect_launch turned
        # accelerate's plugin off; EP is only the config's, so here), with its fsdp settings, as under torchrun.
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        request = dataclasses.replace(request, fsdp_settings=cfg.fsdp.model_dump())
    if not launcher_chose_engine and wanted == "fsdp":
        # With tp > 1 transformers applies FSDP2 itself while it builds the model on the mesh (model/parallelize.py),
        # for the Trainer as for the manual loop; without, only the manual loop shards with torch's fully_shard.
        if ns.loop != "accelerate" and cfg.layout.tp <= 1 and cfg.layout.ep <= 1:
            raise UserError(
                f"{where}: strategy=fsdp under {request.launcher} runs in the manual loop only; add --loop "
                "accelerate, or launch the Trainer with `accelerate launch --config_file accelerate_configs/NAME.yaml`"
            )
        if cfg.layout.dp_replicate > 1 and cfg.layout.dp_shard > 1 and cfg.layout.tp == 1 and cfg.layout.ep == 1:
            # HSDP is a 2-D mesh that accelerate builds from the YAML's parallelism_config (and transformers under
            # TP); neither torch's fully_shard here nor the plugin alone has one: FSDP2 would shard over every rank.
            # Named as the user wrote it: hybrid_shard, or the parallelism sizes alone.
            hsdp = "fsdp.sharding=hybrid_shard" if cfg.fsdp.sharding == "hybrid_shard" else "HSDP"
            raise UserError(f"{where}: {hsdp} (dp_replicate={cfg.layout.dp_replicate} x dp_shard="
                            f"{cfg.layout.dp_shard}) under {request.launcher}: train.py's own FSDP2 setup has no "
                            f"2-D mesh and would shard over all {cfg.world_size} ranks; launch it with "
                            f"launch/{Path(path).stem}.accelerate.sh (its YAML's parallelism_config gives accelerate "
                            "the HSDP mesh)")
        if cfg.fsdp.version == 1 and not has_gpu():
            # No silent FSDP2: the accelerate YAML path runs fsdp_version 1 (on GPUs), so must this one.
            raise UserError(f"{where}: fsdp.version=1: this machine has no GPU, and train.py runs FSDP1 only through "
                            "accelerate's FSDP plugin on GPUs; allowed here: fsdp.version=2 (torch's fully_shard, "
                            "which runs on CPU)")
        request = dataclasses.replace(request, strategy="fsdp", fsdp_settings=cfg.fsdp.model_dump())
    inline = request.deepspeed_inline  # DeepSpeed settings inline in the accelerate YAML (already in ns.deepspeed)
    if wanted == "deepspeed":
        source = request.deepspeed_config_file or "the accelerate config's deepspeed_config"
        if request.deepspeed_config_file is None and inline is None:
            deepspeed_value = deepspeed_config(cfg, "auto")
            request = dataclasses.replace(request, strategy="deepspeed", zero_stage=cfg.deepspeed.zero_stage)
        else:
            refusal = (zero_stage_mismatch(cfg, request.zero_stage, source, where)
                       or precision_mismatch(cfg, inline.mixed_precision if inline else None, where))
            if refusal:
                raise UserError(refusal)
            deepspeed_value = request.deepspeed_config_file or ns.deepspeed

    if cfg.precision == "fp8":
        if request.fp8_backend not in (None, cfg.fp8.backend):
            raise UserError(f"{where}: fp8.backend={cfg.fp8.backend} but the accelerate config's fp8_config asks for "
                            f"{request.fp8_backend}")
        request = dataclasses.replace(request, fp8_backend=cfg.fp8.backend)
    flags = fill_flags_from_config(cfg, ns, given, where)
    if flags.contradictions:
        raise UserError("; ".join(flags.contradictions))
    _launch_agrees(cfg, request, where)
    return ConfigFills(request, {**flags.fills, "deepspeed": deepspeed_value})


def _refuse_layout(layout: parallelism.Layout, ns, where: str, *, gpu_present: bool) -> None:
    """What the flags and the model cannot run with the layout first (on any machine), then what this machine cannot
    run (its versions; cp without a GPU)."""
    from hf_scale.train.model import parallelize

    refusal = parallelize.flag_refusal(layout, packing=ns.packing, attn_implementation=ns.attn_implementation,
                                    lora_r=ns.lora_r, where=where)
    if refusal:
        raise UserError(refusal)
    _refuse_layout_for_local_model(layout, ns, where)
    refusal = parallelism.train_refusal(layout, where, gpu_present=gpu_present)
    if refusal:
        raise UserError(refusal)


LAUNCHED_LAYOUT = "the accelerate config's parallelism_config"


def apply_launched_layout(request: LaunchRequest, ns, environ: Mapping[str, str], *,
                          gpu_present: bool) -> LaunchRequest:
    """`accelerate launch` with a TP/CP/SP parallelism_config and no --hf_scale_config (a peer project's YAML, e.g.
    TRL's context_parallel_2gpu.yaml): the YAML says all train.py takes from a config for the layout. The sizes,
    cp_comm_strategy (already in ``request``) and, for FSDP under TP, the plugin settings accelerate exported from
    its fsdp_config (contract.accelerate_fsdp.fsdp_settings_from_launch: the generator's own table, read back) are
    judged by the rules --hf_scale_config's layout is, and complete the request as it would."""
    _refuse_layout(request.layout, ns, LAUNCHED_LAYOUT, gpu_present=gpu_present)
    if request.strategy == "fsdp" and request.layout.tp > 1:
        # As apply_hf_scale_config: transformers shards the model at load (detect_launch turned accelerate's plugin
        # off), with the YAML's fsdp settings.
        from hf_scale.contract.accelerate_fsdp import fsdp_settings_from_launch

        request = dataclasses.replace(request, fsdp_settings=fsdp_settings_from_launch(dict(environ)).model_dump())
    default_comm = parallelism.ParallelismSettings.model_fields["cp_comm_strategy"].default
    return dataclasses.replace(request, cp_comm_strategy=request.cp_comm_strategy or default_comm)


def _refuse_layout_for_local_model(layout, ns, where: str) -> None:
    """Heads tp/sp cannot split, attention cp cannot compute: asked here, before the process group, when the model's
    config.json is on this machine (a Hub model's is asked once build() has read it)."""
    from hf_scale.train.model import parallelize
    from hf_scale.train.model.load import load_pretrained_config, resolve_model_path

    if layout.model_parallel_size == 1 and layout.ep == 1:
        return
    path = resolve_model_path(ns)
    if not (Path(path) / "config.json").is_file():
        return
    problem = parallelize.model_problem(layout, load_pretrained_config(path, ns.trust_remote_code), where)
    if problem:
        raise UserError(problem)


def _how_to_launch(cfg, path: str) -> str:
    """For `python train.py` (one process, no launcher): the generated scripts that start the config's processes."""
    from hf_scale.contract.launch_values import launchers

    name = Path(path).stem
    scripts = " or ".join(f"launch/{name}.{launcher}.sh" for launcher in launchers(cfg.strategy))
    machines = cfg.topology.num_machines
    return (f"; plain python starts one process: start its {cfg.world_size} processes with {scripts}"
            + (f" on each of the {machines} machines" if machines > 1 else "")
            + f" (written by `hf-scale generate` with hf_scale_configs/{name}.yaml)")


def checkpointing_flag(ns) -> str:
    """The flag that turns activation checkpointing on: transformers 5 renamed --gradient_checkpointing to
    --activation_checkpointing (older transformers have only the old name)."""
    return "activation_checkpointing" if hasattr(ns, "activation_checkpointing") else "gradient_checkpointing"


def checkpointing_spelling(ns) -> dict[str, Any]:
    """The fills that move activation checkpointing to one spelling. transformers 5 keeps
    --gradient_checkpointing as an alias that warns (FutureWarning) whenever it is set; its value moves to the
    new name, so that the one TrainingArguments train.py builds warns about nothing. Idempotent."""
    if checkpointing_flag(ns) == "gradient_checkpointing":
        return {}
    fills: dict[str, Any] = {}
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(ns, new, None) is None and getattr(ns, old, None) is not None:
            fills[new] = getattr(ns, old)
        if hasattr(ns, old):
            fills[old] = None
    return fills


@dataclasses.dataclass(frozen=True)
class FlagFills:
    """The flag values a DistributedConfig fills, and its contradictions with typed flags (one sentence each; a
    contradicting flag keeps its typed value, every other value is filled)."""

    fills: Mapping[str, Any]
    contradictions: tuple[str, ...]


def launched_layout_mismatch(cfg, launched: parallelism.Layout, cp_comm_strategy: str | None, where: str) -> str | None:
    """Where the accelerate config's parallelism_config (its sizes ``launched``, its ``cp_comm_strategy``) disagrees
    with the config's parallelism, or None. Pure: train.py refuses it at start (apply_hf_scale_config), `hf-scale
    check` says it from the two files (hf_scale.check.trainer_values)."""
    if launched.active and launched.sizes() != cfg.layout.sizes():  # ep is the config's alone (no accelerate key)
        return (f"{where}: parallelism {cfg.layout.describe()} but the accelerate config's parallelism_config has "
                f"{launched.describe()}")
    comm = cfg.parallelism.cp_comm_strategy
    if cfg.layout.cp > 1 and cp_comm_strategy not in (None, comm):
        return (f"{where}: parallelism.cp_comm_strategy={comm} but the accelerate config's parallelism_config has "
                f"cp_comm_strategy {cp_comm_strategy}")
    return None


def fill_flags_from_config(cfg, ns, given: Set[str], where: str) -> FlagFills:
    """The config's batch, clipping, activation checkpointing, optimizer values and precision as flag values
    (``ns``, train.py's parsed flags, only read; ``given``: the flags typed). Pure: no launcher, no environment,
    so that `hf-scale check` applies the same rule."""
    batch, opt = cfg.batch, cfg.optimizer
    fills = checkpointing_spelling(ns)
    ns = filled(ns, fills)  # a view with one spelling of activation checkpointing
    contradictions: list[str] = []
    for flag, field, value in (
        ("per_device_train_batch_size", "batch.micro_batch_size", batch.micro_batch_size),
        ("gradient_accumulation_steps", "batch.gradient_accumulation_steps", batch.gradient_accumulation_steps),
        ("max_grad_norm", "gradient_clipping", cfg.gradient_clipping or 0.0),
        ("learning_rate", "optimizer.lr", opt.lr),
        ("adam_beta1", "optimizer.betas[0]", opt.betas[0]),
        ("adam_beta2", "optimizer.betas[1]", opt.betas[1]),
        ("adam_epsilon", "optimizer.eps", opt.eps),
        ("weight_decay", "optimizer.weight_decay", opt.weight_decay),
    ):
        contradictions += _fill_or_match(ns, given, where, flag, field, value, fills)
    if "deepspeed" in given and ns.deepspeed and cfg.strategy != "deepspeed":
        contradictions.append(f"{where}: strategy={cfg.strategy} but --deepspeed={ns.deepspeed} asks for DeepSpeed; "
                              "drop --deepspeed, or set strategy: deepspeed (the config then writes the DeepSpeed "
                              "JSON)")
    if ns.auto_find_batch_size:
        contradictions.append(f"{where}: --auto_find_batch_size would change batch.micro_batch_size="
                              f"{batch.micro_batch_size} (global batch {batch.global_batch_size}) at run time; drop it")
    optim = str(getattr(ns.optim, "value", ns.optim))
    if "optim" in given and "adam" not in optim:
        contradictions.append(f"{where}: optimizer.betas and optimizer.eps are AdamW's, but --optim={optim} does not "
                              "use them; use an AdamW --optim (adamw_torch, adamw_torch_fused, adamw_8bit, ...) or "
                              "leave it out")
    # activation_checkpointing -> the Trainer's flag (the model's own checkpointing, in both loops); either
    # spelling counts as typed.
    flag = checkpointing_flag(ns)
    typed = bool(given & {"gradient_checkpointing", "activation_checkpointing"})
    if cfg.strategy == "fsdp" and cfg.fsdp.activation_checkpointing and typed and getattr(ns, flag):
        contradictions.append(f"{where}: fsdp.activation_checkpointing=true checkpoints the decoder layers already; "
                              "drop --gradient_checkpointing / --activation_checkpointing (the layers would be "
                              "checkpointed twice)")
    elif typed and bool(getattr(ns, flag)) != cfg.activation_checkpointing:
        spelling = "gradient_checkpointing" if "gradient_checkpointing" in given else flag
        contradictions.append(f"{where}: activation_checkpointing={_show(cfg.activation_checkpointing)} but "
                              f"--{spelling}={_show(bool(getattr(ns, flag)))}")
    else:
        fills[flag] = cfg.activation_checkpointing
    flags_precision = precision_from_flags(ns.bf16, ns.fp16)
    computes_in = compute_precision(cfg.precision)  # fp8 runs with --bf16 (bf16 outside the fp8 matmuls)
    if given & {"bf16", "fp16"} and flags_precision != computes_in:
        contradictions.append(f"{where}: precision={cfg.precision} but the flags ask for {flags_precision}")
    else:
        fills.update(bf16=computes_in == "bf16", fp16=computes_in == "fp16")
    return FlagFills(fills, tuple(contradictions))


def _launch_agrees(cfg, request: LaunchRequest, where: str) -> None:
    """FSDP's fsdp.activation_checkpointing is applied by accelerate's FSDP plugin, which must then say the same;
    the accelerate config's mixed_precision must be the config's precision."""
    if cfg.strategy == "fsdp":
        if request.launcher == "accelerate" and request.fsdp_settings is None:
            refusal = fsdp_checkpointing_mismatch(cfg, os.environ.get("FSDP_ACTIVATION_CHECKPOINTING"), where)
            if refusal:
                raise UserError(refusal)
        elif cfg.fsdp.activation_checkpointing and not has_gpu():
            raise UserError(f"{where}: fsdp.activation_checkpointing=true: without a GPU train.py shards with torch's "
                            "fully_shard, which does not apply it; use activation_checkpointing: true instead (the "
                            "same decoder layers are recomputed)")
    refusal = precision_mismatch(cfg, request.mixed_precision, where) if request.strategy != "deepspeed" else None
    if refusal:
        raise UserError(refusal)


# The rules of the launch against the config, each pure (the message or None; ``where``: "--hf_scale_config=FILE"):
# train.py refuses on them at start (above), `hf-scale check` says them from the files (hf_scale.check.trainer_values).

def world_size_mismatch(cfg, launcher: str, world_size: int, where: str) -> str | None:
    if cfg.world_size == world_size:
        return None
    return (f"{where}: world_size={cfg.world_size} ({cfg.topology.num_machines} machines x "
            f"{cfg.topology.processes_per_machine} processes_per_machine) but the {launcher} launcher started "
            f"WORLD_SIZE={world_size}")


def engine_mismatch(cfg, launcher: str, launched_strategy: str, where: str) -> str | None:
    """An engine the launcher chose (DeepSpeed, FSDP) that is not the config's strategy."""
    if launched_strategy in ("deepspeed", "fsdp") and launched_strategy != cfg.strategy:
        return f"{where}: strategy={cfg.strategy} but the {launcher} launch configures {launched_strategy}"
    return None


def zero_stage_mismatch(cfg, zero_stage: int | None, source: str, where: str) -> str | None:
    """``source``: the launcher's DeepSpeed JSON, or the accelerate config's inline deepspeed_config."""
    if zero_stage == cfg.deepspeed.zero_stage:
        return None
    return (f"{where}: deepspeed.zero_stage={cfg.deepspeed.zero_stage} but {source} has "
            f"zero_optimization.stage={zero_stage}")


def precision_mismatch(cfg, mixed_precision: str | None, where: str) -> str | None:
    """The accelerate config's mixed_precision (None: not launched by accelerate) against the config's precision."""
    if mixed_precision in (None, cfg.precision):
        return None
    return f"{where}: precision={cfg.precision} but the accelerate config has mixed_precision={mixed_precision}"


def fsdp_checkpointing_mismatch(cfg, launched: str | None, where: str) -> str | None:
    """accelerate's FSDP plugin applies fsdp.activation_checkpointing: the FSDP_ACTIVATION_CHECKPOINTING accelerate
    launch exports from the YAML (None: left out) must say the same."""
    yaml_value = str(launched or "false").lower() == "true"
    if yaml_value == cfg.fsdp.activation_checkpointing:
        return None
    return (f"{where}: fsdp.activation_checkpointing={_show(cfg.fsdp.activation_checkpointing)} but the accelerate "
            f"config has fsdp_activation_checkpointing={_show(yaml_value)}")


def _fill_or_match(ns, given: Set[str], where: str, flag: str, field: str, value, fills: dict) -> list[str]:
    if flag in given and getattr(ns, flag) != value:
        return [f"{where}: {field}={_show(value)} but --{flag}={_show(getattr(ns, flag))}"]
    fills[flag] = value
    return []


def _show(value) -> str:
    """As the config and the flags write it (true/false, not True/False)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def typed_flags(ns, given: Set[str]) -> set[str]:
    """The launch_values flag names the user typed (``given``: every flag typed) or --hf_scale_config fixed."""
    names = {f.name for f in dataclasses.fields(launch_values.TrainingValues)} | {"num_train_epochs"}
    typed = set(given & names)
    if "warmup_ratio" in given:
        typed.add("warmup_steps")
    if ns.hf_scale_config:
        typed.update(FIXED_BY_HF_SCALE_CONFIG)
    return typed


def training_values(ns, world_size: int) -> launch_values.TrainingValues:
    fields = {f.name for f in dataclasses.fields(launch_values.TrainingValues)} - {"world_size"}
    return launch_values.TrainingValues(world_size=world_size, **{name: getattr(ns, name) for name in fields})


def follow_launcher_config(
    ns, given: set[str], request: LaunchRequest, ds_config: dict | None, *, num_training_steps: int | None = None,
    late: bool = False,
) -> dict[str, Any]:
    """The values of the flags the launcher's config fixes (to fill), or stop with one line naming every conflict.

    `late`: called once the run is set up (a JSON scheduler compared with an epoch-based length): a value
    that would still have to be followed is a conflict then."""
    source = request.deepspeed_config_file or ("the DeepSpeed config of --hf_scale_config" if ds_config else "")
    result = launch_values.reconcile(
        training_values(ns, request.world_size),
        given,
        deepspeed_config=ds_config,
        deepspeed_source=source,
        accelerate_mixed_precision=request.mixed_precision if request.launcher == "accelerate" else None,
        num_training_steps=num_training_steps,
    )
    mismatches = list(result.mismatches)
    if late:
        mismatches += [f"{why}={getattr(result.values, name)} but --{name}={getattr(ns, name)}; set it to \"auto\" "
                       f"or pass --{name} {getattr(result.values, name)}" for name, why in result.followed.items()]
    if mismatches:
        raise UserError("; ".join(mismatches))
    if result.followed and os.environ.get("RANK", "0") == "0":
        said = ", ".join(f"{name}={getattr(result.values, name)} ({why})" for name, why in result.followed.items())
        print(f"hf_scale: following the launcher's config: {said}", file=sys.stderr, flush=True)
    return {name: getattr(result.values, name) for name in result.followed}


@contextlib.contextmanager
def deepspeed_mismatch_as_user_error():
    """The safety net behind follow_launcher_config: should transformers still find a DeepSpeed value that
    disagrees with TrainingArguments (a comparison added after 5.23), say it in one line, not a traceback."""
    try:
        yield
    except ValueError as error:
        text = str(error)
        if "mismatch TrainingArguments" not in text:
            raise
        lines = [line.strip("- ").strip() for line in text.splitlines() if line.strip().startswith("- ds ")]
        raise UserError("the DeepSpeed config disagrees with the flags: " + "; ".join(lines)) from None
