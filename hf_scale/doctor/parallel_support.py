"""`hf-scale doctor`'s `parallelism` section: what train.py does with tensor, context and sequence parallelism and HSDP
on this node.

hf_scale.config.parallelism.node_support answers from the installed versions and, for cp, whether a GPU is there. HSDP
(`fsdp.sharding: hybrid_shard`, dp_replicate x dp_shard) needs more, because what train.py does with it depends on the
launcher and the GPU as well:

- under `accelerate launch` (the generated launch/NAME.accelerate.sh) accelerate's FSDP builds the 2-D mesh from the
  YAML's parallelism_config, and that needs GPUs: on a node without one, train.py's runtime guard refuses it before
  anything is built (hf_scale.contract.launch_request.refuse_before_prepare, asked here with the same request);
- under `torchrun` or plain `python` train.py sets FSDP2 up itself, with no 2-D mesh: it refuses HSDP without TP on
  any node (hf_scale.train.setup.reconcile); with tp > 1 transformers builds the dp_replicate x dp_shard x tp mesh.

So on a CPU node HSDP without TP is refused by every launcher: "yes" there was what the versions allow, not what runs.
"""

from __future__ import annotations

from typing import Any

from hf_scale.config import parallelism

HSDP_X_TP = ("HSDP x TP (tp > 1: transformers builds the dp_replicate x dp_shard x tp mesh) is not refused before "
             "start, but hf_scale has not run it (it needs 8 processes)")


def accelerate_refusal(gpu_present: bool) -> str | None:
    """What train.py's runtime guard says to HSDP launched by `accelerate launch` on this node (None: it runs it)."""
    from hf_scale.contract.launch_request import LaunchRequest, RuntimeGuardError, refuse_before_prepare

    # What detect_launch reads from a generated hybrid_shard YAML: FSDP chosen by accelerate, not --hf_scale_config.
    request = LaunchRequest(launcher="accelerate", world_size=4, strategy="fsdp", deepspeed_config_file=None,
                            zero_stage=None, mixed_precision="bf16", accelerate_fsdp_version=2,
                            layout=parallelism.Layout(dp_replicate=2, dp_shard=2))
    try:
        refuse_before_prepare(request, has_gpu=gpu_present)
    except RuntimeGuardError as refusal:
        return str(refusal)
    return None


def hsdp_support(gpu_present: bool) -> dict[str, Any]:
    """HSDP on this node as train.py treats it (the module docstring), for versions that support it."""
    refusal = accelerate_refusal(gpu_present)
    if refusal is not None:
        return {"usable": False, "why": "train.py refuses HSDP without TP on this node under every launcher: under "
                f"accelerate launch ({refusal.removeprefix('runtime guard: ').split(';')[0]}), under torchrun or "
                f"python its own FSDP2 setup has no 2-D mesh; {HSDP_X_TP}"}
    return {"usable": True, "why": "installed versions support it; train.py runs it (FSDP2 hybrid sharding) under "
            "accelerate launch (launch/NAME.accelerate.sh: its YAML's parallelism_config gives accelerate the 2-D "
            "mesh); under torchrun or python only with tp > 1, and refuses it without TP there (its own FSDP2 setup "
            f"has no 2-D mesh); {HSDP_X_TP}"}


def train_support(gpu_present: bool) -> dict[str, dict[str, Any]]:
    """Per kind (tp, cp, sp, ep, hsdp): whether train.py runs it on this node, and why (not)."""
    support = parallelism.node_support(gpu_present)
    too_old = parallelism.version_problem("hsdp")  # when the versions allow it, the launcher and the GPU decide
    support["hsdp"] = {"usable": False, "why": too_old} if too_old else hsdp_support(gpu_present)
    return support
