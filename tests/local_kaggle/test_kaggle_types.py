"""The local Kaggle speaks kagglesdk's types: every JSON reply uses only the json field names of the route's
kagglesdk response type (recursively into nested messages), with enum values by name, no nulls, and parses
back to the same JSON (`from_dict`); the fields the chain reads are there. The calls are the chain's own,
made by the real KaggleApi / kagglesdk client in a subprocess that records each raw reply."""

from __future__ import annotations

import datetime as dt
import enum
import json
import textwrap
import urllib.parse

import pytest
from kaggle_fixtures import USER, load_local_kaggle_module, wait_for, write_kernel
from kagglesdk.datasets.types.dataset_enums import DatabundleVersionStatus
from kagglesdk.kaggle_object import KaggleObject, ListSerializer, TimeDeltaSerializer
from kagglesdk.kernels.types.kernels_api_service import ApiAcceleratorQuota
from kagglesdk.kernels.types.kernels_enums import KernelWorkerStatus

KS, DS = "kernels.KernelsApiService", "datasets.DatasetApiService"

# What the chain (scripts/chain/, shared/kaggle/publish.py) and the CLI code it runs read from each reply: json paths
# that some reply of the route must carry (a list is entered: "files.url" is every file's url).
CHAIN_READS = {
    f"{DS}/GetDatasetStatus": ["status"],
    "blobs.BlobApiService/StartBlobUpload": ["token", "createUrl"],
    f"{DS}/CreateDataset": ["ref", "url", "status"],
    f"{DS}/CreateDatasetVersion": ["ref", "url", "status"],
    f"{KS}/SaveKernel": ["url", "versionNumber", "error", "invalidDatasetSources"],
    f"{KS}/GetKernel": ["metadata.currentVersionNumber", "blob.source"],
    f"{KS}/GetKernelSessionStatus": ["status", "failureMessage"],
    f"{KS}/ListKernelSessionOutput": ["files.url", "files.fileName", "log"],
    f"{KS}/GetAcceleratorQuotaStatistics": ["quotaRefreshTime", "gpuQuota.timeUsed", "gpuQuota.totalTimeAllowed",
                                            "tpuQuota.timeUsed", "tpuQuota.totalTimeAllowed"],
}
# Routes the chain calls whose success reply is not a JSON object (HttpRedirect: the file itself).
CHAIN_REDIRECTS = {f"{DS}/DownloadDataset"}


# 'service/Method' -> (request type, response type), read from kagglesdk's own service clients (not a list
# kept by hand; the local Kaggle serves from the same reading).
SDK_ROUTES = load_local_kaggle_module().SDK_ROUTES


def _is_message(t) -> bool:
    return isinstance(t, type) and issubclass(t, KaggleObject)


def fit_errors(raw, cls: type, path: str | None = None) -> list[str]:
    """Why `raw` is not `cls` on the wire: keys that are not json field names, nulls, enum values that are not
    names, wrong containers; recursive into nested messages."""
    path = path or cls.__name__
    if not isinstance(raw, dict):
        return [f"{path}: {type(raw).__name__}, not a JSON object"]
    fields = {f.json_name: f for f in cls._fields}
    errors = []
    for key, value in raw.items():
        where = f"{path}.{key}"
        field = fields.get(key)
        if field is None:
            errors.append(f"{where}: {cls.__name__} has no such field (it has {sorted(fields)})")
            continue
        if value is None:
            errors.append(f"{where}: null (an unset field is left out)")
            continue
        is_list = isinstance(field.serializer, ListSerializer)
        if is_list != isinstance(value, list):
            errors.append(f"{where}: {'a list' if is_list else 'a single value'} expected, got {value!r:.80}")
            continue
        for i, item in enumerate(value if is_list else [value]):
            at = f"{where}[{i}]" if is_list else where
            if _is_message(field.field_type):
                errors += fit_errors(item, field.field_type, at)
            elif isinstance(field.field_type, type) and issubclass(field.field_type, enum.Enum):
                if item not in field.field_type.__members__:
                    errors.append(f"{at}: {item!r} is not a {field.field_type.__name__} name")
            elif field.field_type in (dt.datetime, dt.timedelta):
                if not isinstance(item, str):
                    errors.append(f"{at}: {item!r} is not a string")
            elif not isinstance(item, field.field_type) or (field.field_type is int and isinstance(item, bool)):
                if not (field.field_type is float and isinstance(item, int)):
                    errors.append(f"{at}: {item!r:.80} is not {field.field_type.__name__}")
    return errors


def _has_duration(cls: type, seen=None) -> bool:
    seen = seen or set()
    if cls in seen:
        return False
    seen.add(cls)
    return any(isinstance(f.serializer, TimeDeltaSerializer)
               or (_is_message(f.field_type) and _has_duration(f.field_type, seen)) for f in cls._fields)


def assert_fits(raw, cls: type, what: str) -> None:
    errors = fit_errors(raw, cls)
    assert not errors, f"{what}: reply is not a {cls.__name__}:\n  " + "\n  ".join(errors)
    parsed = cls.from_dict(raw)  # what the client does with the body
    module = load_local_kaggle_module()
    assert module.to_wire(parsed) == raw, f"{what}: {cls.__name__}.from_dict does not round-trip {raw}"
    if not _has_duration(cls):  # kagglesdk's own to_dict mis-writes Durations (see test_durations_on_the_wire)
        assert parsed.to_dict() == raw, f"{what}: {cls.__name__}.to_dict() differs from {raw}"


def paths_of(raw, prefix: str = "") -> set[str]:
    out = set()
    for key, value in raw.items():
        here = f"{prefix}{key}"
        out.add(here)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                out |= paths_of(item, here + ".")
    return out


def route_of(url: str) -> str:
    path = urllib.parse.urlsplit(url).path
    return path.split("/api/v1/", 1)[1] if "/api/v1/" in path else path


CLIENT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    from kagglesdk.kaggle_http_client import KaggleHttpClient

    replies = []
    original = KaggleHttpClient._prepare_response

    def recording(self, response_type, http_response):
        first = http_response.history[0] if http_response.history else http_response
        entry = {"url": first.request.url, "status": first.status_code,
                 "ctype": http_response.headers.get("Content-Type", ""),
                 "final_status": http_response.status_code}
        if "application/json" in entry["ctype"]:
            entry["body"] = http_response.json()
        replies.append(entry)
        return original(self, response_type, http_response)

    KaggleHttpClient._prepare_response = recording

    from kaggle.api.kaggle_api_extended import KaggleApi
    from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest
    from requests.exceptions import HTTPError

    work = Path(sys.argv[1])
    api = KaggleApi()
    api.authenticate()
    out = {}
    ds = "alice/types-ckpt"
    try:
        api.dataset_status(ds)
    except HTTPError as err:
        out["absent"] = err.response.status_code
    r = api.dataset_create_new(str(work / "ds1"), public=False, quiet=True, dir_mode="skip")
    out["created"] = [r.status, r.error]
    out["status1"] = api.dataset_status(ds)
    r = api.dataset_create_version(str(work / "ds2"), "second", quiet=True, dir_mode="skip")
    out["versioned"] = [r.status, r.error]
    api.dataset_download_file(ds, "manifest.json", str(work / "dl"), force=True, quiet=True)
    out["manifest"] = (work / "dl" / "manifest.json").read_text()

    def kernel_info(ref):
        owner, slug = ref.split("/")
        with api.build_kaggle_client() as client:
            req = ApiGetKernelRequest()
            req.user_name, req.kernel_slug = owner, slug
            resp = client.kernels.kernels_api_client.get_kernel(req)
        return [resp.metadata.current_version_number, resp.blob.source]

    def run(folder, ref):
        r = api.kernels_push(str(work / folder), timeout="60")
        pushed = [r.version_number, r.error, list(r.invalid_dataset_sources), r.url]
        seen = []
        while True:
            s = api.kernels_status(ref)
            if not seen or seen[-1][0] != s.status.name:
                seen.append([s.status.name, s.failure_message])
            if s.status.name in ("COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED", "CANCEL_REQUESTED"):
                return pushed, seen
            time.sleep(0.1)

    out["good"] = run("good", "alice/types-good")
    out["good_info"] = kernel_info("alice/types-good")
    files, _ = api.kernels_output("alice/types-good", str(work / "out"), file_pattern=None, force=True, quiet=True)
    out["good_files"] = sorted(os.path.relpath(f, work / "out") for f in files)
    out["bad"] = run("bad", "alice/types-bad")
    r = api.kernels_push(str(work / "missing"), timeout="60")
    out["missing"] = [r.version_number, r.error, list(r.invalid_dataset_sources)]
    r = api.kernels_push(str(work / "tpu"), timeout="60")
    out["refused"] = [r.version_number, r.error]
    q = api.quota_view()
    out["quota"] = [q.gpu_quota.time_used.total_seconds(), q.gpu_quota.total_time_allowed.total_seconds(),
                    q.tpu_quota.total_time_allowed.total_seconds(), q.quota_refresh_time.isoformat()]
    (work / "replies.json").write_text(json.dumps(replies))
    print(json.dumps(out))
    """
)


def test_chain_calls_get_kagglesdk_replies(local_kaggle, tmp_path):
    """Drive every call the chain makes through the real client and check each raw reply against kagglesdk."""
    lk = local_kaggle
    work = tmp_path / "work"
    for name, files in (("ds1", {"manifest.json": '{"step": 1}'}), ("ds2", {"manifest.json": '{"step": 2}',
                                                                            "model.bin": b"\x00" * 100})):
        folder = work / name
        folder.mkdir(parents=True)
        for fname, data in files.items():
            (folder / fname).write_bytes(data.encode() if isinstance(data, str) else data)
        (folder / "dataset-metadata.json").write_text(json.dumps(
            {"id": "alice/types-ckpt", "title": "types checkpoints", "licenses": [{"name": "CC0-1.0"}]}))
    good = textwrap.dedent("""
        import os
        os.makedirs("sub", exist_ok=True)
        open("publish.json", "w").write("{}")
        open("sub/metrics.jsonl", "w").write("{}\\n")
        print("hello from the kernel", flush=True)
        """)
    write_kernel(work / "good", "alice/types-good", good, dataset_sources=["alice/types-ckpt"],
                 machine_shape="NvidiaTeslaT4", enable_internet=True)
    write_kernel(work / "bad", "alice/types-bad", "raise SystemExit(2)\n")
    write_kernel(work / "missing", "alice/types-missing", "print(1)\n", dataset_sources=["alice/no-such-data"])
    write_kernel(work / "tpu", "alice/types-tpu", "print(1)\n", machine_shape="TpuV38")
    lk.app.quota_s["tpu"] = 0.0  # a TPU push is refused in the push reply's `error`
    (work / "client.py").write_text(CLIENT)

    proc = lk.python(f"import runpy, sys; sys.argv = ['client', {str(work)!r}]; "
                     f"runpy.run_path({str(work / 'client.py')!r}, run_name='__main__')", timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    # What the client parsed: the chain's view of each call.
    assert out["absent"] == 404
    assert out["created"][0] == out["versioned"][0] == "Ok" and not out["created"][1] and not out["versioned"][1]
    assert out["status1"] == "ready" and json.loads(out["manifest"]) == {"step": 2}
    (number, error, invalid, url), statuses = out["good"]
    assert number == 1 and error == "" and invalid == [] and url
    assert statuses[-1] == ["COMPLETE", ""]
    assert out["good_info"][0] == 1 and "hello from the kernel" in out["good_info"][1]
    assert out["good_files"] == ["publish.json", "sub/metrics.jsonl", "types-good.log"]  # the log: `log`
    assert out["bad"][1][-1] == ["ERROR", "Kernel process exited with code 2"]
    assert out["missing"][0] == 1 and out["missing"][2] == ["alice/no-such-data"]
    assert out["refused"][0] == 0 and "TPU quota" in out["refused"][1]
    assert out["quota"][1] == lk.app.quota_s["gpu"] and out["quota"][2] == 0.0 and out["quota"][0] > 0

    replies = json.loads((work / "replies.json").read_text())
    seen: dict[str, set[str]] = {}
    for reply in replies:
        route = route_of(reply["url"])
        assert route in SDK_ROUTES, f"{route} is not a kagglesdk route"
        _, response_type = SDK_ROUTES[route]
        if reply["status"] >= 400:  # an error: kagglesdk reads only code and message
            assert reply["body"] == {"code": reply["status"], "message": reply["body"]["message"]}, reply
            continue
        if route in CHAIN_REDIRECTS:
            assert reply["status"] in (301, 302, 303, 307, 308) and reply["final_status"] == 200, reply
            assert "body" not in reply, reply  # the file itself, not JSON
            seen.setdefault(route, set())
            continue
        assert "application/json" in reply["ctype"], reply
        body = reply["body"]
        assert_fits(body, response_type, route)
        seen.setdefault(route, set()).update(paths_of(body))
        if route == f"{KS}/GetKernelSessionStatus" and "status" in body:
            assert body["status"] in KernelWorkerStatus.__members__
        if route == f"{DS}/GetDatasetStatus":
            assert body["status"] in DatabundleVersionStatus.__members__

    assert set(seen) == set(CHAIN_READS) | CHAIN_REDIRECTS, f"routes called: {sorted(seen)}"
    for route, paths in CHAIN_READS.items():
        missing = [p for p in paths if p not in seen[route]]
        assert not missing, f"{route}: no reply carried {missing} (the chain reads them)"


def test_other_routes_reply_with_kagglesdk_types(local_kaggle, tmp_path):
    """The routes the chain does not call, straight through the server's dispatcher."""
    lk = local_kaggle
    app = lk.app
    tokens = []
    for name, data in (("a.txt", b"hello"), ("b.bin", b"\x01\x02")):
        start = app.api(USER, "blobs.BlobApiService", "StartBlobUpload",
                        {"type": "DATASET", "name": name, "contentLength": len(data)})
        token = start["token"]
        app.uploads.path(token).write_bytes(data)
        app.state["uploads"][token].update(received=len(data), complete=True)
        tokens.append({"token": token})
    created = app.api(USER, DS, "CreateDataset", {"ownerSlug": USER, "slug": "other-data", "title": "Other data",
                                                  "licenseName": "CC0-1.0", "files": tokens})
    assert created["status"] == "Ok"
    kdir = write_kernel(tmp_path / "k", "alice/other-kernel", "import time\ntime.sleep(30)\n")
    lk.cli("kernels", "push", "-p", str(kdir))
    wait_for(lambda: app.kernel_status("alice/other-kernel")[0] == "RUNNING")

    calls = [
        (KS, "ListKernels", {"group": "PROFILE", "pageSize": 20}),
        (KS, "ListKernels", {"search": "other"}),
        (KS, "GetKernel", {"userName": USER, "kernelSlug": "other-kernel"}),
        (KS, "GetKernelSessionStatus", {"userName": USER, "kernelSlug": "other-kernel"}),
        (KS, "ListKernelSessionOutput", {"userName": USER, "kernelSlug": "other-kernel", "pageSize": 20,
                                         "pageToken": ""}),
        (KS, "GetAcceleratorQuotaStatistics", {}),
        (DS, "GetDataset", {"ownerSlug": USER, "datasetSlug": "other-data"}),
        (DS, "GetDatasetStatus", {"ownerSlug": USER, "datasetSlug": "other-data"}),
        (DS, "GetDatasetMetadata", {"ownerSlug": USER, "datasetSlug": "other-data"}),
        (DS, "ListDatasetFiles", {"ownerSlug": USER, "datasetSlug": "other-data", "pageSize": 1}),
        (DS, "ListDatasets", {"group": "DATASET_SELECTION_GROUP_MY"}),
        ("security.OAuthService", "IntrospectToken", {"token": "alice-key"}),
    ]
    for service, method, request in calls:
        route = f"{service}/{method}"
        request_type, response_type = SDK_ROUTES[route]
        assert request_type.from_dict(request).to_dict() == request, f"{route}: the test's request is not kagglesdk's"
        assert_fits(app.api(USER, service, method, request), response_type, route)

    # CancelKernelSession: the real request names the session by kernelSessionId, and nothing else.
    session_id = app.session_id("alice/other-kernel")
    assert session_id > 0
    cancel = app.api(USER, KS, "CancelKernelSession", {"kernelSessionId": session_id})
    assert_fits(cancel, SDK_ROUTES[f"{KS}/CancelKernelSession"][1], "CancelKernelSession")
    assert lk.wait("alice/other-kernel") == ("CANCEL_ACKNOWLEDGED", "Cancelled by the user")
    again = app.api(USER, KS, "CancelKernelSession", {"kernelSessionId": session_id})
    assert_fits(again, SDK_ROUTES[f"{KS}/CancelKernelSession"][1], "CancelKernelSession")
    assert "already ended" in again["errorMessage"]
    module = load_local_kaggle_module()
    with pytest.raises(module.ApiError) as err:  # the stand-in's old request shape names no session
        app.api(USER, KS, "CancelKernelSession", {"userName": USER, "kernelSlug": "other-kernel"})
    assert err.value.status == 404

    for service, method, request in ((KS, "DeleteKernel", {"userName": USER, "kernelSlug": "other-kernel"}),
                                     (DS, "DeleteDataset", {"ownerSlug": USER, "datasetSlug": "other-data"})):
        route = f"{service}/{method}"
        assert_fits(app.api(USER, service, method, request), SDK_ROUTES[route][1], route)


def test_served_routes_are_kagglesdk_routes():
    module = load_local_kaggle_module()
    assert set(module.API_ROUTES) <= set(SDK_ROUTES), set(module.API_ROUTES) - set(SDK_ROUTES)
    assert set(CHAIN_READS) | CHAIN_REDIRECTS <= set(module.API_ROUTES)
    for route in module.API_ROUTES:
        assert module.SDK_ROUTES[route] == SDK_ROUTES[route], route


def test_bad_requests_are_refused(local_kaggle):
    module = load_local_kaggle_module()
    with pytest.raises(module.ApiError) as err:
        lk_app = local_kaggle.app
        lk_app.api(USER, KS, "ListKernels", {"group": "NO_SUCH_GROUP"})
    assert err.value.status == 400 and "ApiListKernelsRequest" in err.value.message
    with pytest.raises(module.ApiError) as err:
        local_kaggle.app.api(USER, KS, "ListKernels", ["not", "an", "object"])
    assert err.value.status == 400
    with pytest.raises(module.ApiError) as err:
        local_kaggle.app.api(USER, KS, "ListKernelFiles", {})
    assert err.value.status == 404 and "does not implement" in err.value.message


@pytest.mark.parametrize("delta, wire", [
    (dt.timedelta(0), "0s"),
    (dt.timedelta(hours=30), "108000s"),
    (dt.timedelta(seconds=1.5), "1.500s"),
    (dt.timedelta(seconds=2, microseconds=7), "2.000007s"),
])
def test_durations_on_the_wire(delta, wire):
    """kagglesdk 0.1.37 writes a Duration from timedelta.seconds (30 h -> "21600s") and a fraction as "1.500.0s",
    which its own parser rejects; the server writes the protobuf form, which the client parses back exactly."""
    module = load_local_kaggle_module()
    quota = ApiAcceleratorQuota()
    quota.time_used = delta
    assert module.to_wire(quota) == {"timeUsed": wire}
    assert ApiAcceleratorQuota.from_dict({"timeUsed": wire}).time_used == delta
