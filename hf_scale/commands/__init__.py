"""The command-line entry points: `hf-scale` and its sub-commands (cli.COMMANDS), train.py's (train) and the Ray
driver's (ray_train). Each command's module parses its arguments and calls the library packages; nothing below imports a
command."""
