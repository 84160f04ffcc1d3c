"""train.py's contract with everything that hands it values or reads what it writes: its flags (the argument
dataclasses, parser, --help, recipes, value ranges), the values a launcher's config fixes (launch_values), the DeepSpeed
JSON and FSDP fields a DistributedConfig implies, and the checkpoint layout on disk. Below the runtime and the commands.
"""
