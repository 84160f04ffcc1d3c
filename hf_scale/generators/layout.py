"""Where `hf-scale generate` puts each file of a config NAME, relative to the output directory: one place,
read by the generators that write the files and by the scripts and comments that point at them."""

from __future__ import annotations

TRAINING_MODULE = "hf_scale.train"
"""What the launch scripts run (`python -m hf_scale.train` == train.py of the installed hf_scale) unless
$TRAIN_SCRIPT names another script."""


def accelerate_config(name: str) -> str:
    return f"accelerate_configs/{name}.yaml"


def deepspeed_config(name: str) -> str:
    return f"ds_configs/{name}.json"


def hf_scale_config(name: str) -> str:
    """The resolved DistributedConfig, which every launch script passes to train.py as --hf_scale_config."""
    return f"hf_scale_configs/{name}.yaml"


def launch_file(file_name: str) -> str:
    return f"launch/{file_name}"


def recipe(name: str) -> str:
    return f"recipes/{name}.yaml"


DOCKERFILE = "Dockerfile"
"""The image's Dockerfile, at the top of the output directory (the generated files are its build context)."""
DOCKERIGNORE = ".dockerignore"
SOURCE_ARCHIVE = "hf-scale-source.tar.gz"
"""hf_scale itself, packed by `hf-scale generate` for the image and the SkyPilot nodes (hf_scale.generators.install)."""
REQUIREMENTS_FILE = "hf-scale-requirements.txt"
"""hf_scale's dependencies, pinned (installed with SOURCE_ARCHIVE)."""
