"""Generators: pure functions from a DistributedConfig to the text of every file a launch needs."""

from __future__ import annotations

from hf_scale.config import DistributedConfig
from hf_scale.generators.accelerate_yaml import accelerate_yaml
from hf_scale.generators.deepspeed_json import Mode, deepspeed_json
from hf_scale.generators.launch import launch_files
from hf_scale.generators.recipe import starter_recipe

RECIPE_HEADER = (
    "Written by hf-scale generate --recipe; edit it (regenerating will not overwrite your edits without --force)."
)


def render_files(
    cfg: DistributedConfig, *, name: str, deepspeed_mode: Mode, header: str, recipe: bool = False
) -> dict[str, str]:
    """Relative path (under the output directory) -> file text, for everything ``hf-scale generate`` writes.

    ``header`` (plain text, one or more lines) is written as a comment at the top of the YAML and the scripts.
    ``recipe``: also a starter train.py recipe, ``recipes/NAME.yaml``.
    """
    files: dict[str, str] = {}
    ds_file = None
    if cfg.strategy == "deepspeed":
        ds_file = f"ds_configs/{name}.json"
        files[ds_file] = deepspeed_json(cfg, deepspeed_mode)
    files[f"accelerate_configs/{name}.yaml"] = accelerate_yaml(
        cfg, deepspeed_config_file=ds_file, header=header
    )
    for file_name, text in launch_files(cfg, name, header=header).items():
        files[f"launch/{file_name}"] = text
    if recipe:
        files[f"recipes/{name}.yaml"] = starter_recipe(cfg, name, header=RECIPE_HEADER)
    return files
