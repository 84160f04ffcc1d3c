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

import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

from hf_scale.config import parallelism
from hf_scale.contract import launch_values
from hf_scale.contract.config_flags import (
    engine_mismatch,
    fill_flags_from_config,
    fsdp_checkpointing_mismatch,
    launched_layout_mismatch,
    precision_mismatch,
    world_size_mismatch,
    zero_stage_mismatch,
)
from hf_scale.contract.launch_request import LaunchRequest
from hf_scale.contract.shared_values import FIXED_BY_HF_SCALE_CONFIG
from hf_scale.errors import UserError
from hf_scale.train.setup.distributed import has_gpu


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
    from hf_scale.contract import parallel_refusals

    refusal = parallel_refusals.flag_refusal(layout, packing=ns.packing, attn_implementation=ns.attn_implementation,
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
    from hf_scale.contract import parallel_refusals
    from hf_scale.train.model.load import load_pretrained_config, resolve_model_path

    if layout.model_parallel_size == 1 and layout.ep == 1:
        return
    path = resolve_model_path(ns)
    if not (Path(path) / "config.json").is_file():
        return
    problem = parallel_refusals.model_problem(layout, load_pretrained_config(path, ns.trust_remote_code), where)
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
