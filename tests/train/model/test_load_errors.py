"""hf_scale.train.model.load names a weights file that cannot be read as such, whatever torch's unpickler trips on:
garbage bytes raise UnpicklingError mostly, but also IndexError or KeyError from inside torch's unpickler, which
must not be reported as "transformers cannot build the model from its config.json"."""

from __future__ import annotations

import io
import random

import torch

from hf_scale.train.model.load import _weights_error


def test_every_way_garbage_fails_to_unpickle_is_a_weights_error():
    raised = set()
    for seed in range(200):
        try:
            torch.load(io.BytesIO(random.Random(seed).randbytes(2048)), weights_only=True)
        except Exception as error:  # noqa: BLE001 - every failure is the point
            raised.add(type(error).__name__)
            assert _weights_error(error) is not None, f"seed {seed}: {type(error).__name__}: {error}"
    assert {"UnpicklingError", "IndexError"} <= raised  # the seeds do reach the non-pickle exceptions


def test_an_error_of_the_architecture_is_not_a_weights_error():
    try:
        [].pop()  # raised here, not in a weights reader
    except IndexError as error:
        assert _weights_error(error) is None
