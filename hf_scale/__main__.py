"""`python -m hf_scale` == `hf-scale`."""

import sys

from hf_scale.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
