"""The `cluster` section of a DistributedConfig: what the cluster targets of `hf-scale generate --targets` need
beyond the run itself (image, volume, grace period, restarts, node selection). Every field has a default, so a
config without the section is unchanged; the cluster targets (hf_scale.clusters) and
hf_scale.generators.node_entry read it, and `hf-scale check` compares manifests with it.

Every value ends up in a YAML manifest or a shell word, so each is checked against the syntax Kubernetes,
SkyPilot or Docker accept for it (which also keeps quotes, newlines and `$` out).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict

from hf_scale.config.error_line import UnshownValueError
from hf_scale.knowledge.rules import is_secret_name, is_secret_setting, looks_like_token, secret_advice

# A container image reference: [registry[:port]/]path[:tag][@digest] (Docker's reference grammar, simplified to
# the characters it allows).
_IMAGE = re.compile(
    r"(?:[a-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?"
)
_IMAGE_MAX = 255 + len(":") + 128 + len("@sha256:") + 64
"""The longest reference Docker takes: a name of at most 255 characters (distribution/reference's
NameTotalLengthMax), a tag of at most 128, a sha256 digest."""
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?")
_LABEL_KEY = re.compile(r"(?:[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?")
_RESOURCE = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
_ACCELERATOR = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_MOUNT = re.compile(r"/[A-Za-z0-9_./-]*")
_TRAIN_ARG = re.compile(r"[^\x00-\x1f\x7f]{1,4096}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_ENV_VALUE = re.compile(r"[^\x00-\x1f\x7f]{0,4096}")

DEFAULT_IMAGE_HOME = "/opt/hf-scale/run"
"""Where the image holds the generated directory (the Dockerfile copies it there; the manifests run from it)."""
CONTAINER_UID = 1000
"""The image's non-root user; the pods' fsGroup, so the output volume is writable by it."""
PYTORCHJOB_CONTAINER = "pytorch"
"""The container name the Training Operator looks for (its MASTER_PORT comes from this container's port)."""
TRAINJOB_CONTAINER = "node"
"""The trainer container of Kubeflow Trainer's torch-distributed runtime."""


def image_problem(image: str) -> str | None:
    """Why ``image`` is not a pinned image reference (None when it is): a tag other than `latest`, or a digest."""
    if len(image) > _IMAGE_MAX:
        return f"is {len(image)} characters long: an image reference is at most {_IMAGE_MAX}"
    match = _IMAGE.fullmatch(image)
    if match is None:
        return "is not an image reference such as registry.example.com/team/hf-scale:0.1.0"
    if match["digest"] is None and match["tag"] is None:
        return "has no tag: a pod restarted after preemption could pull a different image; add :VERSION or @sha256:..."
    if match["digest"] is None and match["tag"] == "latest":
        return "uses the tag `latest`: a restarted pod could pull a different image; pin a version or a digest"
    return None


def _matching(pattern: re.Pattern, allowed: str):
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(allowed)
        return value

    return AfterValidator(check)


def _image(value: str) -> str:
    problem = image_problem(value)
    if problem:
        raise ValueError(problem)
    return value


RESERVED_ENV = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "NODE_RANK", "MACHINE_RANK", "MAIN_PROCESS_IP",
    "MAIN_PROCESS_PORT", "RDZV_ID",
})
"""Variables the runtime sets on every node or process for the rendezvous: the Training Operator's pod-level
MASTER_*/RANK/WORLD_SIZE, torchrun's per-process ranks, launch/NAME.node.sh's MACHINE_RANK / MAIN_PROCESS_IP /
MAIN_PROCESS_PORT (the generated launch scripts read them; topology.main_process_port is the port). One set in
cluster.env would override the platform's value (or the config's) on every node alike: the nodes would disagree on
who they are, or meet on the wrong address or port."""
RESERVED_ENV_PREFIXES = ("PET_", "SKYPILOT_", "TORCHELASTIC_")
"""Kubeflow's PET_* (torchrun's settings per node), SkyPilot's SKYPILOT_* (node rank, IPs, GPUs), torchrun's own."""
def reserved_env_problem(name: str) -> str | None:
    """Why ``name`` may not be set in cluster.env (None when it may): the runtime sets it."""
    if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
        return (f"the variable {name} is set by the runtime for the rendezvous (the platform on each node, or "
                "launch/NAME.node.sh); overriding it on every node breaks the rendezvous: remove it (the node "
                "count and processes come from topology, the port from topology.main_process_port)")
    return None


def secret_env_problem(name: str, value: object) -> str | None:
    """Why ``name=value`` looks like a secret (None when it does not); the value is never part of the answer."""
    if not is_secret_setting(name, value):
        return None
    return (f"the variable {name} looks like a secret, and cluster.env is written in plain text into every manifest "
            f"(committed with the generated files): remove it and {secret_advice(name)}")


def train_args_secret_problem(args: list[str]) -> str | None:
    """Why ``args`` (cluster.train_args) pass a secret (None when they do not): a flag named like a credential
    (--hub_token) or an argument spelled like a token. They are written into every manifest, the SkyPilot task, the
    resolved config and (through --set) every generated file's regenerate comment; the answer never shows a value."""
    for index, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag.startswith("--") and is_secret_name(flag[2:]):
            return (f"{flag} passes a secret, and cluster.train_args is written in plain text into every manifest "
                    "(committed with the generated files): remove it; train.py and the Hub read HF_TOKEN from the "
                    f"environment: {secret_advice('HF_TOKEN')}")
        if looks_like_token(value or arg):
            return (f"argument {index} looks like an access token (not shown here), and cluster.train_args is written "
                    "in plain text into every manifest (committed with the generated files): remove it, put the token "
                    f"in an environment variable NAME and {secret_advice('NAME')}")
    return None


def _env_secrets_first(value: object) -> object:
    # Before the type check: a secret given as a number (DB_PASSWORD: 987654321) is refused as a secret, never
    # echoed back as "not a valid string".
    if isinstance(value, dict):
        for key, setting in value.items():
            problem = secret_env_problem(key, setting) if isinstance(key, str) else None
            if problem:
                raise UnshownValueError(problem)
    return value


def _environment(value: dict[str, str]) -> dict[str, str]:
    for key, setting in value.items():
        if not _ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not an environment variable name (a letter or '_', then letters, digits, "
                             "'_')")
        if not _ENV_VALUE.fullmatch(setting):
            raise UnshownValueError(f"the value of {key} must be one line without control characters, at most "
                                    "4096 long")
        problem = reserved_env_problem(key)
        if problem:
            raise ValueError(problem)
    return value


def _train_args(value: list[str]) -> list[str]:
    problem = train_args_secret_problem(value)
    if problem:
        raise UnshownValueError(problem)  # the one line names the flag, never its value
    return value


def _labels(value: dict[str, str]) -> dict[str, str]:
    for key, label in value.items():
        if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(label):
            raise ValueError(
                f"{key}={label!r} is not a Kubernetes label (keys [prefix/]name and values of letters, digits, "
                "'-', '_' and '.', at most 63 characters)"
            )
    return value


Image = Annotated[str, AfterValidator(_image)]
DnsLabel = Annotated[str, _matching(_DNS_LABEL, "use a DNS label: up to 63 lowercase letters, digits and '-'")]
DnsSubdomain = Annotated[str, _matching(_DNS_SUBDOMAIN, "use lowercase letters, digits, '-' and '.'")]


def _mount_path(value: str) -> str:
    if not _MOUNT.fullmatch(value) or len(value) > 1024:
        raise ValueError("use an absolute path of letters, digits and _ . / -, at most 1024 characters")
    if {".", ".."} & set(value.split("/")):  # /../../etc is /etc: the volume would land elsewhere than it says
        raise ValueError("use a path without . or .. parts, e.g. /output")
    return value


MountPath = Annotated[str, AfterValidator(_mount_path)]
StrictInt = Annotated[int, Strict()]


DEFAULT_GRACE_PERIOD_S = 600
"""terminationGracePeriodSeconds without a prediction, and the floor of a predicted one."""
DEFAULT_SIGNAL_LEAD_S = 120
"""SLURM's --signal lead without a prediction, and the floor of a predicted one."""

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)


class KubernetesSettings(_Section):
    """Kubernetes (Kubeflow Trainer TrainJob, Training Operator PyTorchJob)."""

    namespace: DnsLabel = "default"
    """Namespace of the job (and of the output volume's claim)."""
    runtime: DnsSubdomain = "torch-distributed"
    """TrainJob: the ClusterTrainingRuntime to run on (Kubeflow Trainer's torch-distributed runtime)."""
    output_claim: DnsSubdomain = "hf-scale-output"
    """PersistentVolumeClaim (ReadWriteMany: every node writes its checkpoint shard) mounted at cluster.output_dir."""
    gpu_resource: Annotated[str, _matching(_RESOURCE, "use an extended resource name such as nvidia.com/gpu")] = (
        "nvidia.com/gpu"
    )
    """Resource name of one GPU; each pod asks for processes_per_machine of them."""
    node_selector: Annotated[dict[str, str], AfterValidator(_labels), Field(max_length=32)] = Field(
        default_factory=dict
    )
    """Node labels the pods must match, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}."""


class SkyPilotSettings(_Section):
    """SkyPilot task (sky launch / sky jobs launch)."""

    accelerator: Annotated[str, _matching(_ACCELERATOR, "use a SkyPilot accelerator name such as H100")] = "H100"
    """GPU type; each node asks for processes_per_machine of them (resources.accelerators NAME:COUNT)."""
    bucket: Annotated[str, _matching(_BUCKET, "use 3-63 lowercase letters, digits, '.', '_' and '-'")] = (
        "hf-scale-checkpoints"
    )
    """Storage bucket mounted at cluster.output_dir on every node (checkpoints survive a preempted node)."""
    use_spot: Annotated[bool, Strict()] = False
    """Spot instances; `sky jobs launch` recovers a preempted job, which resumes from the bucket."""


class ClusterConfig(_Section):
    """Cluster targets of `hf-scale generate --targets` (Kubernetes, SkyPilot, Ray, the container image)."""

    image: Image | None = None
    """Container image the manifests run (built from the generated Dockerfile), with a version tag or a digest,
    e.g. registry.example.com/team/hf-scale:0.1.0; required for every target that runs
    the image (the two Kubernetes manifests and the Dockerfile: hf_scale.clusters' image targets)."""
    base_image: Image = "pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime"
    """The generated Dockerfile's CUDA PyTorch base (its torch is kept: the image installs nothing over it)."""
    output_dir: MountPath = "/output"
    """Where the shared output volume (a PVC, a bucket) is mounted; the run writes OUTPUT_DIR/NAME and a restarted
    node resumes from the newest complete checkpoint there."""
    train_args: Annotated[
        list[Annotated[str, _matching(_TRAIN_ARG, "one argument without control characters")]],
        AfterValidator(_train_args),
    ] = Field(default_factory=list, max_length=256)
    """train.py flags every node passes after the generated ones, e.g. [--model_name_or_path, meta-llama/...,
    --train_file, /data/train.jsonl]; refused by `hf-scale generate` where train.py would refuse them (an unknown flag,
    a value contradicting this config), and --output_dir / --hf_scale_config, which every node passes itself."""
    env: Annotated[
        dict[str, Annotated[str, Strict()]],
        BeforeValidator(_env_secrets_first),
        AfterValidator(_environment),
        Field(max_length=128),
    ] = Field(default_factory=dict)
    """Environment variables of every node (TrainJob/PyTorchJob container env, SkyPilot envs), e.g.
    {NCCL_SOCKET_IFNAME: eth0, NCCL_IB_HCA: mlx5}; on Kubernetes HF_HOME defaults to OUTPUT_DIR/.cache/huggingface
    (the volume: a restarted pod does not download the model again). Refused: secrets (HF_TOKEN, *_API_KEY, ...:
    they would be written in plain text; add a secretKeyRef to the manifest, or pass --secret HF_TOKEN to sky) and
    the variables the runtime sets for the rendezvous (PET_*, SKYPILOT_*, MASTER_ADDR, RANK, ...: RESERVED_ENV)."""
    termination_grace_period_s: Annotated[StrictInt, Field(ge=30, le=86_400)] = DEFAULT_GRACE_PERIOD_S
    """Seconds between SIGTERM and SIGKILL (pods' terminationGracePeriodSeconds): must cover the rest of the
    current optimizer step plus saving one checkpoint (`hf-scale check` compares it with a measured save and with
    the planner's predicted step + save; `generate --strategy auto` sets it from them, hf_scale.planner.budgets)."""
    preempt_signal_lead_s: Annotated[StrictInt, Field(ge=30, le=86_400)] = DEFAULT_SIGNAL_LEAD_S
    """Seconds before the SLURM time limit at which the training processes are asked to checkpoint and stop
    (`#SBATCH --signal=USR1@N`): the same budget, a step plus a save (`generate --strategy auto` sets it)."""
    max_restarts: Annotated[StrictInt, Field(ge=0, le=10_000)] = 10
    """Restarts after a failure or a preemption (PyTorchJob runPolicy.backoffLimit, SkyPilot
    job_recovery.max_restarts_on_errors, Ray FailureConfig.max_failures)."""
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    skypilot: SkyPilotSettings = Field(default_factory=SkyPilotSettings)

    def on_volume(self, relative: str) -> str:
        """A path on the shared output volume, as every node sees it: ``on_volume(NAME)`` is the run's --output_dir
        (where a restarted node resumes from), ``on_volume(".cache/huggingface")`` the Hub cache."""
        return f"{self.output_dir.rstrip('/')}/{relative}"

    def node_train_args(self, name: str) -> list[str]:
        """train.py's flags on every node of the run NAME, after the generated launch script's own: its output
        directory on the volume, then ``train_args``."""
        return ["--output_dir", self.on_volume(name), *self.train_args]
