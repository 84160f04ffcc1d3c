"""`python -m hf_scale` == `hf-scale`."""

from hf_scale.commands.cli import main

if __name__ == "__main__":
    main()
