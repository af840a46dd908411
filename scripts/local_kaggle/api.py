"""The API the local Kaggle serves, in kagglesdk's own types.

Here: each route's request and reply types, read from kagglesdk's service clients (`SDK_ROUTES`); replies built
through the types' typed setters (`message`) and written as the client reads them (`to_wire`); `call_api`, which
reads a request as its route's request type and checks the reply's type; the routes (`API_ROUTES`) and the kagglesdk
messages that describe a kernel, a dataset and the quota. The routes use `ApiParts`, the server's parts.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from kagglesdk.blobs.services.blob_api_service import BlobApiClient
from kagglesdk.blobs.types.blob_api_service import ApiStartBlobUploadResponse
from kagglesdk.datasets.services.dataset_api_service import DatasetApiClient
from kagglesdk.datasets.types.dataset_api_service import (
    ApiCreateDatasetResponse,
    ApiDataset,
    ApiDatasetFile,
    ApiDatasetVersion,
    ApiDeleteDatasetResponse,
    ApiGetDatasetMetadataResponse,
    ApiGetDatasetStatusResponse,
    ApiListDatasetFilesResponse,
    ApiListDatasetsResponse,
    ApiUpdateDatasetMetadataResponse,
)
from kagglesdk.datasets.types.dataset_enums import DatabundleVersionStatus, DatasetSelectionGroup
from kagglesdk.datasets.types.dataset_types import DatasetInfo, SettingsLicense
from kagglesdk.kaggle_object import KaggleObject
from kagglesdk.kernels.services.kernels_api_service import KernelsApiClient
from kagglesdk.kernels.types.kernels_api_service import (
    ApiAcceleratorQuota,
    ApiCancelKernelSessionResponse,
    ApiDeleteKernelResponse,
    ApiGetAcceleratorQuotaStatisticsResponse,
    ApiGetKernelResponse,
    ApiGetKernelSessionStatusResponse,
    ApiKernelBlob,
    ApiKernelMetadata,
    ApiKernelSessionOutputFile,
    ApiListKernelSessionOutputResponse,
    ApiListKernelsResponse,
    ApiSaveKernelResponse,
)
from kagglesdk.kernels.types.kernels_enums import KernelsListViewType, KernelWorkerStatus
from kagglesdk.security.services.oauth_service import OAuthClient
from kagglesdk.security.types.oauth_service import IntrospectTokenResponse

from .datasets import Datasets, Uploads, is_ready, live_versions
from .kernels import Kernels
from .rules import MACHINE_SHAPES, TERMINAL, WEEK_S, ApiError, Faults, utc, week_start
from .sessions import Scheduler
from .state import Accounts, Quota, Store

# ----- kagglesdk's types on the wire -----


def duration(delta: dt.timedelta) -> str:
    """A protobuf Duration in its JSON form ("108000s", "1.500s"), which kagglesdk's TimeDeltaSerializer reads back
    exactly. Its own writer is not used: in kagglesdk 0.1.37 it writes `timedelta.seconds` (30 h -> "21600s", the
    whole days dropped) and a fraction as "1.500.0s", which its reader rejects."""
    whole, micros = divmod(max(0, delta // dt.timedelta(microseconds=1)), 10**6)
    if not micros:
        return f"{whole}s"
    frac = f"{micros:06d}"
    return f"{whole}.{frac[:3] if frac.endswith('000') else frac}s"


def _sdk_routes() -> dict[str, tuple[type, type]]:
    """'service/Method' -> (request type, reply type) of every route of kagglesdk's kernels, datasets, blobs and
    OAuth clients, read from the clients themselves: each method calls
    `http_client.call(service, method, request, reply_type)`."""
    routes = {}

    class Recorder:
        def call(self, service, method, request, response_type):
            routes[f"{service}/{method}"] = (type(request), response_type)

    for client_cls in (KernelsApiClient, DatasetApiClient, BlobApiClient, OAuthClient):
        client = client_cls(Recorder())
        for name in dir(client):
            if not name.startswith("_"):
                getattr(client, name)()
    return routes


SDK_ROUTES = _sdk_routes()


def message(cls: type, **fields: Any) -> KaggleObject:
    """A kagglesdk message with `fields` set through its typed setters: a field the type does not have raises
    AttributeError, a value of the wrong type TypeError. None leaves a field unset."""
    obj = cls()
    for name, value in fields.items():
        if value is not None:
            setattr(obj, name, value)
    return obj


def to_wire(obj: KaggleObject) -> dict:
    """The JSON of a kagglesdk message: `obj.to_dict()` (json names, fields at their default left out, enums by
    name, datetimes as ISO with Z), except that Durations are written by `duration`."""
    out = {}
    for field in obj._fields:
        value = getattr(obj, field.private_field_name)
        if value is None or value == field.default_value:
            continue
        if isinstance(value, KaggleObject):
            out[field.json_name] = to_wire(value)
        elif isinstance(value, dt.timedelta):
            out[field.json_name] = duration(value)
        elif isinstance(value, list) and any(isinstance(v, (KaggleObject, dt.timedelta)) for v in value):
            out[field.json_name] = [to_wire(v) if isinstance(v, KaggleObject) else duration(v) for v in value]
        else:
            out[field.json_name] = field.serializer.to_dict_value(field.field_type, value, True)
    return out


# ----- replies that describe a kernel, a dataset, the quota -----


def kernel_reply(kernel: dict) -> ApiKernelMetadata:
    """The kagglesdk message describing a kernel, as of its newest version."""
    last = kernel["versions"][-1] if kernel["versions"] else {}
    shape = last.get("machine_shape")
    return message(
        ApiKernelMetadata,
        id=kernel["id"],
        ref=kernel["ref"],
        title=kernel.get("title", kernel["slug"]),
        author=kernel["owner"],
        slug=kernel["slug"],
        last_run_time=utc(last.get("started") or last.get("created")),
        language=kernel.get("language"),
        kernel_type=kernel.get("kernel_type"),
        is_private=kernel.get("is_private", True),
        enable_gpu=MACHINE_SHAPES.get(shape) == "gpu",
        enable_tpu=MACHINE_SHAPES.get(shape) == "tpu",
        enable_internet=last.get("enable_internet", True),
        dataset_data_sources=list(last.get("dataset_sources", [])),
        kernel_data_sources=list(last.get("kernel_sources", [])),
        competition_data_sources=list(last.get("competition_sources", [])),
        current_version_number=last.get("number"),
        machine_shape=shape,
    )


def created_reply(ref: str) -> ApiCreateDatasetResponse:
    """What CreateDataset(Version) answers when it accepted the upload."""
    return message(ApiCreateDatasetResponse, ref=ref, url=f"http://localhost/datasets/{ref}", status="Ok")


def _described(ds: dict) -> dict:
    """The fields that `ApiDataset` and `DatasetInfo` both name alike."""
    return {"title": ds["title"], "subtitle": ds.get("subtitle"), "description": ds.get("description"),
            "is_private": ds["is_private"]}


def dataset_info(ds: dict) -> DatasetInfo:
    """The kagglesdk message of a dataset's metadata (GetDatasetMetadata)."""
    return message(DatasetInfo, dataset_id=ds["id"], dataset_slug=ds["slug"], owner_user=ds["owner"],
                   licenses=[message(SettingsLicense, name=ds["license"])], **_described(ds))


def dataset_reply(ds: dict, live: list[dict] | None = None, own_status: bool = True) -> ApiDataset:
    """The kagglesdk message describing a dataset and its live versions (default: all of them; the newest is the
    current version), each with its own status unless `own_status` is off (Settings.version_status_in_versions)."""
    live = live_versions(ds) if live is None else live
    current = live[-1] if live else None
    return message(
        ApiDataset,
        id=ds["id"],
        ref=ds["ref"],
        **_described(ds),
        owner_name=ds["owner"],
        owner_ref=ds["owner"],
        creator_name=ds["owner"],
        license_name=ds["license"],
        url=f"http://localhost/datasets/{ds['ref']}",
        last_updated=utc(ds.get("updated", ds["created"])),
        total_bytes=sum(f["size"] for f in current["files"]) if current else 0,
        current_version_number=current["number"] if current else None,
        versions=[
            message(
                ApiDatasetVersion,
                version_number=v["number"],
                creation_date=utc(v["created"]),
                version_notes=v.get("notes"),
                creator_name=v.get("creator"),
                # A free-form string in kagglesdk; what Kaggle puts there is not known.
                status=("ready" if is_ready(v) else "pending") if own_status else None,
            )
            for v in live
        ],
    )


def quota_reply(quota: Quota, user: str) -> ApiGetAcceleratorQuotaStatisticsResponse:
    """GetAcceleratorQuotaStatistics: this week's use and allowance of each kind, and when the week ends."""
    now = time.time()
    quotas = {
        kind: message(
            ApiAcceleratorQuota,
            time_used=dt.timedelta(seconds=quota.used_s(user, kind, now)),
            total_time_allowed=dt.timedelta(seconds=quota.allowed_s[kind]),
            has_ever_run=quota.has_run(user, kind),
        )
        for kind in ("gpu", "tpu")
    }
    return message(ApiGetAcceleratorQuotaStatisticsResponse, quota_refresh_time=utc(week_start(now) + WEEK_S),
                   gpu_quota=quotas["gpu"], tpu_quota=quotas["tpu"])


# ----- the routes -----

@dataclass
class ApiParts:
    """What the routes use: the server's state and parts."""

    store: Store
    kernels: Kernels
    scheduler: Scheduler
    datasets: Datasets
    uploads: Uploads
    quota: Quota
    faults: Faults
    accounts: Accounts | None = None  # IntrospectToken's answers


def call_api(parts: ApiParts, user: str, service: str, method: str, body: Any) -> dict:
    """One API call: `body` (the request JSON) is read as the route's kagglesdk request type, and the reply is an
    instance of the route's kagglesdk reply type, returned as its JSON (`to_wire`)."""
    key = f"{service}/{method}"
    fn, types = API_ROUTES.get(key), SDK_ROUTES.get(key)
    if fn is None or types is None:
        raise ApiError(404, f"The local Kaggle does not implement {key}")
    request_type, reply_type = types
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body is not a JSON object ({request_type.__name__})")
    try:
        req = request_type.from_dict(body)
    except Exception as err:  # an enum value the type does not have, say
        raise ApiError(400, f"The request is not a valid {request_type.__name__}: {err!r}") from None
    reply = fn(parts, user, req)
    if not isinstance(reply, reply_type):
        raise TypeError(f"{key} replied with {type(reply).__name__}, not {reply_type.__name__}")
    return to_wire(reply)


def _paginate(items: list, req: KaggleObject, default_size: int = 20) -> tuple[list, str]:
    """One page of `items` and the next page's token ("" on the last page): a token is a decimal offset."""
    size = getattr(req, "page_size", 0) or default_size
    token = getattr(req, "page_token", "")
    if token:
        try:
            start = int(token)
        except ValueError:
            raise ApiError(400, f"Invalid page token {token!r}") from None
    elif getattr(req, "page", 0):
        start = (req.page - 1) * size
    else:
        start = 0
    page = items[start : start + size]
    nxt = str(start + size) if start + size < len(items) else ""
    return page, nxt


def _matching(items: list[dict], user: str, mine: bool, req: KaggleObject) -> list[dict]:
    """A listing's records (kernels or datasets): `mine` or those `user` may see, then the request's filters."""
    items = [d for d in items if d["owner"] == user] if mine else \
        [d for d in items if not d.get("is_private", True) or d["owner"] == user]
    if req.user:
        items = [d for d in items if d["owner"] == req.user]
    if req.search:
        s = req.search.lower()
        items = [d for d in items if s in d["ref"].lower() or s in d.get("title", "").lower()]
    return items


# ----- kernels -----

def _kernel_ref(req: KaggleObject) -> str:
    return f"{req.user_name}/{req.kernel_slug}"


def _list_kernels(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        kernels = _matching(list(parts.store.state["kernels"].values()), user,
                            req.group == KernelsListViewType.PROFILE, req)
        if req.dataset:
            kernels = [k for k in kernels if k["versions"] and req.dataset in k["versions"][-1]["dataset_sources"]]
        kernels.sort(key=lambda k: -(k["versions"][-1]["created"] if k["versions"] else k["created"]))
        page, nxt = _paginate(kernels, req)
        return message(ApiListKernelsResponse, kernels=[kernel_reply(k) for k in page], next_page_token=nxt)


def _get_kernel(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        kernel = parts.kernels.visible(user, _kernel_ref(req))
        labelled = _labelled_version(kernel, req.version_label)
        source = parts.kernels.source(kernel, labelled["number"] if labelled else None)
        blob = message(ApiKernelBlob, source=source, language=kernel.get("language"),
                       kernel_type=kernel.get("kernel_type"), slug=kernel["slug"])
        return message(ApiGetKernelResponse, metadata=kernel_reply(kernel), blob=blob)


def _labelled_version(kernel: dict, label: str | None) -> dict | None:
    """The version a `versionLabel` names: "v<N>", as the API expects (a bare number is 404; kaggle 2.2.5
    kaggle_api_extended.py `_kernel_version_label`); None without a label."""
    if not label:
        return None
    match = re.fullmatch(r"v(\d+)", label)
    found = [v for v in kernel["versions"] if match and v["number"] == int(match.group(1))]
    if not found:
        raise ApiError(404, f"Kernel '{kernel['ref']}' has no version labelled {label!r}")
    return found[0]


def _kernel_status(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        kernel = parts.kernels.visible(user, _kernel_ref(req))
        v = _labelled_version(kernel, req.version_label) or parts.faults.status_version(kernel)
        return message(ApiGetKernelSessionStatusResponse, status=KernelWorkerStatus[v["status"]],
                       failure_message=v.get("failure_message") or None)


def _list_output(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        kernel = parts.kernels.visible(user, _kernel_ref(req))
        version = _labelled_version(kernel, req.version_label) or parts.kernels.output_version(kernel)
        if version is None or version["status"] not in TERMINAL:
            return ApiListKernelSessionOutputResponse()
        page, nxt = _paginate(parts.kernels.output_files(kernel, version), req)
        base = f"http://localhost/_blobs/kernel-output/{kernel['ref']}/{version['number']}/"
        out = message(
            ApiListKernelSessionOutputResponse,
            files=[message(ApiKernelSessionOutputFile, url=base + urllib.parse.quote(rel), file_name=rel)
                   for rel, _ in page],
            next_page_token=nxt or None,
        )
        if not req.page_token:
            out.log = json.dumps(parts.kernels.log_events(kernel, version["number"]))
        return out


def _delete_kernel(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    parts.kernels.delete(user, _kernel_ref(req))
    return ApiDeleteKernelResponse()


# ----- datasets -----

def _dataset_ref(req: KaggleObject) -> str:
    return f"{req.owner_slug}/{req.dataset_slug}"


def _unversioned(parts: ApiParts, ds: dict) -> list[dict]:
    """The live versions a call that names no version sees (a stale_dataset_status fault hides the newest)."""
    return parts.faults.dataset_versions(ds, live_versions(ds))


def _dataset_status(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        live = _unversioned(parts, parts.datasets.visible(user, _dataset_ref(req)))
        ready = bool(live) and is_ready(live[-1])
        status = DatabundleVersionStatus.READY if ready else DatabundleVersionStatus.BLOBS_RECEIVED
        return message(ApiGetDatasetStatusResponse, status=status)


def _get_dataset(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        ds = parts.datasets.visible(user, _dataset_ref(req))
        return dataset_reply(ds, _unversioned(parts, ds), parts.datasets.settings.version_status_in_versions)


def _dataset_metadata(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        ds = parts.datasets.visible(user, _dataset_ref(req))
        return message(ApiGetDatasetMetadataResponse, info=dataset_info(ds))


def _update_dataset_metadata(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    """The owner's new settings (`Datasets.update_metadata`); what they could not be written for, in `errors`."""
    return message(ApiUpdateDatasetMetadataResponse, errors=parts.datasets.update_metadata(
        user, _dataset_ref(req), req.settings))


def _list_dataset_files(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        ds = parts.datasets.visible(user, _dataset_ref(req))
        version = parts.datasets.version(ds, req.dataset_version_number)
        page, nxt = _paginate(version["files"], req)
        files = [
            message(
                ApiDatasetFile,
                ref=f"{ds['ref']}/{f['name']}",
                dataset_ref=ds["ref"],
                owner_ref=ds["owner"],
                name=f["name"],
                creation_date=utc(version["created"]),
                description=f.get("description"),
                total_bytes=f["size"],
            )
            for f in page
        ]
        return message(ApiListDatasetFilesResponse, dataset_files=files, next_page_token=nxt or None)


def _list_datasets(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    with parts.store.lock:
        items = [d for d in parts.store.state["datasets"].values() if not d.get("deleted")]
        items = _matching(items, user, req.group == DatasetSelectionGroup.DATASET_SELECTION_GROUP_MY, req)
        items.sort(key=lambda d: -d.get("updated", d["created"]))
        page, nxt = _paginate(items, req)
        return message(ApiListDatasetsResponse, datasets=[dataset_reply(d) for d in page], next_page_token=nxt)


def _download_dataset(parts: ApiParts, user: str, req: KaggleObject) -> NoReturn:
    """The reply type is HttpRedirect: a redirect to the file (or the version's zip), never a JSON object."""
    with parts.store.lock:
        ds = parts.datasets.visible(user, _dataset_ref(req))
        number = req.dataset_version_number
        version = parts.datasets.version(ds, number, None if number else _unversioned(parts, ds))
        name = req.file_name
        base = f"http://localhost/_blobs/dataset/{ds['ref']}/{version['number']}/"
        if name:
            if name not in {f["name"] for f in version["files"]}:
                raise ApiError(404, f"Dataset '{ds['ref']}' version {version['number']} has no file {name!r}")
            location = base + urllib.parse.quote(name)
        else:
            location = base + urllib.parse.quote(f"{ds['slug']}.zip") + "?zip=1"
    raise ApiError(302, "redirect", headers={"Location": location})


def _create(parts: ApiParts, user: str, ref: str, files: list, create: Callable[[], KaggleObject]) -> KaggleObject:
    """CreateDataset(Version) of `ref` from `files`; with a lost_publish fault, or over the private-dataset quota
    (Settings.private_dataset_quota_bytes), it answers as accepted and nothing lands (kaggle-cli issue 284)."""
    if parts.faults.take_lost_publish(ref) or parts.datasets.over_quota(user, files):
        return created_reply(ref)
    return create()


def _create_dataset(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    ref = f"{req.owner_slug or user}/{req.slug}"

    def create() -> KaggleObject:
        error = parts.datasets.create(user, req)
        return created_reply(ref) if error is None else message(ApiCreateDatasetResponse, status="error", error=error)

    return _create(parts, user, ref, req.files, create)


def _start_upload(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    token = parts.uploads.start(user, req)
    return message(ApiStartBlobUploadResponse, token=token, create_url=f"http://localhost/_upload/{token}")


def _delete_dataset(parts: ApiParts, user: str, req: KaggleObject) -> KaggleObject:
    parts.datasets.delete(user, _dataset_ref(req))
    return ApiDeleteDatasetResponse()


# Each route's request and reply types are kagglesdk's (SDK_ROUTES); `call_api` enforces them.
KS, DS = "kernels.KernelsApiService", "datasets.DatasetApiService"
API_ROUTES: dict[str, Callable[[ApiParts, str, Any], KaggleObject]] = {
    f"{KS}/ListKernels": _list_kernels,
    f"{KS}/GetKernel": _get_kernel,
    f"{KS}/SaveKernel": lambda parts, user, req: message(ApiSaveKernelResponse, **parts.kernels.push(user, req)),
    f"{KS}/GetKernelSessionStatus": _kernel_status,
    f"{KS}/ListKernelSessionOutput": _list_output,
    f"{KS}/CancelKernelSession": lambda parts, user, req: message(
        ApiCancelKernelSessionResponse, error_message=parts.scheduler.cancel(user, req.kernel_session_id)),
    f"{KS}/DeleteKernel": _delete_kernel,
    f"{KS}/GetAcceleratorQuotaStatistics": lambda parts, user, req: quota_reply(parts.quota, user),
    "blobs.BlobApiService/StartBlobUpload": _start_upload,
    f"{DS}/CreateDataset": _create_dataset,
    f"{DS}/CreateDatasetVersion": lambda parts, user, req: _create(
        parts, user, _dataset_ref(req), req.body.files if req.body else [],
        lambda: created_reply(parts.datasets.create_version(user, _dataset_ref(req), req.body))),
    f"{DS}/CreateDatasetVersionById": lambda parts, user, req: created_reply(
        parts.datasets.create_version(user, None, req.body, dataset_id=req.id)),
    f"{DS}/GetDatasetStatus": _dataset_status,
    f"{DS}/GetDataset": _get_dataset,
    f"{DS}/GetDatasetMetadata": _dataset_metadata,
    f"{DS}/UpdateDatasetMetadata": _update_dataset_metadata,
    f"{DS}/ListDatasetFiles": _list_dataset_files,
    f"{DS}/ListDatasets": _list_datasets,
    f"{DS}/DownloadDataset": _download_dataset,
    f"{DS}/DeleteDataset": _delete_dataset,
    "security.OAuthService/IntrospectToken": lambda parts, user, req: message(
        IntrospectTokenResponse, **parts.accounts.introspect(req.token, user)),
}
