"""A session's Kaggle calls meet Kaggle's transient faults and go on (shared/kaggle/calls.py): each a real session of
the local Kaggle, in the CPU image stand-in (.venv-kaggle-cpu, with the kaggle 2.0.2 of Kaggle's CPU and GPU
images), keeping its checkpoint in /kaggle/temp, where a publish that gives up loses it. The reads (the sign-in, the
credential's proof, the status reads, the file listings) answer 5xx or 429 for a while; the creates answer 5xx or
429 once, or answer 502 after making their version. Every checkpoint ends proven whole in the dataset, and no
create is made twice."""

import contextlib
import json
import time
from types import SimpleNamespace

import pytest
from kaggle_fixtures import wait_for, write_dataset, write_kernel
from test_session_credential import DATASET, REF, SESSION, _version_dir

from shared.kaggle.calls import calls_end_by, kaggle_call
from shared.kaggle.publish import MANIFEST as MANIFEST_NAME

# The session of test_session_credential.py, its publish proven (its one create deleting the older versions) as a
# checkpoint kept in /kaggle/temp is: the wait is long enough to outlast the faults, and returns once proven.
PROVEN = SESSION.replace('"expect_step": 0}', '"expect_step": 0, "verify_s": 60, "poll_s": [0.05, 0.2], '
                                              '"delete_old_versions": True}')
assert PROVEN != SESSION
PROVEN += "\nimport kaggle\nprint('kaggle ' + kaggle.__version__, flush=True)\n"


def run_session(lk, tmp_path, at_start=(), after_bootstrap=(), lasting: dict | None = None
                ) -> tuple[str, list[str], dict | None]:
    """Push PROVEN; inject `at_start` faults once it is pushed (its bootstrap meets them) and `after_bootstrap`
    ones once its bootstrap is done (its publish meets them); -> (status, log lines, publish record). `lasting`:
    an HTTP fault answering every matching call in both phases until the session has met it twice (a fault that
    lasts a while, ended by what the session did rather than by the clock)."""
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", DATASET, {"README.md": "no checkpoint"})))
    gate = tmp_path / "gate"
    session = PROVEN.replace('os.environ.get("CRED_TEST_GATE")', repr(str(gate)))
    assert session != PROVEN
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", REF, session, enable_internet=True)))
    for phase, faults in (("bootstrap", at_start), ("publish", after_bootstrap)):
        if lasting:
            faults = [{**lasting, "for_s": 600.0}, *faults]
        for fault in faults:
            lk.app.inject(**fault)
        if lasting:
            met = len(_retries_of(lk, lasting)) + 2
            wait_for(lambda met=met: len(_retries_of(lk, lasting)) >= met or _ended(lk), 120)
            with lk.app.faults.lock:  # the fault is over
                lk.app.faults.http[:] = [f for f in lk.app.faults.http if f.get("until") is None]
        if phase == "bootstrap":
            wait_for(lambda: "bootstrap done" in _log(lk) or _ended(lk), 120)
            gate.touch()
    status, _ = lk.wait(REF, timeout=180)
    lines = _log(lk).splitlines()
    record = next((json.loads(x[len("RECORD "):]) for x in lines if x.startswith("RECORD ")), None)
    return status, lines, record


def _ended(lk) -> bool:
    return lk.app.kernel_status(REF)[0] in ("COMPLETE", "ERROR")


def _retries_of(lk, fault: dict) -> list[str]:
    return retries(_log(lk).splitlines(), "", fault["status"])


def _log(lk) -> str:
    try:
        log = (_version_dir(lk) / "log.jsonl").read_text()
    except Exception:  # no log yet
        return ""
    return "".join(json.loads(line)["data"] for line in log.splitlines())


def versions(lk) -> list[tuple[int, bool]]:
    """(number, deleted) of every version the checkpoint dataset was given."""
    with lk.app.store.lock:
        return [(v["number"], bool(v.get("deleted"))) for v in lk.app.state["datasets"][DATASET]["versions"]]


def assert_proven_whole(lk, record: dict, lines: list[str]) -> None:
    """The checkpoint is in its proven version, every file at its size, and only there (the older ones deleted)."""
    assert record["published"] is True, lines
    number = record["verified_version"]
    assert number and record["deleted_old_versions"] is True, record
    assert [n for n, deleted in versions(lk) if not deleted] == [number]
    files = lk.root / "datasets" / DATASET / str(number)
    assert (files / "model.safetensors").read_bytes() == b"weights-at-step-40"
    assert json.loads((files / MANIFEST_NAME).read_text())["step"] == 40


def retries(lines: list[str], what: str, status: int) -> list[str]:
    return [x for x in lines if x.startswith(f"notice: {what}") and f"failed (HTTP {status}); trying again" in x]


@pytest.mark.parametrize("status, retry_after", [(503, None), (429, 2)])
def test_reads_that_answer_a_fault_for_a_while_are_tried_again_until_the_checkpoint_is_proven(
        local_kaggle, tmp_path, image_pythons, status, retry_after):
    fault = {"status": status, "retry_after": retry_after}
    bootstrap = [{**fault, "match": "GetDatasetMetadata"}]  # after every read has answered the fault a while
    publish = [{**fault, "match": m, "count": n} for m, n in (("GetDataset", 2), ("GetDatasetStatus", 1),
                                                               ("ListDatasetFiles", 2))]
    state, lines, record = run_session(local_kaggle, tmp_path, bootstrap, publish, {**fault, "match": "read"})
    assert state == "COMPLETE", lines
    assert "kaggle 2.0.2" in lines  # the CPU image's client
    done = lines.index("bootstrap done")
    for what in ("signing in to Kaggle", f"reading the metadata of {DATASET}"):
        assert retries(lines[:done], what, status), what  # the bootstrap's proof of the credential
    for what in ("signing in to Kaggle", f"reading the version of {DATASET}", f"reading the status of {DATASET}",
                 f"listing version 2 of {DATASET}"):
        assert retries(lines[done:], what, status), what  # the publish and its proof
    first_waits = {x.split("trying again in ")[1] for x in retries(lines, "", status) if x.endswith("(retry 1)")}
    assert first_waits == {"2 s (retry 1)" if retry_after else "1 s (retry 1)"}  # the server's wait, if it asks
    assert_proven_whole(local_kaggle, record, lines)


@pytest.mark.parametrize("fault, made", [
    ({"match": "CreateDatasetVersion", "status": 503}, [1, 2]),
    ({"match": "StartBlobUpload", "status": 500}, [1, 2]),
    ({"match": "CreateDatasetVersion", "status": 429, "retry_after": 1}, [1, 2]),  # kaggle's own retry
    ({"match": "CreateDatasetVersion", "status": 502, "after": True}, [1, 2]),  # it landed: not made twice
], ids=["503", "upload-start-500", "429", "502-after-landing"])
def test_a_create_that_answers_a_fault_is_made_again_only_where_its_version_did_not_land(
        local_kaggle, tmp_path, image_pythons, fault, made):
    state, lines, record = run_session(local_kaggle, tmp_path, after_bootstrap=[fault])
    assert state == "COMPLETE", lines
    assert [n for n, _ in versions(local_kaggle)] == made  # the one, deleting publish: nothing twice
    assert_proven_whole(local_kaggle, record, lines)
    if fault.get("after"):
        assert f"publish: version 2 of {DATASET} landed after all; not publishing it again" in lines
    elif fault["status"] != 429:
        assert retries(lines, f"the publish to {DATASET}", fault["status"])


def test_the_proof_under_the_cpu_images_kaggle_reads_the_status_that_names_no_version(
        local_kaggle, tmp_path, image_pythons):
    """GetDataset's versions[] carry no status of their own (what Kaggle writes there is not verified): the proof
    falls back to GetDatasetStatus, which kaggle 2.0.2's `dataset_status` reads with no `format`."""
    local_kaggle.app.settings.version_status_in_versions = False
    state, lines, record = run_session(local_kaggle, tmp_path)
    assert state == "COMPLETE", lines
    assert "kaggle 2.0.2" in lines
    assert_proven_whole(local_kaggle, record, lines)


# --- the retry itself, and the read before publishing again -------------------------------------------------------

class Reply(Exception):
    """An API error as the clients raise it: `response.status_code`, `response.headers`."""

    def __init__(self, status: int, headers: dict | None = None):
        super().__init__(f"HTTP {status}")
        self.response = SimpleNamespace(status_code=status, headers=headers or {})


def failing(*errors: Exception):
    """A call that raises each of `errors` in turn, then returns "done"; `.tries` counts its calls."""
    def call():
        call.tries += 1
        if call.tries <= len(errors):
            raise errors[call.tries - 1]
        return "done"

    call.tries = 0
    return call


def test_a_call_is_tried_again_after_each_transient_fault_waiting_what_a_429_asks():
    waits, lines = [], []
    call = failing(Reply(503), Reply(429, {"Retry-After": "7"}), ConnectionResetError("reset by peer"))
    assert kaggle_call(call, "reading", lines.append, sleep=waits.append) == "done"
    assert call.tries == 4 and waits == [1.0, 7.0, 4.0]  # doubling, but the server's 7 s where it asks
    assert lines == ["notice: reading failed (HTTP 503); trying again in 1 s (retry 1)",
                     "notice: reading failed (HTTP 429); trying again in 7 s (retry 2)",
                     "notice: reading failed (ConnectionResetError); trying again in 4 s (retry 3)"]


def test_a_fault_that_another_try_would_meet_again_is_raised_at_once():
    call = failing(Reply(403))
    with pytest.raises(Reply):
        kaggle_call(call, "reading", lambda _: None, sleep=lambda s: pytest.fail("no wait"))
    assert call.tries == 1


def test_no_wait_between_tries_reaches_the_moment_the_session_gives_its_publish_up():
    waits = []
    call = failing(*[Reply(502)] * 10)
    calls_end_by(time.monotonic() + 3.5)  # the waits of 1 and 2 s fit before it, the next of 4 s does not
    try:
        with pytest.raises(Reply):
            kaggle_call(call, "reading", lambda _: None, sleep=waits.append)
    finally:
        calls_end_by(None)
    assert waits == [1.0, 2.0] and call.tries == 3


class Clock:
    """time.monotonic for shared.kaggle.proof, moved on by its sleeps only."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_version_that_appears_just_after_the_wait_is_proven_instead_of_published_again(monkeypatch):
    from shared.kaggle import proof

    clock, reads = Clock(), []
    monkeypatch.setattr(proof, "time", clock)

    def get_dataset(request):  # version 2 at both reads of the wait (at 0 s and 100 s), version 3 (ready) after
        reads.append(clock.now)
        number = 2 if len(reads) <= 2 else 3
        return SimpleNamespace(current_version_number=number,
                               versions=[SimpleNamespace(version_number=number, status="Ready")])

    client = SimpleNamespace(datasets=SimpleNamespace(dataset_api_client=SimpleNamespace(get_dataset=get_dataset)))
    api = SimpleNamespace(build_kaggle_client=lambda: contextlib.nullcontext(client))
    republished, lines = [], []
    result = proof.verify_publish(api, DATASET, 2, 60, lambda: republished.append(1), log=lines.append,
                                  sleep=clock.sleep, poll=(100.0, 100.0))
    assert result == {"verified_version": 3, "republished": False} and republished == []
    assert reads == [0.0, 100.0, 100.0, 100.0, 200.0]  # the wait, the read before publishing again, the proof
    assert lines == [f"publish: a version of {DATASET} after 2 appeared after the wait; proving it before "
                     "publishing again"]
