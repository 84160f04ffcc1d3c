"""One process, ZeRO-3 over gloo: which linear layers fp8 converts when the model is built inside DeepSpeed's
zero.Init (as from_pretrained builds it under ZeRO-3, and as accelerate hands it to torchao before DeepSpeed wraps
it: every weight partitioned to shape (0,)).

Usage: MASTER_PORT=FREE python tests/_fp8_zero3_worker.py OUT_JSON
Writes {"partitioned": [...], "full_shapes": {...}, "matmul_parameters": n, "plan": {...}, "line": "...",
"converted": [...], "loss": {"fp8": x, "bf16": y}}: the shapes the weights had, their full shapes and the matmul
parameter count (the MFU's) as hf_scale reads them from the partitions, the plan and the log line train.py
computes, what torchao's real convert_to_float8_training swapped, using the filter accelerate receives
(hf_scale.train.model.fp8.recipe_handler), and the first loss of one DeepSpeed ZeRO-3 step with the converted model
and with the same model unconverted (torch runs fp8 matmuls on CPU too, slowly: this proves the ZeRO-3 gathering,
not the speed).
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear
from transformers import LlamaConfig, LlamaForCausalLM

from hf_scale.knowledge import fp8_layers
from hf_scale.knowledge.partitioned import full_shape
from hf_scale.train.loops.metrics import matmul_parameters
from hf_scale.train.model import fp8

# Large enough that torchao converts the MLP's up/gate projections (out_features 2048 > 1024), small enough for CPU.
CONFIG = {"hidden_size": 64, "intermediate_size": 2048, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 256}
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def _partitioned_model():
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _first_loss(model) -> float:
    """One ZeRO-3 optimizer step (DeepSpeed gathers each layer's weight for its forward and backward)."""
    engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG, model_parameters=model.parameters())
    ids = torch.arange(32).reshape(1, 32) % CONFIG["vocab_size"]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def main(out: str) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # MASTER_PORT: the caller's
    deepspeed.init_distributed(dist_backend="gloo")
    model = _partitioned_model()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    sizes = {"full_shapes": {name: list(full_shape(param)) for name, param in model.named_parameters()},
             "matmul_parameters": matmul_parameters(model)}  # before torchao swaps the layers
    plan = fp8_layers.plan(model, "torchao")
    convert_to_float8_training(model, module_filter_fn=fp8.recipe_handler("torchao").module_filter_func)
    result = {
        "partitioned": sorted({str(tuple(m.weight.shape)) for m in linears.values()}),
        **sizes,
        "plan": {"converted": sorted(plan.converted), "kept": plan.kept},
        "line": fp8_layers.describe(plan),
        "converted": sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)),
    }
    result["loss"] = {"fp8": _first_loss(model), "bf16": _first_loss(_partitioned_model())}
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1])
