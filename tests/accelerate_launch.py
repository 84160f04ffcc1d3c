"""What `accelerate launch` gives the training processes for a config file, from accelerate's own argument
processing (no process is started): shared by the tests of generated YAMLs and of the FSDP plugin train.py builds."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def launch_environment(config_file: str, port: int):
    """Run accelerate's own `accelerate launch` argument processing on an accelerate config (a path relative to
    the current directory, from which accelerate also resolves the paths inside it) and yield the parsed
    arguments and the environment it would give the training processes (set for the duration)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args = launch_command_parser().parse_args(
        ["--config_file", config_file, "--main_process_port", str(port), "train.py"]
    )
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        # What `launch_command` does before `deepspeed_launcher`: these names are checked by DeepSpeedPlugin.
        fields = list(defaults.deepspeed_config) + ["mixed_precision"] * mixed_precision_from_config
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    with patch_environment(**env):
        yield args, env
