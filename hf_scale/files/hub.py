"""Pushing a finished model directory to the Hugging Face Hub, for train.py (`--push_to_hub`) and
`hf-scale export --push-to-hub REPO_ID` alike: one `huggingface_hub` upload of the directory, after
it was saved and checked.

What can be checked locally is checked before any work starts (repository id, offline mode, a token);
train.py also creates the repository up front, as the Trainer does, so a missing write permission
stops the run before training rather than after it. The endpoint is huggingface_hub's (`HF_ENDPOINT`),
the token `--hub_token`, else `HF_TOKEN`, else the one saved by `hf auth login`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_scale.errors import UserError


@dataclass(frozen=True)
class HubTarget:
    repo_id: str
    """As given (`name` or `namespace/name`); :func:`create_repo` returns the full id."""
    token: str | None = None
    private: bool | None = None
    revision: str | None = None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or os.environ.get(
        "TRANSFORMERS_OFFLINE", ""
    ).upper() in ("1", "ON", "YES", "TRUE")


def check_target(target: HubTarget, flag: str) -> None:
    """Everything that can be known without the network; one line each."""
    from huggingface_hub.utils import HFValidationError, get_token, validate_repo_id

    try:
        validate_repo_id(target.repo_id)
    except HFValidationError as error:
        raise UserError(f"{flag} {target.repo_id}: not a Hub repository id ({error})") from None
    if _offline():
        raise UserError(f"{flag} {target.repo_id}: the Hub is switched off here (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE "
                        "is set); unset it to push")
    if not (target.token or get_token()):
        raise UserError(f"{flag} {target.repo_id}: no Hub token; set HF_TOKEN or log in with `hf auth login`")


def _hub_error(flag: str, repo_id: str, error: Exception) -> UserError:
    return UserError(f"{flag} {repo_id}: the Hub refused or could not be reached: {' '.join(str(error).split())[:300]}")


def create_repo(target: HubTarget, flag: str) -> str:
    """Create the repository if it does not exist (exist_ok); returns its full id (namespace/name)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        url = HfApi().create_repo(target.repo_id, token=target.token, private=target.private, exist_ok=True)
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise _hub_error(flag, target.repo_id, error) from None
    return url.repo_id


def push_folder(folder: Path, target: HubTarget, flag: str, *, message: str, ignore: Sequence[str] = ()) -> str:
    """Upload `folder` in one commit, without the files matching the globs `ignore` (what of a training output
    directory is not the model: hf_scale.contract.checkpoint_layout.TRAINING_STATE_GLOBS); returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    repo_id = create_repo(target, flag)
    print(f"hf_scale: pushing {folder} to the Hub repository {repo_id}", file=sys.stderr, flush=True)
    try:
        commit = HfApi().upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=message,
            token=target.token,
            revision=target.revision,
            ignore_patterns=list(ignore),
        )
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise _hub_error(flag, repo_id, error) from None
    print(f"hf_scale: pushed to {commit.commit_url}", file=sys.stderr, flush=True)
    return commit.commit_url


def training_target(args, output_dir: str) -> HubTarget | None:
    """train.py's Hub target from the Trainer's flags (`--hub_model_id`, default: the output directory's name)."""
    if not args.push_to_hub:
        return None
    return HubTarget(
        repo_id=args.hub_model_id or Path(output_dir).absolute().name,
        token=args.hub_token,
        private=args.hub_private_repo,
        revision=getattr(args, "hub_revision", None),
    )
