"""Generators: pure functions from a DistributedConfig to the text of every file a launch needs."""

from __future__ import annotations

from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.contract.deepspeed_json import Mode, deepspeed_json
from hf_scale.generators import output_paths
from hf_scale.generators.accelerate_yaml import accelerate_yaml
from hf_scale.generators.launch import launch_files
from hf_scale.generators.resolved_config import resolved_config_yaml
from hf_scale.generators.starter_recipe import starter_recipe

RECIPE_HEADER = (
    "Written by hf-scale generate --recipe; edit it (regenerating will not overwrite your edits without --force)."
)


def accelerate_yaml_usage(name: str) -> str:
    """How to launch with the accelerate YAML, written at its top: the YAML alone does not carry the run's
    batch, clipping, optimizer values and activation checkpointing; --hf_scale_config does."""
    return (
        f"Launch with launch/{name}.accelerate.sh (from any directory). By hand, from the directory holding\n"
        "accelerate_configs/, give train.py the config too: this file cannot carry the batch, clipping,\n"
        "optimizer values and activation checkpointing, which --hf_scale_config applies:\n"
        f"  accelerate launch --config_file {output_paths.accelerate_config(name)} "
        f"-m {output_paths.TRAINING_MODULE} \\\n"
        f"    --hf_scale_config {output_paths.hf_scale_config(name)} [train.py flags]"
    )


def render_files(
    cfg: DistributedConfig, *, name: str, deepspeed_mode: Mode, header: str, recipe: bool = False,
    targets: tuple[str, ...] = (), train_flags: dict | None = None,
) -> dict[str, str | bytes]:
    """Relative path (under the output directory) -> file text (bytes for the one binary file, hf_scale's source
    archive), for everything ``hf-scale generate`` writes.

    ``header`` (plain text, one or more lines) is written as a comment at the top of the YAMLs and the scripts.
    ``recipe``: also a starter train.py recipe, ``recipes/NAME.yaml``, with ``train_flags`` (the plan's sequence
    length and LoRA/QLoRA choice) in it. ``targets``: the cluster targets chosen (hf_scale.clusters.CHOSEN); the
    ones written every time (SLURM's sbatch script) come with the launch scripts.
    """
    # Imported here: the target modules import hf_scale.generators' own modules (layout, launch), which would find
    # this package half-initialized if it imported them at its top.
    from hf_scale.clusters import cluster_files, standard_files

    files: dict[str, str | bytes] = {}
    ds_file = None
    if cfg.strategy == "deepspeed":
        ds_file = output_paths.deepspeed_config(name)
        files[ds_file] = deepspeed_json(cfg, deepspeed_mode)
    files[output_paths.accelerate_config(name)] = accelerate_yaml(
        cfg, deepspeed_config_file=ds_file, header=f"{header}\n{accelerate_yaml_usage(name)}"
    )
    files[output_paths.hf_scale_config(name)] = resolved_config_yaml(
        cfg,
        header=f"{header}\nThe resolved DistributedConfig: every launch script passes it to train.py as "
        "--hf_scale_config,\nwhich applies its batch, precision, clipping, optimizer values and activation "
        "checkpointing.",
    )
    for file_name, text in launch_files(cfg, name, header=header).items():
        files[output_paths.launch_file(file_name)] = text
    files.update(standard_files(cfg, name, header=header))
    if recipe:
        files[output_paths.recipe(name)] = starter_recipe(cfg, name, header=RECIPE_HEADER, train_flags=train_flags)
    files.update(cluster_files(cfg, name, targets, header=header))
    return files
