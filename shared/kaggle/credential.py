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
session tries the token first: what Kaggle says of it (IntrospectToken's `scope` and `exp`) must cover a dataset
write until the session's end, and it is proven with the calls a publish starts with; else the key is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from shared.errors import UserError, describe_error, duration_text, within
from shared.kaggle.calls import kaggle_call
from shared.session_clock import seconds_left

NOTEBOOK_TOKEN = "the notebook's token"
ATTACHED_KEY = "the attached key"
TOKEN_ENV = "KAGGLE_API_V1_TOKEN"  # names the file holding the session's own token
CREDENTIAL_NAMES = ("KAGGLE_USERNAME", "KAGGLE_KEY")
_hidden_token: dict[str, str] = {}  # the token's variable while the key is in use
# How a train session that cannot publish, and whose checkpoints would be lost, starts its one error line (the chain
# reads it back from the log: no later session would do better until the user attaches the key).
CANNOT_PUBLISH = "this session cannot publish its checkpoints"
PROVE_TIMEOUT_S = 120.0  # the proof's calls (sign-in, status, upload start): kagglesdk sets no timeout of its own
SIGN_IN_TIMEOUT_S = 120.0  # kaggle's sign-in: an IntrospectToken call wherever a token is found, with no timeout
# The one scope the sources show allowing dataset writes: what kaggle's own login asks for, "all ApiV1 endpoints"
# (kaggle 2.2.4 kaggle_api_extended.py L1603-1604). What scope a notebook's token carries is not verified.
WRITE_SCOPES = ("resources.admin:*",)
_EXTENDED = "kaggle.api.kaggle_api_extended"


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
    process's environment, never printed). Raises UserError naming what is missing, or after SIGN_IN_TIMEOUT_S
    without an answer; a transient fault (a 5xx on IntrospectToken) is tried again (`kaggle_call`). Nothing is
    printed but a notice of each such retry, and sys.stdout is never swapped: a thread may call it while the
    trainer prints."""
    if from_secrets:
        secrets_to_env()
    try:
        return kaggle_call(_signed_in, "signing in to Kaggle", timeout_s=SIGN_IN_TIMEOUT_S)
    except UserError as err:
        if str(err).startswith("no answer within"):
            raise UserError(f"signing in to Kaggle: {err}") from None
        raise


def _signed_in():
    try:
        api = kaggle_api_class()()
    except ImportError as err:
        raise UserError(f"the kaggle package is not installed ({err})") from None
    try:
        api.authenticate()
    except SystemExit:
        raise UserError("Kaggle credentials not found: set KAGGLE_USERNAME and KAGGLE_KEY (or ~/.kaggle/kaggle.json; "
                        "in a kernel: the Kaggle secrets KAGGLE_USERNAME and KAGGLE_KEY)") from None
    return api


def kaggle_api_class() -> type:
    """kaggle's KaggleApi, with the page of help its failed sign-in prints on stdout (`print_auth_help`) made
    silent. `import kaggle` signs in at import time (kaggle 2.2.4 kaggle/__init__.py L7-11), and every failed
    `authenticate()` prints that page before exit(1) (kaggle_api_extended.py L841-843, L1251-1252), so it is
    replaced as the module loads, before the import-time sign-in runs."""
    module = sys.modules.get(_EXTENDED)
    if module is None:
        hook = _SilentHelp()
        sys.meta_path.insert(0, hook)
        try:
            module = importlib.import_module(_EXTENDED)
        finally:
            sys.meta_path.remove(hook)
    module.print_auth_help = _no_help
    return module.KaggleApi


def _no_help() -> None:
    """kaggle's `print_auth_help`, silent: the caller's UserError says what is missing, in one line."""


class _SilentHelp(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads kaggle_api_extended as its own finder would, then silences its `print_auth_help`."""

    def find_spec(self, name, path, target=None):
        if name != _EXTENDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.print_auth_help = _no_help


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


def prove_dataset_write(api, dataset: str) -> None:
    """The calls a checkpoint publish starts with, made with `api`'s credential: the private dataset's status (a
    404 here means the credential does not see it: the chain created it before any session) and the start of a
    blob upload, which names no dataset and uploads nothing (the token it returns expires unused)."""
    from kagglesdk.blobs.types.blob_api_service import ApiBlobType, ApiStartBlobUploadRequest

    kaggle_call(lambda: api.dataset_status(dataset), f"reading the status of {dataset}", timeout_s=PROVE_TIMEOUT_S)
    request = ApiStartBlobUploadRequest()
    request.type = ApiBlobType.DATASET
    request.name = "gpt2k-credential-check"
    request.content_length = 1
    request.last_modified_epoch_seconds = 0

    def start() -> None:
        with api.build_kaggle_client() as kaggle:
            kaggle.blobs.blob_api_client.start_blob_upload(request)

    kaggle_call(start, "starting a blob upload", timeout_s=PROVE_TIMEOUT_S)


@dataclass(frozen=True)
class TokenFacts:
    """What Kaggle's IntrospectToken says of a token (kagglesdk 0.1.38 security/types/oauth_service.py L360-480)."""

    active: bool
    scope: str  # space-separated scopes; "" where the reply names none
    expires: int  # `exp`, unix time; 0 where the reply names none


def introspect_token(api) -> TokenFacts:
    """IntrospectToken for the notebook's token, signed in with it, as kaggle's own sign-in calls it (kaggle 2.2.4
    kaggle_api_extended.py L1347-1352); the reply's `scope` and `exp`, which that sign-in drops."""
    from kagglesdk.security.types.oauth_service import IntrospectTokenRequest

    request = IntrospectTokenRequest()
    request.token = _token_text()

    def introspect():
        with api.build_kaggle_client() as kaggle:
            return kaggle.security.oauth_client.introspect_token(request)

    reply = kaggle_call(introspect, "reading the notebook's token", timeout_s=PROVE_TIMEOUT_S)
    return TokenFacts(bool(reply.active), reply.scope or "", int(reply.exp or 0))


def token_shortfall(facts: TokenFacts, needed_until: float | None) -> str | None:
    """Why the token cannot be the one that publishes, where what Kaggle says of it shows that: not active, a scope
    that names none of WRITE_SCOPES, an expiry before `needed_until` (unix time: the session's last publish may run
    until then). None where it says nothing against it: no scope or no expiry named is no reason."""
    if not facts.active:
        return "Kaggle says it is not active"
    scopes = facts.scope.split()
    if scopes and not set(scopes) & set(WRITE_SCOPES):
        return f"its scope ({facts.scope}) lacks {WRITE_SCOPES[0]}, the one known to allow dataset writes"
    if facts.expires and needed_until and facts.expires < needed_until:
        return (f"it expires at {_utc(facts.expires)}, {duration_text(needed_until - facts.expires)} before the "
                "session's last publish may end")
    return None


def publish_until(deadline_s: float | None, publish_s: float = 0.0) -> float | None:
    """The unix time until which this session may still publish: its deadline (counted from the process's start,
    as the trainer counts it: shared/session_clock.py) plus the chain's publish margin, after which it is killed;
    None without a deadline."""
    if not deadline_s:
        return None
    return time.time() + seconds_left(float(deadline_s) + float(publish_s or 0))


def choose_credential(dataset: str, log=print, needed_until: float | None = None) -> tuple[str | None, str | None]:
    """(the credential that proved it can publish to `dataset`, None) or (None, why none can). Each is tried in
    the clients' own order; the notebook's token only where what Kaggle says of it covers a dataset write until
    `needed_until` (`token_shortfall`). A credential refused, failing or falling short is one line, and the next
    is tried."""
    tried = candidates()
    if not tried:
        return None, no_credential_problem()
    reasons = []
    for credential in tried:
        use_credential(credential)
        try:
            short = within(PROVE_TIMEOUT_S, partial(_prove, credential, dataset, needed_until, log))
        except Exception as err:  # the API's own types, or a UserError from sign-in: one line, secrets masked
            status = getattr(getattr(err, "response", None), "status_code", None)
            short = f"HTTP {status}" if status else describe_error(err, secret_values())
        if short:
            reasons.append(f"{credential}: {short}")
            log(f"notice: {credential} cannot publish to {dataset} ({short})")
            continue
        return credential, None
    return None, f"no credential can publish to {dataset} ({'; '.join(reasons)})"


def _prove(credential: str, dataset: str, needed_until: float | None, log) -> str | None:
    """Sign in with `credential`; for the notebook's token, what Kaggle says of it (one line, then its shortfall,
    if any); then the calls a publish starts with. None where all pass."""
    api = kaggle_api(from_secrets=False)
    if credential == NOTEBOOK_TOKEN:
        facts = introspect_token(api)
        expiry = _utc(facts.expires) if facts.expires else "not stated"
        log(f"{NOTEBOOK_TOKEN}: scope {facts.scope or 'not stated'}, expires {expiry}")
        short = token_shortfall(facts, needed_until)
        if short:
            return short
    prove_dataset_write(api, dataset)
    return None


def key_takes_over(credential: str | None) -> bool:
    """Whether a publish that failed with `credential` (None: whatever the clients chose) is made again with the
    attached key: it was the notebook's token, and the key is attached."""
    token_used = credential == NOTEBOOK_TOKEN or (credential is None and notebook_token_present())
    return token_used and key_attached()


def _utc(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _token_text() -> str:
    """The notebook's token (never shown), "" where there is none."""
    path = os.environ.get(TOKEN_ENV) or _hidden_token.get(TOKEN_ENV)
    try:
        return Path(path).read_text().strip() if path else ""
    except OSError:
        return ""


def secret_values() -> list[str]:
    """What an error message must never show: the key (where it is in the environment) and the notebook's token."""
    values = [os.environ.get(name, "") for name in CREDENTIAL_NAMES] + [_token_text()]
    return [v for v in values if v]
