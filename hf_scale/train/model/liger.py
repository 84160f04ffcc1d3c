"""`--use_liger_kernel` (the TrainingArguments flag) in both loops: liger-kernel's Triton kernels.

On a Llama-style model liger replaces RMSNorm, SwiGLU and RoPE with fused kernels and computes the
loss with a fused linear cross-entropy that never materialises the ``[tokens, vocabulary]`` fp32
logits (they are ~4 GB for a 16k-token row and a 32k vocabulary). Its loss divides the summed token
losses by ``num_items_in_batch`` exactly like transformers' loss, so token-normalised accumulation is
unchanged. Both loops apply it with transformers' own ``apply_liger_kernel`` (the Trainer does so in
``train()``; the manual loop calls the same function before wrapping the model).

liger-kernel is an optional extra (``pip install "hf-scale[gpu]"``) and needs a CUDA GPU; what is
missing is said in one line before the model is loaded.
"""

from __future__ import annotations

from hf_scale.errors import UserError

INSTALL_HINT = 'pip install "hf-scale[gpu]"'


def liger_problem(
    *, use_liger: bool, config: dict | None, installed: bool, cuda: bool, zero_stage: int | None
) -> str | None:
    """Why `--use_liger_kernel` cannot run here (one line), or None."""
    if not use_liger:
        return None
    missing = []
    if not installed:
        missing.append(f"the liger-kernel package ({INSTALL_HINT})")
    if not cuda:
        missing.append("a CUDA GPU (its Triton kernels do not run on CPU)")
    if missing:
        return f"--use_liger_kernel: needs {' and '.join(missing)}; drop the flag to train without it"
    if zero_stage == 3 and (config or {}).get("fused_linear_cross_entropy", True):
        # liger reads lm_head.weight directly, outside the module's forward where ZeRO-3 gathers it.
        return (
            "--use_liger_kernel with ZeRO-3: liger's fused linear cross-entropy reads the lm_head weight "
            "that ZeRO-3 keeps partitioned; pass --liger_kernel_config "
            '\'{"fused_linear_cross_entropy": false, "cross_entropy": true}\' or use ZeRO-2 or FSDP2'
        )
    return None


def check_liger(args, *, zero_stage: int | None) -> None:
    """Raise the one-line error for `--use_liger_kernel` when it cannot run here."""
    import torch
    from transformers.utils import is_liger_kernel_available

    problem = liger_problem(
        use_liger=args.use_liger_kernel,
        config=args.liger_kernel_config,
        installed=is_liger_kernel_available(),
        cuda=torch.cuda.is_available(),
        zero_stage=zero_stage,
    )
    if problem:
        raise UserError(problem)


def apply_liger(model, args) -> None:
    """What the Trainer does in ``train()``, for the manual loop (same function, same configuration)."""
    if not args.use_liger_kernel:
        return
    try:
        from transformers.integrations.liger import apply_liger_kernel
    except ImportError:  # transformers releases before the integration module: the Trainer's own inline code
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        _apply_liger_kernel_to_instance(model=base, **(args.liger_kernel_config or {}))
        return
    apply_liger_kernel(model, args.liger_kernel_config)
