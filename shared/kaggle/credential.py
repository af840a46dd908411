"""Which Kaggle credential a session's own API calls use, chosen and proven before any work.

Inside a Kaggle notebook session the clients of Kaggle's images sign in with the session's own access token
whenever it is there, whatever secrets are attached:
- kagglesdk's `get_access_token_from_env` returns the file named by KAGGLE_API_V1_TOKEN when KAGGLE_KERNEL_RUN_TYPE
  and KAGGLE_DATA_PROXY_URL are set, then KAGGLE_API_TOKEN, then ~/.kaggle/access_token (kagglesdk 0.1.38
  kaggle_env.py L62-72, L91-113);
- the kaggle client tries that token before KAGGLE_USERNAME/KAGGLE_KEY (kaggle 2.2.4 kaggle_api_extended.py
  L1238-1244), and its HTTP client reads it again whenever it was given no token, so even a client that chose the
  key sends the token (kagglesdk kaggle_http_client.py L264-276);
- kagglehub does the same (kagglehub 1.0.3 config.py L66-73).
So an attached credential is used only where what comes before it is hidden from the process. The user's own
credential is a new-style API token (KGAT_..., Kaggle's settings page makes these by default; sent as a bearer
token), attached as the secret KAGGLE_API_TOKEN, or a legacy key (KAGGLE_USERNAME and KAGGLE_KEY, basic auth).

What a notebook's token may do (its scope, its lifetime) is not verified (docs/kaggle-api.md, "Which credential
publishes"), so no guess about it refuses it: each credential is proven by a real, harmless write to the checkpoint
dataset (its metadata written back as it is), and refused only where Kaggle refuses that write or says the token is
not `active`. Its scope and expiry are named in the line that names it; one that expires before the session's last
publish is a notice, and it is proven again just before each publish, with the next credential as the fallback.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UserError, describe_error, duration_text
from shared.kaggle.calls import kaggle_call
from shared.session_clock import seconds_left

NOTEBOOK_TOKEN = "the notebook's token"
ATTACHED_TOKEN = "the attached API token"
ATTACHED_KEY = "the attached key"
TOKEN_ENV = "KAGGLE_API_V1_TOKEN"  # names the file holding the session's own token
API_TOKEN_ENV = "KAGGLE_API_TOKEN"  # the user's new-style API token (kagglesdk kaggle_env.py L97-104)
API_TOKEN_PREFIX = "KGAT_"  # how Kaggle's new-style API tokens begin
CREDENTIAL_NAMES = ("KAGGLE_USERNAME", "KAGGLE_KEY")  # a legacy key
TOKEN_NAMES = (API_TOKEN_ENV,)  # a new-style API token
_hidden: dict[str, str] = {}  # variables hidden from the clients while a credential after them is in use
# How a train session that cannot publish, and whose checkpoints would be lost, starts its one error line (the chain
# reads it back from the log: no later session would do better until the user attaches the key).
CANNOT_PUBLISH = "this session cannot publish its checkpoints"
PROVE_TIMEOUT_S = 120.0  # the proof's calls (sign-in, introspection, metadata read and write): no timeout of their own
SIGN_IN_TIMEOUT_S = 120.0  # kaggle's sign-in: an IntrospectToken call wherever a token is found, with no timeout
_EXTENDED = "kaggle.api.kaggle_api_extended"


def notebook_token_present() -> bool:
    """Whether kagglesdk would sign in with the session's own token (its own rule, kaggle_env.py L62-95)."""
    path = os.environ.get(TOKEN_ENV) or _hidden.get(TOKEN_ENV)
    if not (os.environ.get("KAGGLE_KERNEL_RUN_TYPE") and os.environ.get("KAGGLE_DATA_PROXY_URL") and path):
        return False
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def use_credential(credential: str) -> None:
    """Make this process's Kaggle clients sign in with `credential` (in a session): the notebook's token; the
    attached API token (KAGGLE_API_TOKEN, which the clients read after the notebook's token); or the attached key
    (KAGGLE_USERNAME/KAGGLE_KEY, which they read after both). Values come from the secrets, never shown; what
    would come first is hidden meanwhile, the only way to make the clients pass it over."""
    if credential == NOTEBOOK_TOKEN:
        _show(TOKEN_ENV)
        return
    _hide(TOKEN_ENV)
    if credential == ATTACHED_TOKEN:
        _show(API_TOKEN_ENV)
        os.environ[API_TOKEN_ENV] = attached_api_token() or ""
    else:
        _hide(API_TOKEN_ENV)
        for name in CREDENTIAL_NAMES:
            os.environ[name] = os.environ.get(name) or _secret(name) or ""


def _hide(name: str) -> None:
    if name in os.environ:
        _hidden[name] = os.environ.pop(name)


def _show(name: str) -> None:
    if name in _hidden:
        os.environ[name] = _hidden.pop(name)


def key_as_token() -> None:
    """A new-style API token (KGAT_...) given as KAGGLE_KEY is sent as the bearer token it is: the kaggle client
    would send KAGGLE_KEY as basic auth (kagglesdk kaggle_http_client.py L277-284), which Kaggle refuses for such a
    token. Moved to KAGGLE_API_TOKEN, which the clients read first (kagglesdk kaggle_env.py L97-104)."""
    key = os.environ.get("KAGGLE_KEY", "")
    if key.startswith(API_TOKEN_PREFIX):
        del os.environ["KAGGLE_KEY"]
        os.environ.setdefault(API_TOKEN_ENV, key)


def kaggle_api(from_secrets: bool = True):
    """An authenticated KaggleApi. In a session the credentials come from the user's secrets (set into this
    process's environment, never printed). A new-style API token in KAGGLE_KEY (or kaggle.json's `key`) is sent as
    a bearer token. Raises UserError naming what is missing, or after SIGN_IN_TIMEOUT_S without an answer; a
    transient fault (a 5xx on IntrospectToken) is tried again (`kaggle_call`). Nothing is printed but a notice of
    each such retry, and sys.stdout is never swapped: a thread may call it while the trainer prints."""
    if from_secrets:
        secrets_to_env()
    key_as_token()
    try:
        return kaggle_call(_signed_in, "signing in to Kaggle", timeout_s=SIGN_IN_TIMEOUT_S)
    except UserError as err:
        if str(err).startswith("no answer within"):
            raise UserError(f"signing in to Kaggle: {err}") from None
        raise


def _signed_in():
    try:
        api = kaggle_api_class()()  # kaggle 2.0.2 signs in as it is imported, and exits where that fails
        api.authenticate()
    except ImportError as err:
        raise UserError(f"the kaggle package is not installed ({err})") from None
    except SystemExit:
        raise UserError("Kaggle credentials not found: set KAGGLE_API_TOKEN (an API token, from kaggle.com/settings"
                        "/api) or KAGGLE_USERNAME and KAGGLE_KEY (or ~/.kaggle/access_token, ~/.kaggle/kaggle.json; "
                        "in a kernel: the Kaggle secret KAGGLE_API_TOKEN, or KAGGLE_USERNAME and KAGGLE_KEY)"
                        ) from None
    _bearer_for_token_key(api)
    return api


def _bearer_for_token_key(api) -> None:
    """A new-style API token kept as kaggle.json's `key` is sent as a bearer token: the client passes its config's
    `token` as the bearer token, before the key (kaggle_api_extended.py L1663-1675, kaggle_http_client.py
    L272-275)."""
    config = getattr(api, "config_values", None)
    if isinstance(config, dict) and str(config.get("key", "")).startswith(API_TOKEN_PREFIX) and not config.get("token"):
        config["token"] = config["key"]


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
    _silence_help(module)
    return module.KaggleApi


def _silence_help(module) -> None:
    """kaggle 2.2's `print_auth_help` made silent; kaggle 2.0.2 (the CPU image's) prints its two lines of help
    inside `authenticate()` itself (kaggle_api_extended.py L763-773), so its module's `print` drops just those."""
    module.print_auth_help = _no_help
    module.print = _print_but_auth_help


def _no_help() -> None:
    """kaggle's `print_auth_help`, silent: the caller's UserError says what is missing, in one line."""


AUTH_HELP = ("You must authenticate before you can call the Kaggle API.", "Follow the instructions to authenticate",
             'Please run "kaggle auth login"')


def _print_but_auth_help(*args, **kwargs) -> None:
    if not (args and isinstance(args[0], str) and args[0].startswith(AUTH_HELP)):
        print(*args, **kwargs)


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
        _silence_help(module)


def _secret(name: str) -> str | None:
    """A user secret (in a session) or environment variable of that name; None where neither has it."""
    from shared.kaggle.env import in_session
    from shared.kaggle.secrets import find_secret

    if os.environ.get(name) or _hidden.get(name):
        return os.environ.get(name) or _hidden.get(name)
    return (find_secret(name) or None) if in_session() else None


def attached_api_token() -> str | None:
    """The user's new-style API token: KAGGLE_API_TOKEN (in a session, the secret of that name), or a KGAT_ value
    given as KAGGLE_KEY; None without one."""
    token = _secret(API_TOKEN_ENV)
    if token and Path(token).is_file():  # kagglesdk reads a path given there as the token's file (L99-100)
        token = Path(token).read_text().strip()
    key = _secret("KAGGLE_KEY") or ""
    return token or (key if key.startswith(API_TOKEN_PREFIX) else None)


def secrets_to_env() -> None:
    """In a session, the user's Kaggle credentials from its secrets into this process's environment (where the
    kaggle client and kagglehub read them; never printed): the API token, the legacy key, or both. Raises
    UserError where neither is attached."""
    from shared.kaggle.env import in_session

    if not in_session():
        return
    token = attached_api_token()
    if token and API_TOKEN_ENV not in _hidden:
        os.environ.setdefault(API_TOKEN_ENV, token)
    if key_attached():
        for name in CREDENTIAL_NAMES:
            os.environ[name] = os.environ.get(name) or _secret(name) or ""
    elif not token:
        raise UserError(no_credential_problem(token_counts=False) or "no Kaggle credential is attached")


def missing_secrets() -> list[str]:
    """Which of KAGGLE_USERNAME and KAGGLE_KEY (a legacy key) can be read neither from the environment nor the
    secrets; a KGAT_ value as KAGGLE_KEY is an API token, no legacy key."""
    missing = [name for name in CREDENTIAL_NAMES if not _secret(name)]
    if "KAGGLE_KEY" not in missing and (_secret("KAGGLE_KEY") or "").startswith(API_TOKEN_PREFIX):
        missing.append("KAGGLE_KEY")
    return missing


def key_attached() -> bool:
    """Whether a legacy key (KAGGLE_USERNAME and KAGGLE_KEY) can be read (environment or the notebook's secrets)."""
    return not missing_secrets()


def no_credential_problem(token_counts: bool = True) -> str | None:
    """Why this session has no credential at all (no token of its own, no API token or legacy key attached), else
    None; `token_counts`: whether the notebook's own token counts."""
    if (token_counts and notebook_token_present()) or attached_api_token() or key_attached():
        return None
    missing = missing_secrets()
    if len(missing) == 1:
        return (f"the secret {missing[0]} is not attached to this notebook: attach it on the notebook's page "
                f"(Add-ons > Secrets), or an API token as the secret {API_TOKEN_ENV}")
    return (f"no Kaggle credential is attached to this notebook: attach the secret {API_TOKEN_ENV} (an API "
            f"token), or {' and '.join(CREDENTIAL_NAMES)} (a legacy key), on the notebook's page (Add-ons > Secrets)")


def candidates() -> list[str]:
    """The credentials this session has, in the order the clients would use them. Where the user attached neither
    an API token nor a key, the secrets that would carry one are recorded as missing (the readiness report's)."""
    attached = ([ATTACHED_TOKEN] if attached_api_token() else []) + ([ATTACHED_KEY] if key_attached() else [])
    if not attached:
        from shared.kaggle.facts import record_fact

        for name in (*TOKEN_NAMES, *missing_secrets()):
            record_fact("secrets", name, False)
    return ([NOTEBOOK_TOKEN] if notebook_token_present() else []) + attached


def fallback_for(credential: str | None) -> str | None:
    """The credential to publish with where one with `credential` failed: the next this session has, else None."""
    have = candidates()
    return have[have.index(credential) + 1] if credential in have[:-1] else None


def credential_secrets(api=None) -> tuple[str, ...]:
    """The secrets that carry the credential this machine signs in with (`api`: a signed-in KaggleApi): the API
    token's name where it signs in with a token (KAGGLE_API_TOKEN, ~/.kaggle/access_token, or a KGAT_ key), else the
    legacy key's names."""
    config = getattr(api, "config_values", None) or {}
    return TOKEN_NAMES if config.get("token") else CREDENTIAL_NAMES


def prove_dataset_write(api, dataset: str) -> str | None:
    """A real, harmless write to `dataset` with `api`'s credential: its metadata read (GetDatasetMetadata) and
    written back as it is (UpdateDatasetMetadata: kagglesdk 0.1.38 datasets/services/dataset_api_service.py L59-81,
    the fields DatasetInfo and DatasetSettings share, datasets/types/dataset_types.py L711-743; kaggle's own
    `datasets metadata` and `--update` carry the same, kaggle 2.2.4 kaggle_api_extended.py L4744-4823, L4884-4910).
    A refusal raises the API's error (a 404 at the read: the credential does not see the dataset; the chain created
    it before any session). Where the reply does not say the dataset is private, nothing is written (writing back
    `isPrivate` false would publish a private one): -> why, for a notice; None where the write was made."""
    from kagglesdk.datasets.types.dataset_api_service import (
        ApiGetDatasetMetadataRequest,
        ApiUpdateDatasetMetadataRequest,
    )
    from kagglesdk.datasets.types.dataset_types import DatasetInfo, DatasetSettings

    owner, _, slug = dataset.partition("/")
    read = ApiGetDatasetMetadataRequest()
    read.owner_slug, read.dataset_slug = owner, slug

    def metadata(call):  # each call on a client of its own, tried again after a transient fault (`kaggle_call`)
        with api.build_kaggle_client() as kaggle:
            return call(kaggle.datasets.dataset_api_client)

    info = kaggle_call(lambda: metadata(lambda c: c.get_dataset_metadata(read)).info,
                       f"reading the metadata of {dataset}", timeout_s=PROVE_TIMEOUT_S)
    if info is None or not info.is_private:
        return "Kaggle's metadata of it does not say it is private, so none was written back"
    shared = {f.json_name for f in DatasetSettings._fields} & {f.json_name for f in DatasetInfo._fields}
    write = ApiUpdateDatasetMetadataRequest()
    write.owner_slug, write.dataset_slug = owner, slug
    write.settings = DatasetSettings.from_dict({k: v for k, v in info.to_dict().items() if k in shared})
    # Written back as it is: a retry after a write that landed writes the same again.
    errors = kaggle_call(lambda: metadata(lambda c: c.update_dataset_metadata(write)).errors,
                         f"writing the metadata of {dataset} back", timeout_s=PROVE_TIMEOUT_S)
    if errors:
        raise RuntimeError(f"Kaggle refused the metadata written back: {'; '.join(errors)}")
    return None


@dataclass(frozen=True)
class TokenFacts:
    """What Kaggle's IntrospectToken says of a token (kagglesdk 0.1.38 security/types/oauth_service.py L360-480)."""

    active: bool
    scope: str  # space-separated scopes; "" where the reply names none
    expires: int  # `exp`, unix time; 0 where the reply names none

    def terms(self) -> str:
        """Its scope and expiry, for the line that names the credential."""
        return (f"scope {self.scope or 'not stated'}, expires "
                f"{_utc(self.expires) if self.expires else 'not stated'}")


def introspect_token(api, token: str) -> TokenFacts:
    """IntrospectToken for `token`, signed in with it, as kaggle's own sign-in calls it (kaggle 2.2.4
    kaggle_api_extended.py L1347-1352); the reply's `scope` and `exp`, which that sign-in drops."""
    from kagglesdk.security.types.oauth_service import IntrospectTokenRequest

    request = IntrospectTokenRequest()
    request.token = token

    def introspect():
        with api.build_kaggle_client() as kaggle:
            return kaggle.security.oauth_client.introspect_token(request)

    reply = kaggle_call(introspect, "reading what Kaggle says of the token", timeout_s=PROVE_TIMEOUT_S)
    return TokenFacts(bool(reply.active), reply.scope or "", int(reply.exp or 0))


# How far Kaggle's clock (which sets `exp`, in whole seconds) and the session's own may disagree: a token expiring
# this soon after the session's last publish may end is proven again before publishing too, since which clock is
# right is not verified (the local Kaggle's two clocks agree to the millisecond; a real server's and VM's need not).
CLOCK_LEEWAY_S = 60.0


def expires_before(facts: TokenFacts, needed_until: float | None) -> str | None:
    """Where the token expires before `needed_until` (unix time: the session's last publish may run until then),
    or within `CLOCK_LEEWAY_S` after it, how close; else None. A notice, never a refusal: where Kaggle's clock
    starts is not verified."""
    if not (facts.expires and needed_until) or facts.expires >= needed_until + CLOCK_LEEWAY_S:
        return None
    when = f"it expires at {_utc(facts.expires)}"
    if facts.expires < needed_until:
        return f"{when}, {duration_text(needed_until - facts.expires)} before the session's last publish may end"
    return (f"{when}, within {duration_text(CLOCK_LEEWAY_S)} of when the session's last publish may end (how far "
            "Kaggle's clock and the session's may disagree)")


def publish_until(deadline_s: float | None, publish_s: float = 0.0) -> float | None:
    """The unix time until which this session may still publish: its deadline (counted from the process's start,
    as the trainer counts it: shared/session_clock.py) plus the chain's publish margin, after which it is killed;
    None without a deadline."""
    if not deadline_s:
        return None
    return time.time() + seconds_left(float(deadline_s) + float(publish_s or 0))


@dataclass(frozen=True)
class Choice:
    """The credential that proved it can publish (None: none could, and `problem` says why), what Kaggle says of
    it (`terms`, for a token), and whether it is proven again just before each publish (`reprove`: it expires
    before the session's last publish may end)."""

    credential: str | None
    problem: str | None = None
    terms: str = ""
    reprove: bool = False


def choose_credential(dataset: str, log=print, needed_until: float | None = None) -> Choice:
    """The first credential, in the clients' own order, that Kaggle lets write to `dataset` (`prove_dataset_write`),
    a token only while it is `active`. A credential refused or failing is one notice naming it with its terms, and
    the next is tried; one that expires before `needed_until` is chosen all the same, with a notice."""
    tried = candidates()
    if not tried:
        return Choice(None, no_credential_problem())
    reasons = []
    for credential in tried:
        use_credential(credential)
        said: dict[str, str] = {}
        try:
            # Each of the proof's calls has its own limit a try and is tried again after a transient fault
            # (`kaggle_call`): one limit round the whole proof would cut those retries short.
            short = _prove(credential, dataset, needed_until, said, log)
        except Exception as err:  # the API's own types, or a UserError from sign-in: one line, secrets masked
            status = getattr(getattr(err, "response", None), "status_code", None)
            short = f"HTTP {status}" if status else describe_error(err, secret_values())
        named = f"{credential} ({said['terms']})" if said.get("terms") else credential
        if short:
            reasons.append(f"{credential}: {short}")
            log(f"notice: {named} cannot publish to {dataset} ({short})")
            continue
        if said.get("expiring"):
            after = fallback_for(credential)
            log(f"notice: {credential}: {said['expiring']}; it is proven again just before each publish, "
                f"{f'with {after} as the fallback' if after else 'with no other credential to fall back on'}")
        return Choice(credential, None, said.get("terms", ""), bool(said.get("expiring")))
    return Choice(None, f"no credential can publish to {dataset} ({'; '.join(reasons)})")


def _prove(credential: str, dataset: str, needed_until: float | None, said: dict, log) -> str | None:
    """Sign in with `credential`; for a token, what Kaggle says of it (into `said`: its terms, and where it expires
    before `needed_until`); then the write. Why it cannot publish, or None."""
    api = kaggle_api(from_secrets=False)
    token = _token_of(credential)
    if token:
        facts = introspect_token(api, token)
        said["terms"] = facts.terms()
        _record_token(credential, facts)
        if not facts.active:
            return "Kaggle says it is not active"
        said["expiring"] = expires_before(facts, needed_until) or ""
    skipped = prove_dataset_write(api, dataset)
    if skipped:
        log(f"notice: the proof that {credential} can publish to {dataset} read it only: {skipped}")
    return None


def _record_token(credential: str, facts: TokenFacts) -> None:
    """What Kaggle said of a token (never the token), with when it was asked, in the session's facts: its lifetime,
    and so where it was issued against the session's start, is not verified."""
    from shared.kaggle.facts import record_fact
    from shared.session_clock import process_start

    record_fact("token", credential, {"active": facts.active, "scope": facts.scope, "expires": facts.expires,
                                      "asked_at": round(time.time(), 1),
                                      "process_age_s": round(time.monotonic() - process_start(), 1)})


def _utc(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def _token_text() -> str:
    """The notebook's token (never shown), "" where there is none."""
    path = os.environ.get(TOKEN_ENV) or _hidden.get(TOKEN_ENV)
    try:
        return Path(path).read_text().strip() if path else ""
    except OSError:
        return ""


def _token_of(credential: str) -> str:
    """The token `credential` signs in with ("" for the legacy key)."""
    if credential == NOTEBOOK_TOKEN:
        return _token_text()
    return (attached_api_token() or "") if credential == ATTACHED_TOKEN else ""


def secret_values() -> list[str]:
    """What an error message must never show: the key and the API token (where they are in the environment) and the
    notebook's token. Not the username: it is public, in every dataset's name, which a masked one would garble."""
    names = ("KAGGLE_KEY", API_TOKEN_ENV)
    values = [os.environ.get(name, "") or _hidden.get(name, "") for name in names] + [_token_text()]
    return [v for v in values if v]
