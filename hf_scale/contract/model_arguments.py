"""train.py's model flags (`ModelArguments`, parsed with TrainingArguments by HfArgumentParser): which model and
tokenizer, the attention kernel, dtype, LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hf_scale.knowledge.rules import DTYPE_CHOICES


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id or local directory of a causal LM. Default: the tiny Llama shipped with hf_scale "
            "(offline demo)."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use when it differs from --model_name_or_path."}
    )
    attn_implementation: Literal[
        "auto", "flash_attention_3", "flash_attention_2", "torch_varlen", "flex_attention", "sdpa", "eager"
    ] = field(
        default="auto",
        metadata={
            "help": "Attention kernel. auto (default): the fastest that runs here, named in one log line. With "
            "--packing: flash_attention_3/2 if installed, else torch_varlen (PyTorch's own varlen flash kernel: "
            "CUDA, bf16/fp16), else flex_attention (CUDA), else sdpa with a dense mask; without packing: "
            "flash-attention if installed, else sdpa."
        },
    )
    torch_dtype: Literal[DTYPE_CHOICES] = field(  # hf_scale.knowledge.rules: either spelling, bf16 = bfloat16
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in: bf16|bfloat16, fp16|float16, fp32|float32 or auto (the "
            "checkpoint's). Keep float32 for mixed precision (--bf16/--fp16 keep an "
            "fp32 master copy); DeepSpeed casts to its own precision."
        },
    )
    chat_template_path: str | None = field(  # help text: argparse needs % doubled
        default=None,
        metadata={
            "help": "A Jinja chat template file for chat (messages) data: for a base model whose tokenizer has "
            "none, or in place of its own. Saved with the tokenizer (chat_template.jinja). Completion-only loss "
            "needs {%% generation %%} ... {%% endgeneration %%} around the assistant turns."
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow custom modelling code from the Hub."}
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 (default) trains all weights."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Comma-separated module names to adapt, or 'all-linear' (peft's shortcut)."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: load the base weights in 4-bit NF4 (bitsandbytes; double quantization, bf16 compute) "
            "and train a LoRA adapter on them (needs --lora_r > 0; pip install 'hf-scale[qlora]')."
        },
    )
