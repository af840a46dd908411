"""Which Kaggle credential a session's own API calls use, chosen and proven before any work.

Inside a Kaggle notebook session the clients of Kaggle's images sign in with the session's own access token
whenever it is there, whatever secrets are attached:
- kagglesdk's `get_access_token_from_env` returns the file named by KAGGLE_API_V1_TOKEN when KAGGLE_KERNEL_RUN_TYPE
  and KAGGLE_DATA_PROXY_URL are set (kagglesdk 0.1.38 kaggle_env.py L62-72, L91-95);
- the kaggle client tries that token before KAGGLE_USERNAME/KAGGLE_KEY (kaggle 2.2.4 kaggle_api_extended.py
  L1238-1244), and its HTTP client reads it again whenever it was given no token, so even a client that chose the
  key sends the token (kagglesdk kaggle_http_client.py L264-276);
- kagglehub does the same (kagglehub 1.0.3 config.py L66-73).
So the attached key is used only where the token is hidden from the process. Whether that token may write a
private dataset in a batch session is not verified (docs/kaggle-api.md, "Which credential publishes"), so a
session tries the token first, proves it with the calls a publish starts with, and falls back to the key.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.errors import UserError, describe_error, within

NOTEBOOK_TOKEN = "the notebook's token"
ATTACHED_KEY = "the attached key"
TOKEN_ENV = "KAGGLE_API_V1_TOKEN"  # names the file holding the session's own token
CREDENTIAL_NAMES = ("KAGGLE_USERNAME", "KAGGLE_KEY")
_hidden_token: dict[str, str] = {}  # the token's variable while the key is in use
# How a train session that cannot publish, and whose checkpoints would be lost, starts its one error line (the chain
# reads it back from the log: no later session would do better until the user attaches the key).
CANNOT_PUBLISH = "this session cannot publish its checkpoints"
PROVE_TIMEOUT_S = 120.0  # the proof's calls (sign-in, status, upload start): kagglesdk sets no timeout of its own


def notebook_token_present() -> bool:
    """Whether kagglesdk would sign in with the session's own token (its own rule, kaggle_env.py L62-95)."""
    path = os.environ.get(TOKEN_ENV) or _hidden_token.get(TOKEN_ENV)
    if not (os.environ.get("KAGGLE_KERNEL_RUN_TYPE") and os.environ.get("KAGGLE_DATA_PROXY_URL") and path):
        return False
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def use_credential(credential: str) -> None:
    """Make this process's Kaggle clients sign in with `credential`: the notebook's token, or the attached key
    (read from the secrets into the environment, never shown, with the token's variable hidden meanwhile)."""
    if credential == ATTACHED_KEY:
        secrets_to_env()
        if TOKEN_ENV in os.environ:
            _hidden_token[TOKEN_ENV] = os.environ.pop(TOKEN_ENV)
    elif TOKEN_ENV in _hidden_token:
        os.environ[TOKEN_ENV] = _hidden_token.pop(TOKEN_ENV)


def kaggle_api(from_secrets: bool = True):
    """An authenticated KaggleApi. In a session the credentials come from the user's secrets (set into this
    process's environment, never printed). Raises UserError naming what is missing."""
    if from_secrets:
        secrets_to_env()
    import contextlib
    import io

    quiet = io.StringIO()  # `import kaggle` authenticates and prints a page of help when that fails
    try:
        with contextlib.redirect_stdout(quiet):
            from kaggle.api.kaggle_api_extended import KaggleApi
    except ImportError as err:
        raise UserError(f"the kaggle package is not installed ({err})") from None
    api = KaggleApi()
    try:
        with contextlib.redirect_stdout(quiet):
            api.authenticate()
    except SystemExit:
        raise UserError("Kaggle credentials not found: set KAGGLE_USERNAME and KAGGLE_KEY (or ~/.kaggle/kaggle.json; "
                        "in a kernel: the Kaggle secrets KAGGLE_USERNAME and KAGGLE_KEY)") from None
    return api


def secrets_to_env() -> None:
    """In a session, the user's Kaggle credentials from its secrets into this process's environment (where the
    kaggle client and kagglehub read them; never printed)."""
    from shared.kaggle.env import in_session
    from shared.kaggle.secrets import get_secret

    if in_session():
        for name in CREDENTIAL_NAMES:
            if not os.environ.get(name):
                os.environ[name] = get_secret(name)


def missing_secrets() -> list[str]:
    """Which of KAGGLE_USERNAME and KAGGLE_KEY can be read neither from the environment nor the secrets."""
    from shared.kaggle.secrets import get_secret

    missing = []
    for name in CREDENTIAL_NAMES:
        try:
            os.environ.get(name) or get_secret(name)
        except UserError:
            missing.append(name)
    return missing


def key_attached() -> bool:
    """Whether both KAGGLE_USERNAME and KAGGLE_KEY can be read (environment or the notebook's secrets)."""
    return not missing_secrets()


def no_credential_problem() -> str | None:
    """Why this session has no credential at all (no token of its own, a secret not attached), else None."""
    missing = [] if notebook_token_present() else missing_secrets()
    if not missing:
        return None
    many = len(missing) > 1
    return (f"the secret{'s' if many else ''} {', '.join(missing)} {'are' if many else 'is'} not attached to this "
            f"notebook: attach {'them' if many else 'it'} on the notebook's page (Add-ons > Secrets)")


def candidates() -> list[str]:
    """The credentials this session has, in the order the clients would use them."""
    return ([NOTEBOOK_TOKEN] if notebook_token_present() else []) + ([ATTACHED_KEY] if key_attached() else [])


def refused(err: BaseException) -> bool:
    """Whether an API error is the server refusing the credential (401, 403), not a fault to retry."""
    return getattr(getattr(err, "response", None), "status_code", None) in (401, 403)


def prove_dataset_write(api, dataset: str) -> None:
    """The calls a checkpoint publish starts with, made with `api`'s credential: the private dataset's status (a
    404 here means the credential does not see it: the chain created it before any session) and the start of a
    blob upload, which names no dataset and uploads nothing (the token it returns expires unused)."""
    from kagglesdk.blobs.types.blob_api_service import ApiBlobType, ApiStartBlobUploadRequest

    api.dataset_status(dataset)
    request = ApiStartBlobUploadRequest()
    request.type = ApiBlobType.DATASET
    request.name = "gpt2k-credential-check"
    request.content_length = 1
    request.last_modified_epoch_seconds = 0
    with api.build_kaggle_client() as kaggle:
        kaggle.blobs.blob_api_client.start_blob_upload(request)


def choose_credential(dataset: str, log=print) -> tuple[str | None, str | None]:
    """(the credential that proved it can publish to `dataset`, None) or (None, why none can). Each is tried in
    the clients' own order; a credential refused (or failing) is one line, and the next is tried."""
    tried = candidates()
    if not tried:
        return None, no_credential_problem()
    reasons = []
    for credential in tried:
        use_credential(credential)
        try:
            within(PROVE_TIMEOUT_S, lambda: prove_dataset_write(kaggle_api(from_secrets=False), dataset))
        except Exception as err:  # the API's own types, or a UserError from sign-in: one line, secrets masked
            status = getattr(getattr(err, "response", None), "status_code", None)
            why = f"HTTP {status}" if status else describe_error(err, secret_values())
            reasons.append(f"{credential}: {why}")
            log(f"notice: {credential} cannot publish to {dataset} ({why})")
            continue
        return credential, None
    return None, f"no credential can publish to {dataset} ({'; '.join(reasons)})"


def secret_values() -> list[str]:
    """What an error message must never show: the key (where it is in the environment) and the notebook's token."""
    values = [os.environ.get(name, "") for name in CREDENTIAL_NAMES]
    path = os.environ.get(TOKEN_ENV) or _hidden_token.get(TOKEN_ENV)
    try:
        values.append(Path(path).read_text().strip() if path else "")
    except OSError:
        pass
    return [v for v in values if v]
