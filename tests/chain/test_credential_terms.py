"""A credential is refused only by Kaggle's own word: a token that IntrospectToken says is not `active`, or a real,
harmless write to the checkpoint dataset (its metadata written back as it is) that Kaggle refuses. A token's
`scope` and `exp` are named in the line that names it and refuse nothing: one expiring before the session's last
publish is a notice, and it is proven again just before each publish, with the next credential as the fallback.
Signing in never swaps sys.stdout (a thread signs in while the trainer prints), and each in-session call has a
limit."""

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import IMAGE_PYTHONS
from kaggle_fixtures import USER
from test_session_credential import DATASET, SESSION, run_session

from shared.errors import UserError
from shared.kaggle import credential, proof
from shared.kaggle.credential import (
    ATTACHED_KEY,
    CLOCK_LEEWAY_S,
    NOTEBOOK_TOKEN,
    Choice,
    TokenFacts,
    expires_before,
)

HOUR = 3600.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The test session's build with a deadline of two hours and a publish margin of ten minutes.
DEADLINE_SESSION = SESSION.replace(
    '"checkpoint_dir": "{temp}/checkpoints"}', '"checkpoint_dir": "{temp}/checkpoints", "session_deadline": 7200}'
).replace('"expect_step": 0}', '"expect_step": 0, "publish_s": 600}')


def test_the_test_session_has_a_deadline_and_a_publish_margin():
    assert '"session_deadline": 7200' in DEADLINE_SESSION and '"publish_s": 600' in DEADLINE_SESSION


# --- the decision -----------------------------------------------------------------------------------------------

def test_a_token_that_expires_before_the_sessions_last_publish_is_said_so_and_one_that_outlives_it_is_not():
    now = time.time()
    short = expires_before(TokenFacts(True, "resources.admin:*", int(now + HOUR)), now + 2 * HOUR)
    assert short.startswith("it expires at ") and short.endswith(
        "60 minutes before the session's last publish may end")
    assert expires_before(TokenFacts(True, "resources.admin:*", int(now + 3 * HOUR)), now + 2 * HOUR) is None
    # Just after it, by less than the two clocks may disagree: said too, as within that leeway.
    close = expires_before(TokenFacts(True, "resources.admin:*", int(now) + 30), int(now))
    assert close.startswith("it expires at ") and close.endswith(
        "within 60 s of when the session's last publish may end (how far Kaggle's clock and the session's may "
        "disagree)") and CLOCK_LEEWAY_S == 60
    assert expires_before(TokenFacts(True, "resources.admin:*", int(now) + 60), int(now)) is None  # past the leeway
    assert expires_before(TokenFacts(True, "resources.admin:*", 0), now + 2 * HOUR) is None  # no exp: nothing
    assert expires_before(TokenFacts(True, "resources.admin:*", int(now + HOUR)), None) is None  # no deadline


def test_a_tokens_terms_name_its_scope_and_expiry_or_say_they_are_not_stated():
    assert TokenFacts(True, "resources.datasets:read", 0).terms() == (
        "scope resources.datasets:read, expires not stated")
    assert TokenFacts(True, "", 86400).terms() == "scope not stated, expires 1970-01-02T00:00:00Z"


@pytest.fixture
def fake_proof(monkeypatch):
    """choose_credential with the calls faked: each credential signs in, the token introspects as `facts` says,
    and the write passes unless `refused` names the credential; -> (state, the list of credentials that wrote)."""
    proven: list[str] = []
    state = {"credential": None, "facts": TokenFacts(True, "resources.admin:*", 0), "refused": ()}

    def write(api, ds):
        if state["credential"] in state["refused"]:
            raise RuntimeError("HTTP 403 Forbidden")
        proven.append(state["credential"])

    monkeypatch.setattr(credential, "use_credential", lambda c: state.update(credential=c))
    monkeypatch.setattr(credential, "kaggle_api", lambda from_secrets=True: object())
    monkeypatch.setattr(credential, "_token_of", lambda c: "nb-token" if c == NOTEBOOK_TOKEN else "")
    monkeypatch.setattr(credential, "introspect_token", lambda api, token: state["facts"])
    monkeypatch.setattr(credential, "prove_dataset_write", write)
    return state, proven


def test_a_token_with_another_scope_that_writes_publishes_with_its_scope_named(fake_proof, monkeypatch):
    state, proven = fake_proof
    state["facts"] = TokenFacts(True, "resources.datasets:write kernels.session", 0)
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN, ATTACHED_KEY])
    lines: list[str] = []
    chosen = credential.choose_credential(DATASET, lines.append, time.time() + 2 * HOUR)
    assert chosen == Choice(NOTEBOOK_TOKEN, None, "scope resources.datasets:write kernels.session, expires not "
                                                  "stated", False)
    assert proven == [NOTEBOOK_TOKEN] and lines == []


def test_a_token_expiring_before_the_session_ends_publishes_with_a_notice_and_is_proven_again(fake_proof,
                                                                                             monkeypatch):
    state, proven = fake_proof
    state["facts"] = TokenFacts(True, "resources.admin:*", int(time.time() + HOUR))
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN, ATTACHED_KEY])
    lines: list[str] = []
    chosen = credential.choose_credential(DATASET, lines.append, needed_until=time.time() + 2 * HOUR)
    assert chosen.credential == NOTEBOOK_TOKEN and chosen.reprove is True and proven == [NOTEBOOK_TOKEN]
    (line,) = lines
    assert line.startswith(f"notice: {NOTEBOOK_TOKEN}: it expires at ") and line.endswith(
        f"before the session's last publish may end; it is proven again just before each publish, with "
        f"{ATTACHED_KEY} as the fallback")


def test_with_no_key_a_token_expiring_before_the_session_ends_still_publishes(fake_proof, monkeypatch):
    state, proven = fake_proof
    state["facts"] = TokenFacts(True, "resources.admin:*", int(time.time() + HOUR))
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN])
    lines: list[str] = []
    chosen = credential.choose_credential(DATASET, lines.append, time.time() + 2 * HOUR)
    assert chosen.credential == NOTEBOOK_TOKEN and chosen.problem is None and chosen.reprove is True
    assert lines[0].endswith("with no other credential to fall back on")


def test_a_token_kaggle_says_is_not_active_is_refused_and_the_key_tried(fake_proof, monkeypatch):
    state, proven = fake_proof
    state["facts"] = TokenFacts(False, "resources.admin:*", 0)
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN, ATTACHED_KEY])
    lines: list[str] = []
    assert credential.choose_credential(DATASET, lines.append).credential == ATTACHED_KEY
    assert proven == [ATTACHED_KEY]
    assert lines == [f"notice: {NOTEBOOK_TOKEN} (scope resources.admin:*, expires not stated) cannot publish to "
                     f"{DATASET} (Kaggle says it is not active)"]


def test_a_write_kaggle_refuses_to_every_credential_is_one_line_naming_each(fake_proof, monkeypatch):
    state, proven = fake_proof
    state["refused"] = (NOTEBOOK_TOKEN, ATTACHED_KEY)
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN, ATTACHED_KEY])
    chosen = credential.choose_credential(DATASET, lambda line: None)
    assert chosen.credential is None and proven == []
    assert chosen.problem == (f"no credential can publish to {DATASET} ({NOTEBOOK_TOKEN}: RuntimeError: HTTP 403 "
                              f"Forbidden; {ATTACHED_KEY}: RuntimeError: HTTP 403 Forbidden)")


def test_a_credential_proven_again_before_a_publish_is_named_and_one_that_fails_it_publishes_all_the_same(
        monkeypatch):
    from shared.kaggle import publish

    plan = publish.PublishPlan(dataset=DATASET, credential=NOTEBOOK_TOKEN, reprove=True)
    lines: list[str] = []
    monkeypatch.setattr(publish, "choose_credential", lambda ds, log: Choice(ATTACHED_KEY))
    assert publish._reproven(plan, lines.append) == ATTACHED_KEY
    monkeypatch.setattr(publish, "choose_credential", lambda ds, log: Choice(None, "it cannot (HTTP 403)"))
    assert publish._reproven(plan, lines.append) == NOTEBOOK_TOKEN  # the publish itself has the last word
    assert lines == [f"publishing to {DATASET} with {ATTACHED_KEY} instead",
                     f"notice: it cannot (HTTP 403); publishing with {NOTEBOOK_TOKEN} all the same"]


def test_the_session_may_publish_until_its_deadline_plus_the_publish_margin_counted_from_its_start(monkeypatch):
    monkeypatch.setattr(credential, "seconds_left", lambda deadline: deadline - 100.0)  # started 100 s ago
    until = credential.publish_until(7200, 600)
    assert abs(until - (time.time() + 7700.0)) < 5.0
    assert credential.publish_until(None, 600) is None and credential.publish_until(0) is None


# --- the local Kaggle, as harsh ---------------------------------------------------------------------------------

def test_the_local_kaggle_expires_a_session_token_mid_session_and_says_when_it_would(local_kaggle):
    from scripts.local_kaggle import ApiError

    accounts = local_kaggle.app.accounts
    local_kaggle.app.notebook_token_lifetime_s = HOUR
    token = accounts.issue_notebook_token(USER)
    said = accounts.introspect(token, USER)
    assert said["active"] is True and said["username"] == USER and said["scope"] == "resources.admin:*"
    assert abs(said["exp"] - (time.time() + HOUR)) < 60
    assert accounts.authenticate(f"Bearer {token}") == USER
    accounts.expire_notebook_tokens()
    with pytest.raises(ApiError) as err:
        accounts.authenticate(f"Bearer {token}")
    assert err.value.status == 401
    assert accounts.introspect(token, USER)["active"] is False
    assert accounts.introspect("nb-unknown", USER) == {"active": False, "username": ""}


def test_the_local_kaggle_issues_a_token_of_another_scope_that_says_so_and_still_writes(local_kaggle):
    accounts = local_kaggle.app.accounts
    local_kaggle.app.notebook_token_scope = "resources.datasets:read"
    token = accounts.issue_notebook_token(USER)
    assert accounts.introspect(token, USER)["scope"] == "resources.datasets:read"
    accounts.authorize(f"Bearer {token}", "GetDatasetStatus")
    accounts.authorize(f"Bearer {token}", "CreateDatasetVersion")  # a scope refuses nothing: not verified


def test_the_local_kaggle_issues_a_token_that_expires_at_the_sessions_end_counted_from_its_own_start(local_kaggle):
    accounts = local_kaggle.app.accounts
    local_kaggle.app.notebook_token_lifetime_s = "session"
    end = time.time() + 2 * HOUR
    token = accounts.issue_notebook_token(USER, session_end=end)
    assert accounts.introspect(token, USER)["exp"] == int(end)


# --- sessions against the local Kaggle --------------------------------------------------------------------------

@pytest.mark.slow  # a session each (the decision's unit tests above stay in the quick loop)
def test_a_token_that_expires_at_the_sessions_end_and_no_key_publishes_with_a_notice_proven_again(
        local_kaggle, tmp_path):
    """The token lives exactly as long as the session, counted from the local Kaggle's own start of it, which comes
    before the process's: it expires before the last publish the session counts from its process's start (its
    deadline plus the publish margin, the session's limit here), which is a notice, not a refusal."""
    local_kaggle.app.session_limit_s = 7800  # the deadline (7200 s) plus the publish margin (600 s)
    local_kaggle.app.notebook_token_lifetime_s = "session"
    status, lines, record, versions = run_session(local_kaggle, tmp_path, secrets=False, session=DEADLINE_SESSION)
    assert status == "COMPLETE", lines
    (notice,) = [x for x in lines if x.startswith("notice:")]
    # Before it by the moments between the two starts, or, where the clocks disagree by more, within the leeway.
    assert notice.startswith(f"notice: {NOTEBOOK_TOKEN}: it expires at ") and re.search(
        r"(before the session's last publish may end|within 60 s of when the session's last publish may end \(.*\))"
        "; it is proven again just before each publish, with no other credential to fall back on$", notice), notice
    (chosen,) = [x for x in lines if x.startswith("publishing to ")]
    assert chosen.startswith(f"publishing to {DATASET} with {NOTEBOOK_TOKEN} (scope resources.admin:*, expires ")
    assert f"publish: {NOTEBOOK_TOKEN} proven again, just before publishing to {DATASET}" in lines
    assert record["published"] is True and versions == [1, 2]


@pytest.mark.slow  # a session each (the decision's unit tests above stay in the quick loop)
def test_a_token_expiring_early_and_refused_when_proven_again_leaves_the_publish_to_the_attached_key(
        local_kaggle, tmp_path, monkeypatch):
    monkeypatch.setenv("CRED_TEST_GATE", str(tmp_path / "gate"))
    local_kaggle.app.notebook_token_lifetime_s = HOUR  # the session may publish until 2 h 10 min
    status, lines, record, versions = run_session(local_kaggle, tmp_path, secrets=True, session=DEADLINE_SESSION,
                                                  between=local_kaggle.app.accounts.expire_notebook_tokens)
    assert status == "COMPLETE", lines
    assert any(x.startswith(f"publishing to {DATASET} with {NOTEBOOK_TOKEN} (scope ") for x in lines)
    assert any(x.startswith(f"notice: {NOTEBOOK_TOKEN}: it expires at ") and x.endswith(
        f"with {ATTACHED_KEY} as the fallback") for x in lines), lines
    assert f"notice: {NOTEBOOK_TOKEN} cannot publish to {DATASET} (HTTP 401)" in lines  # proven again: refused
    assert f"publishing to {DATASET} with {ATTACHED_KEY} instead" in lines
    assert record["published"] is True and versions == [1, 2]


@pytest.mark.slow  # a session each (the decision's unit tests above stay in the quick loop)
def test_a_token_that_expires_mid_session_publishes_with_the_attached_key(local_kaggle, tmp_path, monkeypatch):
    monkeypatch.setenv("CRED_TEST_GATE", str(tmp_path / "gate"))
    status, lines, record, versions = run_session(
        local_kaggle, tmp_path, secrets=True, between=local_kaggle.app.accounts.expire_notebook_tokens)
    assert status == "COMPLETE", lines
    assert any(x.startswith(f"publishing to {DATASET} with {NOTEBOOK_TOKEN} (scope ") for x in lines)
    # Refused at the sign-in, before any upload: a failure the publish used to raise, not retry.
    assert any(x.startswith(f"notice: the publish to {DATASET} with the notebook's token failed (HTTP 401")
               and x.endswith("publishing with the attached key") for x in lines), lines
    assert record["published"] is True and versions == [1, 2]


# --- sign-in: no stdout swap, and a limit -----------------------------------------------------------------------

def test_a_sign_in_from_a_thread_leaves_sys_stdout_alone_and_prints_no_help_page(monkeypatch, tmp_path, capsys):
    api_class = credential.kaggle_api_class()  # kaggle reads its config folder once, at import: patched after it
    for name in [n for n in os.environ if n.startswith("KAGGLE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(api_class, "config_dir", str(tmp_path / ".kaggle"))
    monkeypatch.setattr(api_class, "config", str(tmp_path / ".kaggle" / "kaggle.json"))
    stdout, seen, failed = sys.stdout, [], []
    original = api_class.authenticate

    def spy(self):
        seen.append(sys.stdout)
        return original(self)

    monkeypatch.setattr(api_class, "authenticate", spy)

    def midway_thread():
        try:
            credential.kaggle_api(from_secrets=False)
        except UserError as err:
            failed.append(str(err))

    thread = threading.Thread(target=midway_thread)
    thread.start()
    thread.join(60)
    assert seen == [stdout] and sys.stdout is stdout
    assert failed and failed[0].startswith("Kaggle credentials not found")
    assert capsys.readouterr().out == ""  # kaggle's page of help, silenced at its source


@pytest.mark.parametrize("python", [sys.executable, str(IMAGE_PYTHONS["cpu"])], ids=["kaggle-2.2.4", "kaggle-2.0.2"])
def test_the_first_import_of_kaggle_signs_in_without_printing_its_help_page(tmp_path, python):
    # kaggle 2.2.4's `import kaggle` swallows a failed sign-in; 2.0.2's (the CPU image's) exits from the import
    # itself (its kaggle/__init__.py calls api.authenticate() bare): both end in the same one line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
    env.update(HOME=str(tmp_path), KAGGLE_CONFIG_DIR=str(tmp_path / ".kaggle"), PYTHONPATH=REPO)
    code = ("import sys; from shared.errors import run_cli; from shared.kaggle.credential import kaggle_api; "
            "assert 'kaggle' not in sys.modules; run_cli(lambda: kaggle_api(from_secrets=False))")
    if not os.path.exists(python):
        pytest.skip("no .venv-kaggle-cpu: run bash scripts/setup.sh --kaggle-image")
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith("error: Kaggle credentials not found")


def test_a_sign_in_that_never_answers_is_one_line_at_its_limit(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(credential, "SIGN_IN_TIMEOUT_S", 0.2)
    monkeypatch.setattr(credential, "_signed_in", lambda: release.wait())
    try:
        with pytest.raises(UserError, match=r"^signing in to Kaggle: no answer within 0\.2 s$"):
            credential.kaggle_api(from_secrets=False)
    finally:
        release.set()


def test_a_status_read_that_never_answers_is_one_line_at_its_limit(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(proof, "STATUS_TIMEOUT_S", 0.2)
    monkeypatch.setattr(proof, "read_dataset_version", lambda api, ds: release.wait())
    try:
        with pytest.raises(UserError, match=r"^no answer within 0\.2 s$"):
            proof.dataset_version(object(), DATASET)
    finally:
        release.set()

