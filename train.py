"""Fine-tune a causal LM; see `python train.py --help`. Launch it unchanged with
`python`, `torchrun`, `accelerate launch` or `deepspeed`."""

from hf_scale.commands.train import main

if __name__ == "__main__":
    main()
