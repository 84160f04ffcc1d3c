"""The ``docker`` target: ``Dockerfile`` and ``.dockerignore`` (in the output directory of `hf-scale generate`):
the image the Kubernetes manifests run (``cluster.image``); every target that runs an image writes them too.

* Base: ``cluster.base_image``, a CUDA PyTorch image; its torch is pinned as a constraint so that nothing installed
  afterwards replaces it (a CUDA build several GB large, matched to the base's CUDA).
* hf_scale from the build context, never from a package index: the generated ``hf-scale-source.tar.gz`` (the
  hf_scale that generated the files) with its dependencies pinned in ``hf-scale-requirements.txt``, installed in
  one pip resolution (hf_scale.generators.install), in a layer that stays cached while the configs change.
* The generated directory (configs, launch scripts) at ``/opt/hf-scale/run``, where the manifests' command finds it.
* A non-root user (uid 1000, the pods' runAsUser and fsGroup): a base that already has a user with that uid
  (Ubuntu 24.04's ``ubuntu``) keeps it, otherwise ``hfscale`` is created. No SSH daemon and no root password:
  torchrun and accelerate need neither (the rendezvous is TCP; SSH is only for the deepspeed/pdsh launcher, which
  the manifests do not use).
* ``STOPSIGNAL SIGTERM`` and exec-form commands: the signal reaches the launch script's handler, not a shell
  that would swallow it; the launch scripts find the training processes in /proc (the base has no procps).
"""

from __future__ import annotations

from hf_scale.clusters.target import ClusterTarget
from hf_scale.config.cluster_section import CONTAINER_UID, DEFAULT_IMAGE_HOME
from hf_scale.config.distributed_config import DistributedConfig
from hf_scale.generators import output_paths
from hf_scale.generators.install import REQUIREMENTS_FILE, SOURCE_ARCHIVE, pip_install

NAME = "docker"

COPIED = ("accelerate_configs", "ds_configs", "hf_scale_configs", "launch", "recipes", REQUIREMENTS_FILE,
          SOURCE_ARCHIVE)
"""What of the build context (the output directory) goes into the image; .dockerignore keeps out the rest."""
BASE_CONSTRAINTS = "/tmp/base-constraints.txt"
"""Where the install step writes the base image's torch version, as a pip constraint."""
HOME = "/home/hfscale"


def dockerfile(cfg: DistributedConfig, *, header: str) -> str:
    """The Dockerfile of the image (see the module docstring)."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    uid = CONTAINER_UID
    return f"""{comment}# Build in the directory holding this file (the generated files are the build context):
#   docker build -t {cfg.cluster.image or "REGISTRY/hf-scale:VERSION"} .
# hf_scale comes from {SOURCE_ARCHIVE} (the hf_scale that generated these files), not from a package index.
ARG BASE_IMAGE={cfg.cluster.base_image}
FROM ${{BASE_IMAGE}}

ENV PYTHONUNBUFFERED=1 \\
    PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The pods run as uid {uid} with the output volume's group {uid} (fsGroup). A base that has a user with that uid
# already (Ubuntu 24.04 images: `ubuntu`) keeps it, otherwise the user hfscale is created; HOME is {HOME}.
RUN if ! getent passwd {uid} > /dev/null; then \\
        if ! getent group {uid} > /dev/null; then groupadd --gid {uid} hfscale; fi \\
        && useradd --uid {uid} --gid {uid} --no-create-home --home-dir {HOME} --shell /bin/bash hfscale; \\
    fi \\
    && install -d -m 0755 -o {uid} -g {uid} {HOME}

WORKDIR {DEFAULT_IMAGE_HOME}
# hf_scale and its pinned dependencies, in one pip resolution; the base image's torch stays (a constraint).
COPY {REQUIREMENTS_FILE} {SOURCE_ARCHIVE} ./
RUN python -c "import torch; print('torch==' + torch.__version__)" > {BASE_CONSTRAINTS} \\
    && {pip_install(constraint=BASE_CONSTRAINTS)} \\
    && rm {BASE_CONSTRAINTS}
# The configs and launch scripts last: changing them rebuilds only this layer.
COPY --chown={uid}:{uid} . ./

USER {uid}:{uid}
ENV HOME={HOME}
# Kubernetes and docker stop send this signal to the command (exec form below: no shell in between); the launch
# scripts turn it into a checkpoint and exit 75.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "hf_scale", "--help"]
"""


def dockerignore() -> str:
    """Everything but the generated files the image needs: checkpoints, outputs and caches never enter the build
    context (they would make every build slow and leak data into the image)."""
    return (
        "# Written by hf-scale generate: only the generated files enter the image.\n*\n"
        + "".join(f"!{path}\n" for path in COPIED)
    )


def files(cfg: DistributedConfig, name: str, *, header: str) -> dict[str, str]:
    """The Dockerfile and its .dockerignore (the same for every config NAME: the image holds all of them)."""
    return {output_paths.DOCKERFILE: dockerfile(cfg, header=header), output_paths.DOCKERIGNORE: dockerignore()}


TARGET = ClusterTarget(
    name=NAME,
    writes="DIR/Dockerfile, DIR/.dockerignore",
    summary="the image that cluster.image names (docker build)",
    files=files,
    doc_anchor="docker-image",
    image=True,
    source=True,
)
