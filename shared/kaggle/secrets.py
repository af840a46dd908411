"""The user's secrets (Kaggle Secrets in a session, the local Kaggle's store locally, the environment elsewhere):
read where needed, recorded by name only (never value) in the session's facts for `--smoke`'s report."""

from __future__ import annotations

import json
import os

from shared.errors import UserError
from shared.kaggle.env import LOCAL_SECRETS_ENV, is_kaggle, is_local_kaggle
from shared.kaggle.facts import record_fact


def get_secret(name: str) -> str:
    """A user secret (see `_read_secret`); whether it was found goes to the session's facts, its value nowhere."""
    try:
        value = _read_secret(name)
    except UserError:
        record_fact("secrets", name, False)
        raise
    record_fact("secrets", name, True)
    return value


def find_secret(name: str) -> str | None:
    """A user secret that may well be absent (one of two ways to give a credential): its value, recorded as found;
    None where it cannot be read, recorded nowhere (the user may have given the other)."""
    try:
        value = _read_secret(name)
    except UserError:
        return None
    record_fact("secrets", name, True)
    return value


def wandb_key() -> str | None:
    """The W&B key: WANDB_API_KEY from the environment, else the user's secret of that name; None without one."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        return get_secret("WANDB_API_KEY")
    except Exception:  # not attached, or no secrets service: W&B stays off, with a notice from the logger
        return None


def _read_secret(name: str) -> str:
    """A user secret: Kaggle Secrets on Kaggle, the local Kaggle's store locally.

    Outside any Kaggle session the environment variable of the same name is used, so tools run on a
    workstation can be given the same secrets. A missing secret is a UserError naming it, never its value.
    """
    if is_local_kaggle():
        path = os.environ.get(LOCAL_SECRETS_ENV)
        values: dict = {}
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    values = json.load(f)
            except (OSError, ValueError):
                values = {}
        if name not in values:
            raise UserError(f"secret {name!r} is not attached to this notebook in the local Kaggle")
        return str(values[name])
    if is_kaggle():
        try:
            from kaggle_secrets import UserSecretsClient  # only exists on Kaggle
        except ImportError as err:
            raise UserError("kaggle_secrets is not importable in this Kaggle session") from err
        try:
            value = UserSecretsClient().get_secret(name)
        except Exception as err:  # the client raises its own types; never echo their payloads
            raise UserError(
                f"secret {name!r} could not be read: attach it to this notebook (Add-ons > Secrets)"
                f" ({type(err).__name__})"
            ) from None
        if value is None:
            raise UserError(f"secret {name!r} is empty or not attached to this notebook")
        return value
    value = os.environ.get(name)
    if value is None:
        raise UserError(f"secret {name!r} is not set (outside Kaggle, secrets come from the environment)")
    return value


def hf_token_to_env() -> bool:
    """In a session, the user's Hugging Face token (a secret named HF_TOKEN, optional) into the environment, where
    huggingface_hub reads it: the Hub's per-account limits instead of the anonymous per-IP ones, which Kaggle's
    shared outgoing addresses may spend. Whether a token is in use; its value is never printed."""
    from shared.kaggle.env import in_session

    if os.environ.get("HF_TOKEN"):
        return True
    if not in_session():
        return False
    try:
        os.environ["HF_TOKEN"] = get_secret("HF_TOKEN")
    except UserError:
        return False
    return True
