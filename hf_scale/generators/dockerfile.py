"""``Dockerfile`` and ``.dockerignore`` (in the output directory of `hf-scale generate`): the image the
Kubernetes manifests run (``cluster.image``).

* Base: ``cluster.base_image``, a CUDA PyTorch image; its torch is pinned as a constraint so that nothing installed
  afterwards replaces it (a CUDA build several GB large, matched to the base's CUDA).
* hf_scale's dependencies pinned to the versions this hf_scale runs with (``docker-requirements.txt``), then
  hf_scale itself from ``HF_SCALE_SPEC`` (a build argument: the released version, a wheel put in the build
  context, or a git URL).
* The generated directory (configs, launch scripts) at ``/opt/hf-scale/run``, where the manifests' command finds it.
* A non-root user (uid 1000, the pods' fsGroup), no SSH daemon and no root password: torchrun and accelerate
  need neither (the rendezvous is TCP; SSH is only for the deepspeed/pdsh launcher, which the manifests do not use).
* ``STOPSIGNAL SIGTERM`` and exec-form commands: the signal reaches the launch script's handler, not a shell
  that would swallow it.
"""

from __future__ import annotations

from importlib import metadata

from hf_scale import __version__
from hf_scale.cluster_config import CONTAINER_UID, DEFAULT_IMAGE_HOME
from hf_scale.config import DistributedConfig

REQUIREMENTS_FILE = "docker-requirements.txt"
PINNED = ("transformers", "accelerate", "deepspeed", "datasets", "peft", "pydantic", "pyyaml", "safetensors", "tqdm")
"""hf_scale's dependencies besides torch (which the base image provides), pinned in the image."""
COPIED = ("accelerate_configs", "ds_configs", "hf_scale_configs", "launch", "recipes", "wheels", REQUIREMENTS_FILE)
"""What of the build context (the output directory) goes into the image; .dockerignore keeps out the rest."""


def requirements() -> str:
    """The pins: each dependency at the version installed with this hf_scale (what its tests ran with)."""
    lines = [f"{name}=={metadata.version(name)}" for name in PINNED]
    return (
        "# hf_scale's dependencies at the versions it was generated with (written by hf-scale generate).\n"
        + "\n".join(lines) + "\n"
    )


def dockerfile(cfg: DistributedConfig, *, header: str) -> str:
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    home = DEFAULT_IMAGE_HOME
    return f"""{comment}# Build in the directory holding this file (the generated files are the build context):
#   docker build -t {cfg.cluster.image or "REGISTRY/hf-scale:VERSION"} .
# hf-scale comes from HF_SCALE_SPEC: the released version by default; for a wheel, put it in wheels/ and pass
#   --build-arg HF_SCALE_SPEC=./wheels/hf_scale-{__version__}-py3-none-any.whl
ARG BASE_IMAGE={cfg.cluster.base_image}
FROM ${{BASE_IMAGE}}

ARG HF_SCALE_SPEC=hf-scale=={__version__}
ENV PYTHONUNBUFFERED=1 \\
    PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A non-root user owns the run directory; the pods run as this uid, with it as the volume's group (fsGroup).
RUN useradd --create-home --uid {CONTAINER_UID} --user-group --shell /bin/bash hfscale

WORKDIR {home}
COPY --chown={CONTAINER_UID}:{CONTAINER_UID} . {home}/

# The base image's torch stays: it is a constraint for everything installed here.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \\
    && python -m pip install --constraint /tmp/torch-constraint.txt --requirement {REQUIREMENTS_FILE} \\
    && python -m pip install --constraint /tmp/torch-constraint.txt "${{HF_SCALE_SPEC}}" \\
    && rm /tmp/torch-constraint.txt

USER {CONTAINER_UID}:{CONTAINER_UID}
ENV HOME=/home/hfscale
# Kubernetes and docker stop send this signal to the command (exec form below: no shell in between); the launch
# scripts turn it into a checkpoint and exit 75.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "hf_scale.cli", "--help"]
"""


def dockerignore() -> str:
    """Everything but the generated files the image needs: checkpoints, outputs and caches never enter the build
    context (they would make every build slow and leak data into the image)."""
    return (
        "# Written by hf-scale generate: only the generated files enter the image.\n*\n"
        + "".join(f"!{path}\n" for path in COPIED)
    )
