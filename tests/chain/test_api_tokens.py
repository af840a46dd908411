"""New-style API tokens (KGAT_..., what Kaggle's settings page makes by default; sent as a bearer token) work
wherever the legacy key does: on the laptop as KAGGLE_API_TOKEN or ~/.kaggle/access_token (read by kaggle 2.2.4
itself), or given as KAGGLE_KEY or kaggle.json's key (sent as the bearer token it is), and in a session as the secret
KAGGLE_API_TOKEN (or a KGAT_ value in the secret KAGGLE_KEY). The chain asks for the secret that carries the
credential the user has. The local Kaggle issues both kinds and refuses a token sent as basic auth, as the kaggle
client sends KAGGLE_KEY whatever it holds."""

import json
import subprocess
import sys

import pytest
from kaggle_fixtures import KEY, USER, client_env, write_dataset
from test_session_credential import DATASET, run_session

from shared.kaggle.credential import ATTACHED_TOKEN

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
# Signs in as the chain does, proves the token can write (the dataset's metadata written back), and prints which
# secrets the chain would ask the user to attach.
SIGN_IN = ("from shared.kaggle.credential import kaggle_api, credential_secrets, prove_dataset_write; "
           "api = kaggle_api(from_secrets=False); assert prove_dataset_write(api, {ds!r}) is None; "
           "print(','.join(credential_secrets(api)))")


def token_env(lk, token: str | None = None, **extra: str) -> dict:
    """The client's environment with no legacy key: the API token in KAGGLE_API_TOKEN (where given)."""
    env = client_env(lk.app, lk.home, user=None, key=None)
    if token:
        env["KAGGLE_API_TOKEN"] = token
    return {**env, **extra}


def create_dataset(lk, tmp_path, env: dict, ref: str) -> subprocess.CompletedProcess:
    folder = write_dataset(tmp_path / ref.replace("/", "-"), ref, {"README.md": "a file"})
    return lk.cli("datasets", "create", "-p", str(folder), env=env, check=False)


def sign_in(env: dict, dataset: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGN_IN.format(ds=dataset)], env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_the_kaggle_cli_writes_with_an_api_token_from_the_environment_or_its_file(local_kaggle, tmp_path):
    lk = local_kaggle
    token = lk.app.add_api_token(USER)
    assert token.startswith("KGAT_")
    assert create_dataset(lk, tmp_path, token_env(lk, token), f"{USER}/from-env").returncode == 0
    (lk.home / ".kaggle").mkdir(exist_ok=True)
    (lk.home / ".kaggle" / "access_token").write_text(token + "\n")
    proc = create_dataset(lk, tmp_path, token_env(lk), f"{USER}/from-file")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with lk.app.store.lock:
        assert {f"{USER}/from-env", f"{USER}/from-file"} <= set(lk.app.state["datasets"])
    signed = sign_in(token_env(lk), f"{USER}/from-file")
    assert signed.returncode == 0 and signed.stdout.strip() == "KAGGLE_API_TOKEN", signed.stderr


def test_an_api_token_given_as_kaggle_key_is_refused_as_basic_auth_and_sent_as_a_bearer_token_here(local_kaggle,
                                                                                                   tmp_path):
    lk = local_kaggle
    token = lk.app.add_api_token(USER)
    as_key = client_env(lk.app, lk.home, user=USER, key=token)
    refused = create_dataset(lk, tmp_path, as_key, f"{USER}/as-key")  # the kaggle client alone: basic auth, a 401
    assert refused.returncode != 0 and "Authentication required" in refused.stdout  # its answer to a 401
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", f"{USER}/as-key", {"README.md": "x"})))
    signed = sign_in(as_key, f"{USER}/as-key")
    assert signed.returncode == 0 and signed.stdout.strip() == "KAGGLE_API_TOKEN", signed.stderr
    assert token not in signed.stdout + signed.stderr


def test_an_api_token_kept_as_kaggle_json_key_is_sent_as_a_bearer_token(local_kaggle, tmp_path):
    lk = local_kaggle
    token = lk.app.add_api_token(USER)
    env = token_env(lk)
    config = lk.home / "kaggle-config"
    config.mkdir(exist_ok=True)
    (config / "kaggle.json").write_text(json.dumps({"username": USER, "key": token}))
    (config / "kaggle.json").chmod(0o600)
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", f"{USER}/json-key", {"README.md": "x"})))
    signed = sign_in(env, f"{USER}/json-key")
    assert signed.returncode == 0 and signed.stdout.strip() == "KAGGLE_API_TOKEN", signed.stderr


def test_a_legacy_key_signs_in_as_before_and_the_chain_asks_for_the_keys_secrets(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", f"{USER}/legacy", {"README.md": "x"})))
    signed = sign_in(client_env(lk.app, lk.home, user=USER, key=KEY), f"{USER}/legacy")
    assert signed.returncode == 0 and signed.stdout.strip() == "KAGGLE_USERNAME,KAGGLE_KEY", signed.stderr


@pytest.mark.parametrize("secret", ["KAGGLE_API_TOKEN", "KAGGLE_KEY"])
def test_a_session_whose_own_token_may_not_write_publishes_with_the_attached_api_token(local_kaggle, tmp_path,
                                                                                       secret):
    lk = local_kaggle
    lk.app.notebook_token_writes = False
    token = lk.app.add_api_token(USER)
    secrets = {secret: token} if secret == "KAGGLE_API_TOKEN" else {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": token}
    status, lines, record, versions = run_session(lk, tmp_path, secrets=secrets)
    assert status == "COMPLETE", lines
    assert f"publishing to {DATASET} with {ATTACHED_TOKEN} (scope not stated, expires not stated)" in lines
    assert record["published"] is True and versions == [1, 2]


@pytest.mark.slow
def test_a_chain_signed_in_with_an_api_token_asks_for_the_secret_kaggle_api_token(local_kaggle, tmp_path,
                                                                                  demo_data):
    from helpers import error_lines
    from test_chain import DEMO, NOTEBOOKS_STOP, run_chain, write_config
    from test_chain_datasets import upload_tokens

    lk = local_kaggle
    upload_tokens(lk, tmp_path, f"{USER}/kgat-tokens", demo_data)
    config = write_config(tmp_path / "kgat.json", name="kgat-run", tokenize={}, eval={"enabled": False},
                          token_datasets=[f"{USER}/kgat-tokens"], train={**DEMO["train"]})
    token = lk.app.add_api_token(USER)
    proc = run_chain(lk, config, tmp_path / "w", env=token_env(lk, token))
    assert proc.returncode == 2 and error_lines(proc.stderr) == [NOTEBOOKS_STOP], proc.stdout + proc.stderr
    assert (f"attach the secret KAGGLE_API_TOKEN to the train notebook: https://www.kaggle.com/code/{USER}/"
            "kgat-run-train (Add-ons > Secrets)") in proc.stdout
    assert token not in proc.stdout + proc.stderr
