"""The model: loading it and its tokenizer, LoRA, the attention kernel, liger kernels, FSDP2 sharding.
(Tensor/context parallelism and FP8/QLoRA belong here too.)"""
