"""The local Kaggle's HTTP faults that last a while: every read (a call that changes nothing) answering 5xx or 429
with its Retry-After until the fault's time is up, writes untouched; and a create that makes its version and answers
a fault all the same (a gateway's 5xx after the work was done). Driven through the real kaggle client."""

import json
import textwrap

from kaggle_fixtures import write_dataset

DATASET = "alice/fault-rules"

CALLS = """
import json
from kaggle.api.kaggle_api_extended import KaggleApi
api = KaggleApi(); api.authenticate()

def answer(call):
    try:
        call()
        return "ok"
    except Exception as err:
        response = getattr(err, "response", None)
        return [response.status_code, response.headers.get("Retry-After")]

out = {{
    "status": answer(lambda: api.dataset_status({ds!r})),
    "files": answer(lambda: api.dataset_list_files({ds!r} + "/1")),
    "create": answer(lambda: api.dataset_create_version({folder!r}, "a write", quiet=True)),
}}
print(json.dumps(out))
"""


def calls(lk, folder) -> dict:
    code = textwrap.dedent(CALLS.format(ds=DATASET, folder=str(folder)))
    return json.loads(lk.python(code).stdout.strip().splitlines()[-1])


def versions(lk) -> list[int]:
    with lk.app.store.lock:
        return [v["number"] for v in lk.app.state["datasets"][DATASET]["versions"]]


def test_a_read_fault_answers_every_read_with_its_retry_after_while_it_lasts_and_no_write(local_kaggle, tmp_path):
    lk = local_kaggle
    folder = write_dataset(tmp_path / "ds", DATASET, {"a.txt": "one"})
    lk.cli("datasets", "create", "-p", str(folder))
    lk.app.inject("http", match="read", status=429, retry_after=7, for_s=600.0)
    assert calls(lk, folder) == {"status": [429, "7"], "files": [429, "7"], "create": "ok"}
    assert versions(lk) == [1, 2]
    assert calls(lk, folder) == {"status": [429, "7"], "files": [429, "7"], "create": "ok"}  # not used up
    lk.app.faults.clear()
    lk.app.inject("http", match="read", status=503, for_s=0.0)  # its time is up at once
    assert calls(lk, folder) == {"status": "ok", "files": "ok", "create": "ok"}
    assert lk.app.faults.http == []


def test_a_fault_after_the_call_answers_it_once_the_version_is_made(local_kaggle, tmp_path):
    lk = local_kaggle
    folder = write_dataset(tmp_path / "ds", DATASET, {"a.txt": "one"})
    lk.cli("datasets", "create", "-p", str(folder))
    lk.app.inject("http", match="CreateDatasetVersion", status=502, after=True)
    assert calls(lk, folder) == {"status": "ok", "files": "ok", "create": [502, None]}
    assert versions(lk) == [1, 2]  # made, though the client was told 502
    assert calls(lk, folder)["create"] == "ok" and versions(lk) == [1, 2, 3]  # once
