"""The tokenize kernel against a Hub: the local Hub (scripts/local_hub.py) that the real huggingface_hub and datasets
read through HF_ENDPOINT, with its faults; the stream's own retries and resume fallbacks; the session's deadline; and
the waits on the tokenizer processes (issue 31)."""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenize_fixtures import assert_same_shards, read_tokens, run_kernel, run_tokenize

import shared.tokenize.part as part_module
from scripts.local_hub import LocalHub, build_fineweb_like
from shared.errors import UserError, is_transient
from shared.retry import Backoff, retry_after_s
from shared.tokenize.manifest import MANIFEST
from shared.tokenize.part import CRASH_ENV
from shared.tokenize.workers import result_of, shut_down

REPO = "HuggingFaceFW/fineweb-edu"


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory, corpus) -> Path:
    """The test corpus's documents, in order, in FineWeb-Edu's layout: 3 parquet files of 97-row row groups."""
    root = tmp_path_factory.mktemp("hub")
    build_fineweb_like(root, corpus["docs"], files=3, row_group_rows=97)
    return root


@pytest.fixture
def hub(hub_root):
    with LocalHub(hub_root) as server:
        yield server


def hub_kernel(hub: LocalHub, ranks: str, out: Path, *extra, env: dict | None = None, python: str = sys.executable):
    """The kernel on the Hub's FineWeb-Edu sample-10BT (its defaults), as the reference run's shards are cut."""
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(out.parent / "hf-home"), "HF_UPDATE_DOWNLOAD_COUNTS": "0",
               "HF_HUB_DOWNLOAD_TIMEOUT": "2", "HF_TOKEN": ""}
    return run_kernel("--out-dir", out, "--shard-size", "20000", "--processes", "2", "--batch-docs", "64",
                      "--ranks-path", ranks, "--no-progress", "--retry-wait-s", "0.2", *extra,
                      env={**hub_env, **(env or {})}, python=python)


@pytest.mark.slow  # a kernel process (7 s): the quick loop keeps the in-process tests of the same code
def test_a_part_read_through_the_local_hub_equals_the_local_files_run(hub, ranks, tmp_path, reference):
    out = tmp_path / "out"
    proc = hub_kernel(hub, ranks, out)
    assert proc.returncode == 0, proc.stderr
    assert_same_shards(out, reference[0])
    source = json.loads((out / MANIFEST).read_text())["source"]
    assert source == {"kind": "hub", "dataset": REPO, "config": "sample-10BT", "split": "train",
                      "revision": hub.sha(REPO), "text_column": "text"}
    ranges = [e for e in hub.log if e["path"].endswith(".parquet")]
    assert ranges and all(e["status"] == 206 and e["range"] for e in ranges)  # read by HTTP Range, as on the Hub
    assert "anonymously" in proc.stdout


@pytest.mark.slow
def test_each_hub_fault_is_retried_and_the_tokens_are_those_of_a_fault_free_run(hub, ranks, tmp_path, reference):
    hub.add_fault("429", match="000_00000", retry_after=1)
    hub.add_fault("reset", match="001_00000", after_bytes=1000)
    hub.add_fault("503", match="001_00000", count=6, retry_after=0)  # past huggingface_hub's 5 retries: ours
    hub.add_fault("stall", match="002_00000", after_bytes=500, stall_s=20)  # past the 2 s read timeout
    out = tmp_path / "out"
    proc = hub_kernel(hub, ranks, out)
    assert proc.returncode == 0, proc.stderr
    assert_same_shards(out, reference[0])
    assert hub.faults_served() == {"429": 1, "503": 6, "reset": 1, "stall": 1, "slow": 0, "silence": 0}
    log = proc.stderr
    assert "Rate limited" in log and "Connection reset" in log and "timed out" in log  # the libraries' retries
    ours = [line for line in log.splitlines() if line.startswith("retrying:")]
    assert len(ours) == 1 and "HTTP 503" in ours[0] and "reopening the stream at document" in ours[0]


@pytest.mark.slow
def test_a_kill_mid_part_then_the_same_part_again_through_the_hub_is_identical(hub, ranks, tmp_path, reference):
    out = tmp_path / "out"
    proc = hub_kernel(hub, ranks, out, env={CRASH_ENV: "3"})
    assert proc.returncode == 137, proc.stderr
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 2
    proc = hub_kernel(hub, ranks, out)
    assert proc.returncode == 0, proc.stderr
    assert "resuming part 0: 2 finished shards verified" in proc.stderr
    assert_same_shards(out, reference[0])


@pytest.mark.slow
def test_a_revision_or_a_token_the_hub_refuses_is_one_line(hub_root, ranks, tmp_path):
    token = "hf_local-test-token-7f3a"
    with LocalHub(hub_root, token=token) as gated:
        proc = hub_kernel(gated, ranks, tmp_path / "anon")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith(f"error: {REPO}: cannot pin the revision main to a commit "
                                                        "(HTTP 401: ")
        assert last.endswith("; attach a Hugging Face token as the secret HF_TOKEN")
        assert not (tmp_path / "anon").exists()  # nothing left behind
        proc = hub_kernel(gated, ranks, tmp_path / "token", env={"HF_TOKEN": token})
        assert proc.returncode == 0, proc.stderr
        assert "with the HF_TOKEN secret" in proc.stdout and token not in proc.stdout + proc.stderr
        proc = hub_kernel(gated, ranks, tmp_path / "other", "--dataset", "HuggingFaceFW/missing",
                          env={"HF_TOKEN": token})
        assert proc.returncode == 2 and "HuggingFaceFW/missing: cannot pin the revision main to a commit (HTTP 404" \
            in proc.stderr.strip().splitlines()[-1]


class FlakyStream:
    """A stream that breaks off with a connection reset after `ok_batches` batches, as a dropped link does."""

    def __init__(self, ds, ok_batches: int):
        self.ds, self.ok_batches = ds, ok_batches

    def load_state_dict(self, state) -> None:
        self.ds.load_state_dict(state)

    def state_dict(self):
        return self.ds.state_dict()

    def iter(self, batch_size: int):
        for i, batch in enumerate(self.ds.iter(batch_size=batch_size)):
            if i == self.ok_batches:
                raise ConnectionResetError(104, "Connection reset by peer")
            yield batch


def flaky_opens(monkeypatch, *ok_batches: int) -> list:
    """Each open of the stream breaks off after the next of `ok_batches` batches; later opens do not."""
    real, opened = part_module.open_stream, []

    def open_stream(source):
        opened.append(1)
        ds = real(source)
        return FlakyStream(ds, ok_batches[len(opened) - 1]) if len(opened) <= len(ok_batches) else ds

    monkeypatch.setattr(part_module, "open_stream", open_stream)
    return opened


def test_a_dropped_stream_reopens_at_its_last_boundary_with_the_same_tokens(monkeypatch, corpus, ranks, tmp_path,
                                                                            reference):
    opened = flaky_opens(monkeypatch, 5, 3)
    lines: list[str] = []
    out = tmp_path / "out"
    part_module.tokenize_part(part_module.TokenizeConfig(
        data_files=corpus["parquet"], out_dir=str(out), shard_size=20_000, processes=1, batch_docs=64,
        ranks_path=ranks, progress=False, retry_wait_s=0.01), log=lines.append)
    assert_same_shards(out, reference[0])
    retries = [line for line in lines if line.startswith("retrying:")]
    assert len(opened) == 3 and len(retries) == 2
    assert "ConnectionResetError" in retries[0] and "reopening the stream at document 320 in 0.01 s" in retries[0]
    assert "reopening the stream at document 512 in 0.01 s (retry 2" in retries[1]  # 320 + 3 x 64, after progress


def test_a_fault_whose_wait_would_pass_the_session_deadline_ends_the_part_cleanly(monkeypatch, corpus, ranks,
                                                                                 tmp_path):
    flaky_opens(monkeypatch, 3)
    monkeypatch.setattr(part_module, "seconds_left", lambda deadline: 0.05)  # less than the first wait, 0.1 s
    lines: list[str] = []
    p0 = part_module.tokenize_part(part_module.TokenizeConfig(
        data_files=corpus["parquet"], out_dir=str(tmp_path / "p0"), shard_size=20_000, processes=1, batch_docs=64,
        ranks_path=ranks, progress=False, retry_wait_s=0.1), log=lines.append)
    assert (p0["complete"], p0["stop_reason"], p0["end"]) == (True, "session_deadline", {
        "doc": 192, "offset": 0, "checkpoint": p0["end"]["checkpoint"]})  # the 3 batches read before the fault
    assert any(line.startswith("stopping: the session's deadline") and "comes before the next try" in line
               for line in lines)
    monkeypatch.setattr(part_module, "seconds_left", lambda deadline: 1e9)
    run_tokenize(corpus, ranks, tmp_path / "p1", part=1, prev_dir=str(tmp_path / "p0"))
    np.testing.assert_array_equal(read_tokens(tmp_path / "p0", tmp_path / "p1"), corpus["expected"])


def test_a_fault_that_outlasts_the_retry_budget_is_one_line(monkeypatch, corpus, ranks, tmp_path):
    flaky_opens(monkeypatch, *[0] * 50)  # no batch between faults: the waits double
    with pytest.raises(UserError, match=r"cannot read input \(ConnectionResetError: .*\) \(gave up after 3 retries "
                                        r"over 0.7 s of waiting\)"):
        run_tokenize(corpus, ranks, tmp_path / "out", retry_wait_s=0.1, retry_total_s=1.0)


class _Reply:
    def __init__(self, status: int, headers: dict | None = None):
        self.status_code, self.headers = status, headers or {}


class _HTTPError(Exception):
    def __init__(self, status: int, headers: dict | None = None):
        super().__init__(f"HTTP {status}")
        self.response = _Reply(status, headers)


class ReadTimeout(Exception):  # as httpx/httpx2 name theirs
    pass


def test_which_errors_are_retried_and_how_long_each_wait_is():
    assert all(is_transient(e) for e in (_HTTPError(429), _HTTPError(503), _HTTPError(504), ReadTimeout("x"),
                                         ConnectionResetError(), TimeoutError(), ConnectionError("Disconnected")))
    assert not any(is_transient(e) for e in (_HTTPError(401), _HTTPError(404), ValueError("bad parquet"),
                                             FileNotFoundError("x")))
    wrapped = UserError("cannot read")
    wrapped.__cause__ = _HTTPError(502)
    assert is_transient(wrapped)
    assert retry_after_s(_HTTPError(429, {"Retry-After": "17"})) == 17.0
    assert retry_after_s(_HTTPError(429, {"RateLimit": '"api";r=0;t=42'})) == 42.0
    assert retry_after_s(_HTTPError(503)) is None
    backoff = Backoff(first_s=5, max_s=60, total_s=200, sleep=lambda s: None)
    waits = [backoff.next_wait(_HTTPError(503)) for _ in range(4)]
    assert waits == [5, 10, 20, 40]
    backoff.progress()  # a batch read: the doubling starts over, the total does not
    assert backoff.next_wait(_HTTPError(429, {"Retry-After": "45"})) == 45  # the server asked for more than 5 s
    assert [backoff.next_wait(_HTTPError(503)) for _ in range(4)] == [10, 20, 40, None]  # 60 more would pass 200
    assert (backoff.waited_s, backoff.retries) == (190, 8)


def test_a_state_that_will_not_load_is_read_from_the_start_and_later_boundaries_keep_states(corpus, ranks, tmp_path):
    p0 = run_tokenize(corpus, ranks, tmp_path / "p0", tokens_per_part=60_000)
    manifest = json.loads((tmp_path / "p0" / MANIFEST).read_text())
    manifest["end"]["checkpoint"]["state"] = {"written by": "another datasets version"}
    (tmp_path / "p0" / MANIFEST).write_text(json.dumps(manifest))
    lines: list[str] = []
    p1 = part_module.tokenize_part(part_module.TokenizeConfig(
        data_files=corpus["parquet"], out_dir=str(tmp_path / "p1"), part=1, prev_dir=str(tmp_path / "p0"),
        tokens_per_part=60_000, shard_size=20_000, processes=1, batch_docs=64, ranks_path=ranks, progress=False),
        log=lines.append)
    assert any("does not resume at document" in line and "reading from the start" in line for line in lines)
    n = p0["num_tokens"] + p1["num_tokens"]
    np.testing.assert_array_equal(read_tokens(tmp_path / "p0", tmp_path / "p1"), corpus["expected"][:n])
    assert all(s["checkpoint"]["state"] for s in p1["shards"])  # part 2 resumes from a state, not from the start


def test_the_session_deadline_ends_a_part_cleanly_and_the_next_part_continues(monkeypatch, corpus, ranks, tmp_path):
    checks = []
    monkeypatch.setattr(part_module, "seconds_left", lambda deadline: (checks.append(deadline), 100 - len(checks))[1])
    p0 = run_tokenize(corpus, ranks, tmp_path / "p0", session_deadline=3600.0, batch_docs=10)
    assert (p0["complete"], p0["stop_reason"], checks[0]) == (True, "session_deadline", 3600.0)
    assert len(checks) == 100 and p0["end"]["doc"] == 1000  # stopped after the 100th batch read, at its end
    monkeypatch.setattr(part_module, "seconds_left", lambda deadline: 1e9)
    p1 = run_tokenize(corpus, ranks, tmp_path / "p1", part=1, prev_dir=str(tmp_path / "p0"), batch_docs=10)
    assert p1["stop_reason"] == "end_of_stream"
    np.testing.assert_array_equal(read_tokens(tmp_path / "p0", tmp_path / "p1"), corpus["expected"])


def _hang(seconds: float) -> None:
    time.sleep(seconds)


def test_a_worker_that_never_answers_or_a_tokenizer_that_will_not_load_is_one_line(corpus, tmp_path):
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        started = time.monotonic()
        with pytest.raises(UserError, match=r"a tokenizer process returned nothing within 0.5s"):
            result_of(pool.apply_async(_hang, (60,)), timeout_s=0.5)
        assert time.monotonic() - started < 30
    finally:
        shut_down(pool, wait_s=10)
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_text("not a ranks file\n")
    with pytest.raises(UserError, match=r"^GPT-2's tokenizer could not be loaded \("):
        run_tokenize(corpus, str(bad), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_hf_token_secret_goes_into_the_environment_in_a_session(monkeypatch, tmp_path):
    from shared.kaggle.env import LOCAL_ROOT_ENV, LOCAL_SECRETS_ENV
    from shared.kaggle.secrets import hf_token_to_env

    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert not hf_token_to_env()  # outside a session, only the environment counts
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"KAGGLE_KEY": "k"}))
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path))
    monkeypatch.setenv(LOCAL_SECRETS_ENV, str(secrets))
    assert not hf_token_to_env() and "HF_TOKEN" not in __import__("os").environ  # not attached: anonymous
    secrets.write_text(json.dumps({"HF_TOKEN": "hf_abc"}))
    assert hf_token_to_env() and __import__("os").environ["HF_TOKEN"] == "hf_abc"


def test_the_local_hub_answers_huggingface_hubs_own_client(tmp_path):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    build_fineweb_like(tmp_path, ["one", "two", "three"] * 10, files=2, row_group_rows=4)
    with LocalHub(tmp_path) as hub:
        api, sha = HfApi(endpoint=hub.url, token=False), hub.sha(REPO)
        assert api.dataset_info(REPO).sha == sha == api.dataset_info(REPO, revision=sha).sha
        tree = api.list_repo_tree(REPO, "sample/10BT", repo_type="dataset", revision=sha)
        files = {f.path: f for f in tree}
        data = (tmp_path / REPO / "sample/10BT/001_00000.parquet").read_bytes()
        assert sorted(files) == ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
        assert files["sample/10BT/001_00000.parquet"].size == len(data)
        info = api.get_paths_info(REPO, ["sample/10BT", "README.md", "absent"], repo_type="dataset", revision=sha)
        assert [type(e).__name__ for e in info] == ["RepoFolder", "RepoFile"]
        with pytest.raises(HfHubHTTPError):
            api.dataset_info(REPO, revision="f" * 40)  # a commit the repo does not have
        import urllib.request

        request = urllib.request.Request(f"{hub.url}/datasets/{REPO}/resolve/{sha}/sample/10BT/001_00000.parquet",
                                         headers={"Range": "bytes=10-99"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request) as reply:
            assert reply.status == 206 and reply.read() == data[10:100]
            assert reply.headers["Content-Range"] == f"bytes 10-99/{len(data)}"


def test_a_hub_dataset_whose_reader_takes_no_column_list_is_opened_without_one(monkeypatch, corpus):
    import glob

    import datasets

    from shared.tokenize.source import open_stream

    real, calls = datasets.load_dataset, []

    def load_dataset(path=None, name=None, **kw):
        calls.append(sorted(kw))
        if "columns" in kw:  # what datasets says for a json or csv repo
            raise ValueError("BuilderConfig JsonConfig(name='default') doesn't have a 'columns' key.")
        return real("parquet", data_files=sorted(glob.glob(corpus["parquet"])), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = {"kind": "hub", "dataset": "org/jsonl-corpus", "config": "", "split": "train", "revision": "abc",
              "text_column": "text"}
    first = next(iter(open_stream(source).iter(batch_size=3)))
    assert first.column("text").to_pylist() == corpus["docs"][:3]
    assert calls == [["columns", "revision", "split", "streaming"], ["revision", "split", "streaming"]]


def test_datasets_own_streaming_retries_are_capped_at_five_tries_so_a_longer_fault_reaches_ours(monkeypatch, corpus):
    import glob

    import datasets

    from shared.tokenize.source import STREAMING_RETRIES, open_stream

    for name in STREAMING_RETRIES:  # as datasets ships them (5.2.0: 20 tries), restored after the test
        monkeypatch.setattr(datasets.config, name, 20, raising=False)
    source = {"kind": "local", "format": "parquet", "paths": sorted(glob.glob(corpus["parquet"])),
              "text_column": "text"}
    next(iter(open_stream(source).iter(batch_size=3)))
    assert {name: getattr(datasets.config, name) for name in STREAMING_RETRIES} == {
        "STREAMING_READ_MAX_RETRIES": 5, "STREAMING_READ_RETRY_INTERVAL": 5,
        "STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL": 20, "STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL": 60,
        "STREAMING_OPEN_MAX_RETRIES": 5, "STREAMING_OPEN_RETRY_INTERVAL": 5}


@pytest.fixture
def hub_client_reset():
    """huggingface_hub's own client again after the test (the limit on silence is set for the whole process)."""
    import huggingface_hub
    from huggingface_hub.utils import _http

    import shared.tokenize.hub_client as hub_client

    yield
    huggingface_hub.set_client_factory(_http.default_client_factory)
    hub_client._installed.clear()


def test_a_hub_that_accepts_and_sends_nothing_is_cut_and_the_pin_retried(hub, monkeypatch, hub_client_reset):
    """dataset_info sends no timeout of its own (huggingface_hub 1.x and 2.x): a silent first connection held the
    part until the session's deadline (issue 50). The limit on silence cuts it; our retry says so, in one line."""
    import threading

    from huggingface_hub import constants

    from shared.tokenize.source import resolve_hub_revision

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub.add_fault("silence", match="/api/datasets/", stall_s=600)  # ended by the hub's stop, if nothing cuts it
    lines: list[str] = []
    got: list[str] = []
    pin = threading.Thread(target=lambda: got.append(resolve_hub_revision(
        REPO, "", Backoff(first_s=0.01, total_s=5), lines.append)), daemon=True)
    pin.start()
    pin.join(timeout=120)  # a guard, 120 times the limit: the pin must not wait out the silence
    assert got == [hub.sha(REPO)]
    assert hub.faults_served()["silence"] == 1
    (line,) = lines
    assert line.startswith(f"retrying: {REPO}'s revision (nothing received for 1 s, the connection was cut: ")
    assert "Timeout" in line and line.endswith(") in 0.01 s")


def tiktoken_alone(folder: Path) -> str:
    """This venv's tiktoken (and its ranks' loader) on a path of its own, for an image's stand-in that lacks it (a
    session installs it: shared/kaggle/packages.py); the same Python, so its compiled part loads."""
    import tiktoken
    import tiktoken_ext

    folder.mkdir()
    for module in (tiktoken, tiktoken_ext):
        (folder / module.__name__).symlink_to(Path(list(module.__path__)[0]))
    return str(folder)


@pytest.mark.slow  # a kernel process in the CPU image's stand-in (10 s)
def test_silent_connections_are_cut_and_retried_on_the_cpu_images_versions(hub, ranks, tmp_path, reference,
                                                                            image_pythons):
    """On what the CPU image has (datasets 4.0.0, huggingface_hub 1.11.0: scripts/image_pins/kaggle-cpu.txt): the
    first connection and a range read mid-stream send nothing for longer than the 2 s limit, and 429s outlast
    huggingface_hub's retries (datasets 4.0.0 retries none): the part ends with the fault-free run's tokens."""
    hub.add_fault("silence", match="/api/datasets/", stall_s=600)  # pinning the revision: part 0's first request
    hub.add_fault("silence", match="001_00000", stall_s=600)  # a range read of the second file
    hub.add_fault("429", match="002_00000", count=6, retry_after=0)
    out = tmp_path / "out"
    proc = hub_kernel(hub, ranks, out, python=str(image_pythons["cpu"]),
                      env={"PYTHONPATH": tiktoken_alone(tmp_path / "tiktoken")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_shards(out, reference[0])
    libraries = json.loads((out / MANIFEST).read_text())["libraries"]
    assert (libraries["datasets"], libraries["huggingface_hub"], libraries["pyarrow"]) == ("4.0.0", "1.11.0", "18.1.0")
    assert hub.faults_served() == {"429": 6, "503": 0, "reset": 0, "stall": 0, "slow": 0, "silence": 2}
    ours = [line for line in proc.stderr.splitlines() if line.startswith("retrying:")]
    assert len(ours) == 2
    assert ours[0].startswith(f"retrying: {REPO}'s revision (nothing received for 2 s, the connection was cut: ")
    assert "HTTP 429" in ours[1] and "reopening the stream at document" in ours[1]
    # the range read: cut, and retried by huggingface_hub for the same bytes
    assert any("timed out' thrown while requesting GET" in line and "001_00000" in line
               for line in proc.stderr.splitlines())
    assert "this run: " in proc.stdout and " of it streaming (" in proc.stdout  # the whole time, the pin included
