"""`hf-scale check --plan PLAN.json`: the time a stop and a collective need, from the planner's prediction (the
recommended candidate of `hf-scale plan --json`: its step and checkpoint save), against what the launch files allow.

* `grace-period-short`: a manifest's terminationGracePeriodSeconds is shorter than the predicted step + save (the
  pod is killed while the checkpoint is written).
* `signal-lead-short`: an sbatch's `--signal=USR1@N` comes less than the predicted step + save before the time limit.
* `collective-timeout-short`: the process group's timeout (train.py's --ddp_timeout, HF's default 1800 s) or the
  DeepSpeed one (DEEPSPEED_TIMEOUT, minutes) is shorter than the predicted step or save: ranks waiting in a
  collective for the slowest one, or for the ranks writing the checkpoint, are killed by the watchdog.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

from hf_scale.check.findings import ERROR, WARNING, Finding
from hf_scale.check.inputs import CheckInputs
from hf_scale.errors import UserError
from hf_scale.files.reading import read_text

DDP_TIMEOUT_DEFAULT_S = 1800
"""transformers' TrainingArguments.ddp_timeout: the process group train.py creates (hf_scale.train.prepare)."""
_SIGNAL = re.compile(r"^#SBATCH\s+--signal[= ](?:[BR]:)*\w*@(\d+)\s*$", re.MULTILINE)


def plan_times(path: str) -> tuple[float, float, str]:
    """(step seconds, save seconds, candidate label) of the recommended candidate in `hf-scale plan --json`'s output
    ``path``, or a one-line UserError."""
    flag = f"--plan {path}"
    try:
        data = json.loads(read_text(Path(path), "--plan", expected="the output of `hf-scale plan --json`"))
        best = next(c for c in data["candidates"] if c["key"] == data["recommended"])
        step, save = float(best["time"]["step_s"]), float(best["time"]["save_s"])
    except (ValueError, KeyError, TypeError, StopIteration):
        raise UserError(f"{flag}: not the output of `hf-scale plan --json` with a recommendation (candidates, "
                        "recommended and each candidate's time.step_s and time.save_s)") from None
    if not (math.isfinite(step) and math.isfinite(save) and step > 0 and save >= 0):
        raise UserError(f"{flag}: time.step_s {step!r} / time.save_s {save!r} is invalid: allowed positive seconds")
    return step, save, str(best.get("label", best["key"]))


def sbatch_signal_lead(text: str) -> int | None:
    """Seconds of the sbatch's `#SBATCH --signal=[B:]SIG@N` (None without one)."""
    found = _SIGNAL.findall(text)
    return int(found[-1]) if found else None


def _need(step: float, save: float) -> int:
    return math.ceil(step + save)


def manifest_budgets(paths: list[str]) -> list[tuple[str, int | None, dict[str, str]]]:
    """(manifest, terminationGracePeriodSeconds or None for a SkyPilot task, its environment) of each job given (the
    smallest grace of its pods; Kubernetes' default where none is written). Files check_manifest refuses or cannot
    read are skipped here: it reports them."""
    from hf_scale.check.manifest_facts import manifest_facts
    from hf_scale.clusters import recognised_manifest
    from hf_scale.files.reading import load_yaml_documents

    out = []
    for path in paths:
        for data in load_yaml_documents(read_text(Path(path), "--manifest"), f"--manifest {path}"):
            try:
                facts = manifest_facts(recognised_manifest(data), data)
            except (AttributeError, TypeError, ValueError, UserError):
                continue
            out.append((path, facts.grace, dict(facts.env)))
    return out


def check_time_budget(plan: str, inp: CheckInputs, *, manifests: list[tuple[str, int | None, dict[str, str]]],
                      sbatches: list[str]) -> Iterator[Finding]:
    """The three findings of this module for the prediction in ``plan``; ``manifests``: :func:`manifest_budgets`;
    ``sbatches``: sbatch files."""
    from hf_scale.planner.budgets import preemption_budget_s

    step, save, label = plan_times(plan)
    need = _need(step, save)
    basis = f"the predicted step {step:.0f} s + save {save:.0f} s of {label} ({plan})"
    budget = preemption_budget_s(step, save)
    for path, grace, _ in manifests:
        if grace is not None and grace < need:
            yield Finding(WARNING, "grace-period-short", path, "terminationGracePeriodSeconds",
                          f"a grace period of {grace} s is shorter than {basis}: the pod is killed while the "
                          "checkpoint is written", f"set terminationGracePeriodSeconds >= {budget['grace']} (what "
                          "`hf-scale generate --strategy auto` writes)",
                          {f"{path}:terminationGracePeriodSeconds": grace})
    for path in sbatches:
        lead = sbatch_signal_lead(read_text(Path(path), "--sbatch", expected="an sbatch script"))
        if lead is not None and lead < need:
            yield Finding(WARNING, "signal-lead-short", path, "#SBATCH --signal",
                          f"--signal=USR1@{lead} asks for a checkpoint {lead} s before the time limit, less than "
                          f"{basis}: the job is killed while it saves",
                          f"set #SBATCH --signal=USR1@{budget['lead']}", {f"{path}:--signal": lead})
    yield from _collective_timeouts(inp, manifests, step, save, basis)


def _collective_timeouts(inp: CheckInputs, manifests: list[tuple[str, int | None, dict[str, str]]], step: float,
                         save: float, basis: str) -> Iterator[Finding]:
    longest = max(step, save)
    what = "a step" if step >= save else "a checkpoint save"
    timeouts = []
    given = inp.training is not None and "ddp_timeout" in inp.training_given
    ddp = int(inp.training["ddp_timeout"]) if given else DDP_TIMEOUT_DEFAULT_S
    timeouts.append(("training args" if given else "train.py", "--ddp_timeout", ddp,
                     f"pass -- --ddp_timeout {math.ceil(2 * longest)} to train.py"))
    # DeepSpeed reads DEEPSPEED_TIMEOUT (minutes; deepspeed.constants.default_pg_timeout) where it creates the
    # process group: only a run with a DeepSpeed config is concerned
    if inp.deepspeed is not None:
        for path, _, env in manifests:
            if env.get("DEEPSPEED_TIMEOUT", "").isdigit():
                timeouts.append((path, "DEEPSPEED_TIMEOUT", 60 * int(env["DEEPSPEED_TIMEOUT"]),
                                 f"set DEEPSPEED_TIMEOUT={math.ceil(2 * longest / 60)} (minutes) in its env"))
    for file, key, seconds, fix in timeouts:
        if seconds < longest:
            yield Finding(ERROR, "collective-timeout-short", file, key,
                          f"the collective timeout {key} = {seconds} s is shorter than {what} ({basis}): ranks "
                          "waiting in a collective are stopped by the watchdog", fix, {f"{file}:{key}": seconds})
