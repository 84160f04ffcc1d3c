"""Where the rows come from: one or several sources (a mixture), and the validation set.

Each `--train_file` / `--dataset_name` is loaded on its own (hf_scale.train.data.pipeline.load_raw_datasets), its
format resolved and tokenized on its own, and only then are the tokenized sources mixed:

- without `--mixture_weights`, concatenated (every row of every source, once per epoch);
- with weights, drawn by `datasets.interleave_datasets(probabilities=weights / sum, seed=--data_seed or
  --seed, stopping_strategy=--mixture_stopping_strategy)`: `first_exhausted` (default) stops when a
  source runs out, so no row repeats; `all_exhausted` goes on until every source was used up,
  repeating rows of the smaller-share sources; `all_exhausted_without_replacement` takes every row
  once, in a weighted random order.

The mixture is one seeded, ordinary Dataset built before the sampler deals micro-batches, identical on
every rank, so the ranks stay disjoint exactly as with one source. What was taken from each source is
returned as a manifest (train_summary.json's `data`).

Validation: the sources' own validation splits, `--validation_file`, or `--validation_split_percentage`
carved (seeded) from each source's training rows; tokenized like training and concatenated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

import datasets

from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.embedded_assets import EMBEDDED_DATA_FILE
from hf_scale.errors import UserError
from hf_scale.train.data.pipeline import _load_file, load_raw_datasets, tokenize_dataset

SOURCE_COLUMN = "__hf_scale_source"


@dataclass(frozen=True)
class Source:
    flag: str
    """train_file or dataset_name."""
    name: str
    weight: float | None


@dataclass
class PreparedData:
    train: datasets.Dataset
    validation: datasets.Dataset | None
    manifest: dict[str, Any]
    unused_validation: bool = False
    """Validation data exists but evaluation was not asked for."""


def data_sources(args: DataArguments, extra: SourceArguments, eval_requested_by: str | None = None) -> list[Source]:
    """The training sources with their normalised weights; every flag checked before anything is loaded."""
    if args.validation_file and not args.train_file:
        raise UserError("--validation_file needs --train_file")
    if args.dataset_name and args.train_file:
        raise UserError("--dataset_name and --train_file/--validation_file are mutually exclusive; pass one")
    flag, names = ("dataset_name", args.dataset_name) if args.dataset_name else ("train_file", args.train_file)
    weights = extra.mixture_weights
    if weights is not None:
        given = " ".join(f"{w:g}" for w in weights)
        if not names or len(names) < 2:
            raise UserError(f"--mixture_weights {given}: needs several --train_file or --dataset_name to mix")
        if len(weights) != len(names):
            raise UserError(f"--mixture_weights {given}: {len(weights)} weights for {len(names)} --{flag} sources; "
                            "give one weight per source, in the same order")
        bad = next((w for w in weights if not math.isfinite(w) or w <= 0), None)
        if bad is not None:
            raise UserError(f"--mixture_weights {given}: {bad:g} is not a positive number")
        weights = [w / sum(weights) for w in weights]
    pct = extra.validation_split_percentage
    if pct is not None and not 0 < pct < 100:
        raise UserError(f"--validation_split_percentage {pct:g}: must be between 0 and 100 (exclusive)")
    if pct is not None and args.validation_file:
        raise UserError(f"--validation_split_percentage {pct:g} and --validation_file: pass one")
    if extra.max_eval_samples is not None and extra.max_eval_samples <= 0:
        raise UserError(f"--max_eval_samples {extra.max_eval_samples}: must be a positive number of examples")
    if eval_requested_by and not (args.dataset_name or args.validation_file or pct is not None):
        raise _no_validation(eval_requested_by)  # files have no validation split of their own
    names = names or [str(EMBEDDED_DATA_FILE)]
    return [Source(flag, name, weights[i] if weights else None) for i, name in enumerate(names)]


def prepare_datasets(args: DataArguments, extra: SourceArguments, tokenizer, *, seed: int,
                     eval_requested_by: str | None) -> PreparedData:
    """Load, tokenize and mix the training sources; the validation set when evaluation is asked for.

    Call inside ``main_process_first()``: tokenization is cached (datasets.map), and the mixture is a
    seeded function of the tokenized sources, so every rank ends with the same datasets."""
    sources = data_sources(args, extra, eval_requested_by)
    several = len(sources) > 1
    train_parts, validation_parts, has_validation = [], [], bool(args.validation_file)
    for source in sources:
        raw = load_raw_datasets(dataclasses.replace(args, **{source.flag: [source.name]}, validation_file=None))
        if "validation" not in raw and extra.validation_split_percentage is not None:
            raw = _carve_validation(raw["train"], extra.validation_split_percentage, seed, source)
        has_validation = has_validation or "validation" in raw
        with _naming(source, several):
            train_parts.append(tokenize_dataset(raw["train"], tokenizer, args))
            if eval_requested_by and "validation" in raw:
                validation_parts.append(tokenize_dataset(raw["validation"], tokenizer, args, "validation"))
    if args.validation_file:  # read (and so checked) even when not evaluated
        validation_file = _load_file("validation_file", args.validation_file)
        if eval_requested_by:
            validation_parts.append(tokenize_dataset(validation_file, tokenizer, args, "validation"))
    validation = None
    if eval_requested_by:
        if not validation_parts:
            raise _no_validation(eval_requested_by)
        validation = datasets.concatenate_datasets(validation_parts)
        if extra.max_eval_samples is not None:
            validation = validation.select(range(min(extra.max_eval_samples, len(validation))))
    weights = [s.weight for s in sources] if sources[0].weight is not None else None
    train, taken = mix(train_parts, weights, seed=seed, stopping_strategy=extra.mixture_stopping_strategy)
    manifest = _manifest(sources, train_parts, taken, extra, seed=seed)
    manifest.update(train_examples=len(train), validation_examples=None if validation is None else len(validation))
    return PreparedData(train, validation, manifest, unused_validation=has_validation and not eval_requested_by)


def _no_validation(eval_requested_by: str) -> UserError:
    return UserError(
        f"{eval_requested_by}: there is no validation data; pass --validation_file, a --dataset_name with a "
        "validation split, or --validation_split_percentage N to carve one from the training data"
    )


def _manifest(sources: list[Source], parts: list[datasets.Dataset], taken: list[int], extra: SourceArguments, *,
              seed: int) -> dict[str, Any]:
    weighted = sources[0].weight is not None
    return {
        "sources": [
            {source.flag: source.name, "weight": source.weight, "examples": len(part), "examples_taken": n}
            for source, part, n in zip(sources, parts, taken, strict=True)
        ],
        "mixing": "single" if len(sources) == 1 else "interleave" if weighted else "concatenate",
        "stopping_strategy": extra.mixture_stopping_strategy if weighted else None,
        "seed": seed,
    }


def mix(parts: list[datasets.Dataset], weights: list[float] | None, *, seed: int,
        stopping_strategy: str = "first_exhausted") -> tuple[datasets.Dataset, list[int]]:
    """The mixed dataset and the number of examples taken from each part."""
    if len(parts) == 1:
        return parts[0], [len(parts[0])]
    tagged = [part.add_column(SOURCE_COLUMN, [i] * len(part)) for i, part in enumerate(parts)]
    if weights is None:
        mixed = datasets.concatenate_datasets(tagged)
    else:
        mixed = datasets.interleave_datasets(tagged, probabilities=weights, seed=seed,
                                             stopping_strategy=stopping_strategy)
    origin = mixed[SOURCE_COLUMN]
    taken = [0] * len(parts)
    for index in origin:
        taken[index] += 1
    return mixed.remove_columns(SOURCE_COLUMN), taken


def _carve_validation(train: datasets.Dataset, percentage: float, seed: int, source: Source) -> datasets.DatasetDict:
    try:
        split = train.train_test_split(test_size=percentage / 100, seed=seed)
    except ValueError as error:  # e.g. too few rows for a non-empty test split
        raise UserError(f"--validation_split_percentage {percentage:g}: --{source.flag} {source.name}: "
                        f"{' '.join(str(error).split())}") from None
    return datasets.DatasetDict({"train": split["train"], "validation": split["test"]})


@contextlib.contextmanager
def _naming(source: Source, several: bool):
    """With several sources, errors about a source's rows say which source."""
    try:
        yield
    except UserError as error:
        if not several:
            raise
        raise UserError(f"--{source.flag} {source.name}: {error}") from None


def describe(manifest: dict[str, Any]) -> str:
    """One line for the log: what each source contributed."""
    parts = []
    for entry in manifest["sources"]:
        name = entry.get("train_file") or entry.get("dataset_name")
        share = f" weight {entry['weight']:.3g}" if entry["weight"] is not None else ""
        parts.append(f"{name}{share}: {entry['examples_taken']} of {entry['examples']} examples")
    return f"hf_scale: data mixture ({manifest['mixing']}): " + "; ".join(parts)


def announce(manifest: dict[str, Any]) -> None:
    if manifest["mixing"] != "single":
        print(describe(manifest), file=sys.stderr, flush=True)
