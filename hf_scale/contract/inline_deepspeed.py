"""An accelerate YAML whose DeepSpeed settings sit inline under `deepspeed_config` (`zero_stage`,
`offload_*_device`, `zero3_init_flag`, `gradient_accumulation_steps`, ... and no `deepspeed_config_file`),
the way TRL and alignment-handbook ship them.

`accelerate launch` turns those keys into `ACCELERATE_*` variables, and accelerate's `DeepSpeedPlugin` builds
the DeepSpeed config from them (batch sizes left "auto" for the Trainer). hf_scale builds that same config
with the same plugin *before* `TrainingArguments` exists and hands it on as `--deepspeed <dict>`: from there
on the run takes exactly the path of a DeepSpeed JSON (the `HfTrainerDeepSpeedConfig` is registered before
`from_pretrained`, so ZeRO-3 builds the model inside `zero.Init`; the Trainer's resolver fills "auto" for both
loops; the runtime guard checks stage, batch and precision).

The YAML's `gradient_accumulation_steps`, `gradient_clipping` and `mixed_precision` (bf16/fp16; `no` fixes
nothing) fill the flags left unset (`--gradient_accumulation_steps`, `--max_grad_norm`, `--bf16`/`--fp16`) and
must equal the flags that were given: a conflict is a one-line error, never a silent choice (the HF Trainer
itself stops with a "mismatch" traceback there). `hf-scale check` reads the file through :func:`plugin_for`
too, so both agree.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass
from typing import Any

from hf_scale.errors import UserError
from hf_scale.knowledge.rules import PRECISIONS, precision_from_flags

_ENV_PREFIX = "ACCELERATE_"


@dataclass(frozen=True)
class InlineDeepSpeed:
    """What an inline `deepspeed_config` asks for, read by accelerate's own DeepSpeedPlugin."""

    plugin: Any
    """accelerate's `DeepSpeedPlugin`, built from the `ACCELERATE_*` variables (its no-config-file branch)."""
    mixed_precision: str
    """The YAML's `mixed_precision` (`ACCELERATE_MIXED_PRECISION`)."""

    @property
    def zero_stage(self) -> int:
        return self.plugin.zero_stage

    @property
    def gradient_accumulation_steps(self) -> int | None:
        """None when the YAML leaves it to the flags ("auto")."""
        value = self.plugin.gradient_accumulation_steps
        return None if value == "auto" else value

    @property
    def gradient_clipping(self) -> float | None:
        value = self.plugin.gradient_clipping
        return None if value == "auto" else value


def is_inline(env: Mapping[str, str]) -> bool:
    """`accelerate launch` enabled DeepSpeed from a YAML that names no DeepSpeed JSON."""
    return (
        "ACCELERATE_MIXED_PRECISION" in env
        and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        and not env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    )


@contextlib.contextmanager
def _accelerate_environment(env: Mapping[str, str]) -> Iterator[None]:
    """`DeepSpeedPlugin()` reads `os.environ`; show it the `ACCELERATE_*` variables of `env` only."""
    if env is os.environ:
        yield
        return
    saved = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith(_ENV_PREFIX)})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_ENV_PREFIX)]:
            del os.environ[key]
        os.environ.update(saved)


def plugin_for(env: Mapping[str, str], where: str = "the accelerate config") -> InlineDeepSpeed:
    """accelerate's DeepSpeedPlugin for the `ACCELERATE_*` variables in `env` (what `accelerate launch` set);
    a value it cannot read or DeepSpeed cannot run is a :class:`UserError` naming the YAML key."""
    from accelerate.utils import DeepSpeedPlugin

    with _accelerate_environment(env):
        try:
            plugin = DeepSpeedPlugin()
        except ValueError as error:  # int()/float() of a YAML value (zero_stage: two)
            raise UserError(f"{where}: deepspeed_config is invalid: {error}") from None
    if plugin.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"{where}: deepspeed_config.zero_stage={plugin.zero_stage} is invalid; use 0, 1, 2 or 3")
    accumulation, clipping = plugin.gradient_accumulation_steps, plugin.gradient_clipping
    if accumulation != "auto" and accumulation < 1:
        raise UserError(f"{where}: deepspeed_config.gradient_accumulation_steps={accumulation} must be >= 1")
    if clipping != "auto" and not clipping >= 0:
        raise UserError(f"{where}: deepspeed_config.gradient_clipping={clipping} must be a number >= 0")
    return InlineDeepSpeed(plugin=plugin, mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no"))


def deepspeed_config(inline: InlineDeepSpeed, precision: str) -> dict:
    """The DeepSpeed config accelerate builds for this YAML, in `precision` (accelerate's own
    `set_mixed_precision`: an fp16/bf16 block, or both disabled)."""
    inline.plugin.set_mixed_precision(precision)
    return inline.plugin.deepspeed_config


@dataclass(frozen=True)
class YamlFills:
    """What the YAML decides for train.py's flags."""

    fills: Mapping[str, Any]
    """Flag name -> value to fill, `deepspeed` (the DeepSpeed config for `--deepspeed`) among them."""
    decided: frozenset[str]
    """The flags filled from the YAML (they count as given from then on)."""

    @property
    def deepspeed(self) -> dict:
        return self.fills["deepspeed"]


def apply_to_flags(inline: InlineDeepSpeed, ns, given: Set[str]) -> YamlFills:
    """The flag values the YAML decides, a conflicting flag (one in ``given``, the flags typed) refused in one
    line (``ns`` is only read)."""
    if inline.mixed_precision not in PRECISIONS:
        raise UserError(
            f"the accelerate config has mixed_precision={inline.mixed_precision}: with DeepSpeed train.py runs "
            "no, fp16 or bf16"
        )
    decided: set[str] = set()
    fills: dict[str, Any] = {}

    def fill_or_match(flag: str, yaml_key: str, value) -> None:
        current = getattr(ns, flag)
        if flag in given and current != value:
            raise UserError(
                f"the accelerate config has {yaml_key}={value} but --{flag}={current}; make them equal "
                "(or drop the flag: train.py takes the YAML's value)"
            )
        fills[flag] = value
        decided.add(flag)

    if inline.gradient_accumulation_steps is not None:
        fill_or_match(
            "gradient_accumulation_steps",
            "deepspeed_config.gradient_accumulation_steps",
            inline.gradient_accumulation_steps,
        )
    if inline.gradient_clipping is not None:
        fill_or_match("max_grad_norm", "deepspeed_config.gradient_clipping", inline.gradient_clipping)

    flags_given = bool(given & {"bf16", "fp16"})
    flags_precision = precision_from_flags(ns.bf16, ns.fp16)
    # `mixed_precision: no` is what accelerate writes when the YAML says nothing: it fixes nothing, the flags decide
    # (the HF Trainer hands its --bf16/--fp16 to the Accelerator, which builds the DeepSpeed config with them).
    precision = flags_precision if inline.mixed_precision == "no" else inline.mixed_precision
    if flags_given and flags_precision != precision:
        raise UserError(
            f"the accelerate config has mixed_precision={inline.mixed_precision} but the flags ask for "
            f"{flags_precision}; make them equal (or drop --bf16/--fp16: train.py takes the YAML's value)"
        )
    fills.update(bf16=precision == "bf16", fp16=precision == "fp16")
    if inline.mixed_precision != "no":
        decided.add(inline.mixed_precision)
    config = deepspeed_config(inline, precision)
    # The YAML's keys are now in `config`. accelerate's DeepSpeedPlugin(hf_ds_config=...), which
    # TrainingArguments creates next, refuses YAML DeepSpeed keys next to a config *file*
    # (_deepspeed_config_checks reads this variable); that guard is about a file, not this config.
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    return YamlFills({**fills, "deepspeed": config}, frozenset(decided))
