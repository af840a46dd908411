"""The first real sessions measure what the plan assumes (issue 54): each records the image's packages, where its
clock may have started, each publish's upload rate and time until ready; the chain keeps them beside the tokens/s,
--plan sizes the uploads with them, and one command rebuilds the image's pins from a saved freeze."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO

from scripts.chain.measured import facts_summary, keep_session_facts, measured_publishes, publish_line
from scripts.rebuild_image_pins import rebuild
from shared.kaggle import facts as facts_module
from shared.kaggle.facts import FACTS_FILE, clock_facts, image_freeze, record_clock, record_image


def test_a_session_records_its_images_packages_and_what_it_can_read_of_its_start(session):
    record_image()
    record_clock()
    facts = json.loads((session / "working" / FACTS_FILE).read_text())
    freeze = facts["image"]["freeze"]
    from importlib.metadata import version

    assert f"numpy=={version('numpy')}" in freeze and freeze == image_freeze()
    assert [line.split("==")[0].lower() for line in freeze] == sorted(line.split("==")[0].lower() for line in freeze)
    clock = facts["clock"]["process"]
    assert clock["kaggle_clock_start"] == "not verified"
    assert clock["process_after_boot_s"] > 0 and 0 <= clock["process_age_s"] < 24 * 3600
    assert "process_after_pid1_s" in clock and all(isinstance(k, str) for k in clock["start_like_env"])


def test_outside_a_session_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(facts_module, "in_session", lambda: False)
    monkeypatch.chdir(tmp_path)
    record_image()  # a no-op: no session folder to write to
    assert clock_facts()["kaggle_clock_start"] == "not verified" and list(tmp_path.iterdir()) == []


def facts_file(tmp_path, local: bool, publishes: list[dict]):
    path = tmp_path / FACTS_FILE
    path.write_text(json.dumps({"session": {"local_kaggle": local}, "publishes": publishes,
                                "image": {"freeze": ["a==1", "b==2"], "python": "3.12.1"},
                                "token": {"notebook token": {"scope": "resources.admin:*", "expires": 1}}}))
    return path


def test_the_chain_keeps_kaggles_measurements_and_plan_sizes_the_uploads_with_their_median(tmp_path):
    runs = tmp_path / "measured-kaggle.json"
    size = 2 * 10**9
    assert publish_line(2, size, 1000, runs) == (
        "2 version(s) of 2.00 GB upload in ~400 s at an assumed 10 MB/s (not measured yet: each session records its "
        "own); the time until a version is ready is not measured yet")
    local = keep_session_facts(facts_file(tmp_path, True, [{"bytes": size, "mb_s": 900.0, "ready_s": 1.0}]), "c",
                               runs)
    assert local["uploads_mb_s"] == [900.0] and not runs.exists()  # the local Kaggle's loopback is no measure
    kept = keep_session_facts(facts_file(tmp_path, False, [{"bytes": size, "mb_s": 4.0, "ready_s": 120.0},
                                                           {"bytes": size, "mb_s": 6.0, "ready_s": None}]), "c", runs)
    assert kept == {"local_kaggle": False, "uploads_mb_s": [4.0, 6.0], "upload_bytes": [size, size],
                    "ready_s": [120.0], "token": {"notebook token": {"scope": "resources.admin:*", "expires": 1}},
                    "image": {"python": "3.12.1", "packages": 2}}
    keep_session_facts(facts_file(tmp_path, False, [{"bytes": size, "mb_s": 8.0, "ready_s": 300.0}]), "c", runs)
    measured = measured_publishes(runs)
    assert (measured["bytes_per_s"], measured["uploads"], measured["ready_s"], measured["readies"]) == (
        6e6, 3, 210.0, 2)
    line = publish_line(2, size, 1000, runs)
    assert line.startswith("2 version(s) of 2.00 GB upload in ~667 s at a measured 6.0 MB/s (median of 3 upload(s) "
                           "on Kaggle, newest ")
    assert line.endswith(", each version ready 210 s after its create (measured, median of 2); warning: ~1087 s in "
                         "all, more than the 1000-s publish margin: raise publish_margin_s")


def test_a_summary_leaves_the_freeze_in_the_sessions_own_file():
    assert facts_summary({}) == {"local_kaggle": False, "uploads_mb_s": [], "upload_bytes": [], "ready_s": []}


def test_one_command_rebuilds_the_image_pins_from_a_saved_freeze(tmp_path):
    pins = (REPO / "scripts" / "image_pins" / "kaggle-tpu.txt").read_text()
    freeze = ["Jinja2==3.1.6", "torch==2.8.0+libtpu", "torch_xla==2.8.0", "kagglehub==0.3.13", "numpy==2.0.2"]
    text, missing = rebuild(pins, freeze, "kaggle-tpu-freeze.txt")
    lines = text.splitlines()
    assert "torch==2.8.0                 # measured kaggle-tpu-freeze.txt:3" in lines  # +libtpu: not on PyPI
    assert "kagglehub==0.3.13            # measured kaggle-tpu-freeze.txt:5" in lines  # was unpinned
    assert "torch_xla==2.8.0             # measured kaggle-tpu-freeze.txt:4" in lines
    assert [line for line in lines if line.startswith("#")] == [line for line in pins.splitlines()
                                                               if line.startswith("#")]
    assert "matplotlib" in missing and "numpy" not in missing
    assert any(line.startswith("matplotlib ") for line in lines)  # left as it was
    # the command, on a session's facts file, into a copy of the pins folder
    folder = tmp_path / "pins"
    folder.mkdir()
    (folder / "kaggle-tpu.txt").write_text(pins)
    facts = tmp_path / "session-facts.json"
    facts.write_text(json.dumps({"image": {"freeze": freeze}}))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "rebuild_image_pins.py"), "--image", "tpu",
                           str(facts), "--pins-dir", str(folder)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (folder / "kaggle-tpu.txt").read_text() == text
    assert (folder / "kaggle-tpu-freeze.txt").read_text().splitlines()[1:] == freeze
    assert "warning: matplotlib is not in the freeze: its pin is left as it was" in proc.stdout


def test_each_publish_records_its_upload_rate_and_its_time_until_ready_on_the_local_kaggle(local_kaggle, tmp_path):
    from test_publish_proof import probe, start_dataset

    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.settings.dataset_ready_delay_s = 1.0  # a new version is not ready for a second
    out = probe(lk, tmp_path, f"""
        import os
        os.environ["LOCAL_KAGGLE_ROOT"] = {str(tmp_path / "kaggle")!r}  # a session: facts are written
        plan = publish.PublishPlan(CKPT, delete_old_versions=True, verify_s=30.0, poll_s=(0.05, 0.2))
        record = {{}}
        publish._publish(plan, checkpoint(20), 20, record, lambda _: None, work_dir=work / "upload")
        out["facts"] = json.loads(pathlib.Path({str(tmp_path / "kaggle" / "working" / FACTS_FILE)!r}).read_text())
    """)
    (first,) = out["facts"]["publishes"]  # one upload: its create deletes the older versions
    size = 120 + 220 + len(json.dumps({"step": 20, "files": {"model.safetensors": {"bytes": 120, "sha256": "-"},
                                                            "optimizer.safetensors": {"bytes": 220, "sha256": "-"}}}))
    assert (first["bytes"], first["delete_old_versions"]) == (size, True)
    assert first["mb_s"] > 0 and first["seconds"] >= 0
    assert 1.0 <= first["ready_s"] < 30.0


def test_what_kaggle_says_of_the_notebooks_token_is_in_the_sessions_facts_and_the_token_is_not(session, monkeypatch,
                                                                                                 tmp_path):
    from shared.kaggle import credential
    from shared.kaggle.credential import NOTEBOOK_TOKEN, TokenFacts

    monkeypatch.setattr(credential, "kaggle_api", lambda from_secrets=True: object())
    said = TokenFacts(True, "resources.admin:*", 2_000_000_000)
    monkeypatch.setattr(credential, "introspect_token", lambda api, token: said)
    monkeypatch.setattr(credential, "prove_dataset_write", lambda api, dataset: None)
    monkeypatch.setattr(credential, "candidates", lambda: [NOTEBOOK_TOKEN])
    token_file = tmp_path / "notebook-token"  # a session's token is a file its variable names
    token_file.write_text("the-secret-token-value")
    monkeypatch.setenv(credential.TOKEN_ENV, str(token_file))
    assert credential.choose_credential("alice/ckpt", lambda _: None, None).credential == NOTEBOOK_TOKEN
    text = (session / "working" / FACTS_FILE).read_text()
    token = json.loads(text)["token"][NOTEBOOK_TOKEN]
    assert (token["active"], token["scope"], token["expires"]) == (True, "resources.admin:*", 2_000_000_000)
    assert token["process_age_s"] >= 0 and token["asked_at"] > 1.7e9
    assert "the-secret-token-value" not in text
