"""The value types of DistributedConfig's fields: bounds, strict integers and numbers, and the values that end up
in launch scripts and hostfiles (host names, paths, class names, file names), which admit nothing a shell or a
hostfile could read as more than one word."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, Strict

# Upper bounds: far beyond any real run, low enough that a typo (an extra digit, a byte count in an
# element field) is refused instead of generating a file that fails at launch or allocates terabytes.
MAX_MACHINES = 16_384


MAX_PROCESSES_PER_MACHINE = 1_024


MAX_BATCH = 2**24
"""Any of the batch triple, and the resolved global batch (samples per optimizer step)."""


MAX_ELEMENTS = 2**40
"""DeepSpeed bucket sizes and thresholds, in elements: 2**40 bf16 elements are 2 TiB, more than any GPU."""


MAX_STRING = 4_096


def _yaml_no_is_no(value: Any) -> Any:
    # YAML 1.1 reads a bare `no` as false; `precision: no` (or `--set precision=no`) means "no" here.
    return "no" if value is False else value


Precision = Annotated[Literal["no", "fp16", "bf16", "fp8"], BeforeValidator(_yaml_no_is_no)]


OffloadDevice = Literal["none", "cpu", "nvme"]


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads true as 1.0; a flag where a number belongs is a mistake, not a value.
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


# Integers are strict (true, 2.0 and "2" are refused); numbers refuse booleans, NaN and infinities
# (DistributedConfig's model_config has allow_inf_nan=False) but accept YAML 1.1's unquoted "1e-5", which
# PyYAML reads as a string.
StrictInt = Annotated[int, Strict()]


Number = Annotated[float, BeforeValidator(_not_bool)]


def int_choice(value: Any) -> Any:
    # Literal[0, 1, 2, 3] alone would take true as 1 and 3.0 as 3.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


def _auto_or_positive_int(value: Any) -> Any:
    # One readable message instead of pydantic's per-union-member errors.
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_ELEMENTS):
        return value
    raise ValueError(f'must be "auto" or an integer from 1 to {MAX_ELEMENTS}')


AutoOrPositiveInt = Annotated[
    Literal["auto"] | Annotated[int, Field(gt=0)], BeforeValidator(_auto_or_positive_int)
]


Elements = Annotated[StrictInt, Field(gt=0, le=MAX_ELEMENTS)]


BatchSize = Annotated[StrictInt, Field(gt=0, le=MAX_BATCH)]


Beta = Annotated[Number, Field(ge=0.0, lt=1.0)]


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


_IPV6_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,15}")


_SAFE_PATH = re.compile(r"/[A-Za-z0-9_@%+=:,./-]*")


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def host_problem(value: str) -> str | None:
    """Why ``value`` is not an IPv4/IPv6 address or an RFC 1123 host name (None when it is one). Such a
    value goes into launch scripts and hostfiles, so nothing else may pass."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is not None:
        zone = getattr(address, "scope_id", None)
        return None if zone is None or _IPV6_ZONE.fullmatch(zone) else "the IPv6 zone must be an interface name"
    labels = value.split(".")
    if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return (
            "must be an IPv4/IPv6 address or a DNS host name (RFC 1123: labels of letters, digits and '-', "
            "separated by '.', e.g. 10.0.0.1 or node-001.cluster)"
        )
    if labels[-1].isdigit():
        return "is neither an IPv4 address nor a host name (a host name cannot end in a numeric label)"
    return None


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name generated files (None when it can): it becomes file names, a SLURM job
    name and words in launch scripts."""
    if _NAME.fullmatch(name):
        return None
    return "is invalid: use up to 100 letters, digits, '_', '-' and '.', starting with a letter or digit"


def _host(value: str) -> str:
    problem = host_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _local_path(value: str) -> str:
    if not _SAFE_PATH.fullmatch(value) or len(value) > MAX_STRING:
        raise ValueError(
            "must be an absolute path (starting with /) of letters, digits and _ @ % + = : , . / - (no spaces, "
            "quotes, $, ;, newlines or other control characters)"
        )
    return value


def _class_name(value: str) -> str:
    if not _IDENTIFIER.fullmatch(value):
        raise ValueError("must be a Python class name, e.g. LlamaDecoderLayer")
    return value


Host = Annotated[str, Field(max_length=253), AfterValidator(_host)]


LocalPath = Annotated[str, AfterValidator(_local_path)]


ClassName = Annotated[str, AfterValidator(_class_name)]
