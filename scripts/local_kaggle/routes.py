"""The API: each `/api/v1/<service>/<Method>` the local Kaggle serves, the request read as the route's kagglesdk
request type and the reply an instance of its kagglesdk reply type (SDK_ROUTES)."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kagglesdk.datasets.types.dataset_api_service import (
    ApiDatasetFile,
    ApiDeleteDatasetResponse,
    ApiGetDatasetMetadataResponse,
    ApiGetDatasetStatusResponse,
    ApiListDatasetFilesResponse,
    ApiListDatasetsResponse,
)
from kagglesdk.datasets.types.dataset_enums import DatabundleVersionStatus, DatasetSelectionGroup
from kagglesdk.kaggle_object import KaggleObject
from kagglesdk.kernels.types.kernels_api_service import (
    ApiDeleteKernelResponse,
    ApiGetKernelResponse,
    ApiGetKernelSessionStatusResponse,
    ApiKernelBlob,
    ApiKernelSessionOutputFile,
    ApiListKernelSessionOutputResponse,
    ApiListKernelsResponse,
)
from kagglesdk.kernels.types.kernels_enums import KernelsListViewType, KernelWorkerStatus
from kagglesdk.security.types.oauth_service import IntrospectTokenResponse

from .datasets import created_reply, dataset_info, dataset_reply, is_ready, live_versions
from .errors import ApiError
from .kernels import kernel_reply
from .rules import TERMINAL
from .sdk import SDK_ROUTES, message, to_wire, utc

if TYPE_CHECKING:
    from .app import LocalKaggle


def call_api(app: LocalKaggle, user: str, service: str, method: str, body: Any) -> dict:
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
    reply = fn(app, user, req)
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


def _list_kernels(app: LocalKaggle, user: str, req):
    with app.store.lock:
        kernels = _matching(list(app.store.state["kernels"].values()), user,
                            req.group == KernelsListViewType.PROFILE, req)
        if req.dataset:
            kernels = [k for k in kernels if k["versions"] and req.dataset in k["versions"][-1]["dataset_sources"]]
        kernels.sort(key=lambda k: -(k["versions"][-1]["created"] if k["versions"] else k["created"]))
        page, nxt = _paginate(kernels, req)
        return message(ApiListKernelsResponse, kernels=[kernel_reply(k) for k in page], next_page_token=nxt)


def _get_kernel(app: LocalKaggle, user: str, req):
    with app.store.lock:
        kernel = app.kernels.visible(user, _kernel_ref(req))
        blob = message(ApiKernelBlob, source=app.kernels.source(kernel), language=kernel.get("language"),
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


def _kernel_status(app: LocalKaggle, user: str, req):
    with app.store.lock:
        kernel = app.kernels.visible(user, _kernel_ref(req))
        v = _labelled_version(kernel, req.version_label) or app.faults.status_version(kernel)
        return message(ApiGetKernelSessionStatusResponse, status=KernelWorkerStatus[v["status"]],
                       failure_message=v.get("failure_message") or None)


def _list_output(app: LocalKaggle, user: str, req):
    with app.store.lock:
        kernel = app.kernels.visible(user, _kernel_ref(req))
        version = _labelled_version(kernel, req.version_label) or app.kernels.output_version(kernel)
        if version is None or version["status"] not in TERMINAL:
            return ApiListKernelSessionOutputResponse()
        page, nxt = _paginate(app.kernels.output_files(kernel, version), req)
        base = f"http://localhost/_blobs/kernel-output/{kernel['ref']}/{version['number']}/"
        out = message(
            ApiListKernelSessionOutputResponse,
            files=[message(ApiKernelSessionOutputFile, url=base + urllib.parse.quote(rel), file_name=rel)
                   for rel, _ in page],
            next_page_token=nxt or None,
        )
        if not req.page_token:
            out.log = json.dumps(app.kernels.log_events(kernel, version["number"]))
        return out


def _delete_kernel(app: LocalKaggle, user: str, req):
    app.kernels.delete(user, _kernel_ref(req))
    return ApiDeleteKernelResponse()


# ----- datasets -----

def _dataset_ref(req: KaggleObject) -> str:
    return f"{req.owner_slug}/{req.dataset_slug}"


def _unversioned(app: LocalKaggle, ds: dict) -> list[dict]:
    """The live versions a call that names no version sees (a stale_dataset_status fault hides the newest)."""
    return app.faults.dataset_versions(ds, live_versions(ds))


def _dataset_status(app: LocalKaggle, user: str, req):
    with app.store.lock:
        live = _unversioned(app, app.datasets.visible(user, _dataset_ref(req)))
        ready = bool(live) and is_ready(live[-1])
        status = DatabundleVersionStatus.READY if ready else DatabundleVersionStatus.BLOBS_RECEIVED
        return message(ApiGetDatasetStatusResponse, status=status)


def _get_dataset(app: LocalKaggle, user: str, req):
    with app.store.lock:
        ds = app.datasets.visible(user, _dataset_ref(req))
        return dataset_reply(ds, _unversioned(app, ds))


def _dataset_metadata(app: LocalKaggle, user: str, req):
    with app.store.lock:
        return message(ApiGetDatasetMetadataResponse, info=dataset_info(app.datasets.visible(user, _dataset_ref(req))))


def _list_dataset_files(app: LocalKaggle, user: str, req):
    with app.store.lock:
        ds = app.datasets.visible(user, _dataset_ref(req))
        version = app.datasets.version(ds, req.dataset_version_number)
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


def _list_datasets(app: LocalKaggle, user: str, req):
    with app.store.lock:
        items = [d for d in app.store.state["datasets"].values() if not d.get("deleted")]
        items = _matching(items, user, req.group == DatasetSelectionGroup.DATASET_SELECTION_GROUP_MY, req)
        items.sort(key=lambda d: -d.get("updated", d["created"]))
        page, nxt = _paginate(items, req)
        return message(ApiListDatasetsResponse, datasets=[dataset_reply(d) for d in page], next_page_token=nxt)


def _download_dataset(app: LocalKaggle, user: str, req):
    """The reply type is HttpRedirect: a redirect to the file (or the version's zip), never a JSON object."""
    with app.store.lock:
        ds = app.datasets.visible(user, _dataset_ref(req))
        number = req.dataset_version_number
        version = app.datasets.version(ds, number, None if number else _unversioned(app, ds))
        name = req.file_name
        base = f"http://localhost/_blobs/dataset/{ds['ref']}/{version['number']}/"
        if name:
            if name not in {f["name"] for f in version["files"]}:
                raise ApiError(404, f"Dataset '{ds['ref']}' version {version['number']} has no file {name!r}")
            location = base + urllib.parse.quote(name)
        else:
            location = base + urllib.parse.quote(f"{ds['slug']}.zip") + "?zip=1"
    raise ApiError(302, "redirect", headers={"Location": location})


def _create(app: LocalKaggle, ref: str, create: Callable[[], KaggleObject]) -> KaggleObject:
    """CreateDataset(Version) of `ref`; with a lost_publish fault it answers as accepted and nothing lands."""
    return created_reply(ref) if app.faults.take_lost_publish(ref) else create()


def _delete_dataset(app: LocalKaggle, user: str, req):
    app.datasets.delete(user, _dataset_ref(req))
    return ApiDeleteDatasetResponse()


# Each route's request and reply types are kagglesdk's (SDK_ROUTES); `call_api` enforces them.
KS, DS = "kernels.KernelsApiService", "datasets.DatasetApiService"
API_ROUTES: dict[str, Callable[[LocalKaggle, str, Any], KaggleObject]] = {
    f"{KS}/ListKernels": _list_kernels,
    f"{KS}/GetKernel": _get_kernel,
    f"{KS}/SaveKernel": lambda app, user, req: app.kernels.push(user, req),
    f"{KS}/GetKernelSessionStatus": _kernel_status,
    f"{KS}/ListKernelSessionOutput": _list_output,
    f"{KS}/CancelKernelSession": lambda app, user, req: app.scheduler.cancel(user, req.kernel_session_id),
    f"{KS}/DeleteKernel": _delete_kernel,
    f"{KS}/GetAcceleratorQuotaStatistics": lambda app, user, req: app.quota.reply(user),
    "blobs.BlobApiService/StartBlobUpload": lambda app, user, req: app.uploads.start(user, req),
    f"{DS}/CreateDataset": lambda app, user, req: _create(app, f"{req.owner_slug or user}/{req.slug}",
                                                          lambda: app.datasets.create(user, req)),
    f"{DS}/CreateDatasetVersion": lambda app, user, req: _create(
        app, _dataset_ref(req), lambda: app.datasets.create_version(user, _dataset_ref(req), req.body)),
    f"{DS}/CreateDatasetVersionById": lambda app, user, req: app.datasets.create_version(user, None, req.body,
                                                                                         dataset_id=req.id),
    f"{DS}/GetDatasetStatus": _dataset_status,
    f"{DS}/GetDataset": _get_dataset,
    f"{DS}/GetDatasetMetadata": _dataset_metadata,
    f"{DS}/ListDatasetFiles": _list_dataset_files,
    f"{DS}/ListDatasets": _list_datasets,
    f"{DS}/DownloadDataset": _download_dataset,
    f"{DS}/DeleteDataset": _delete_dataset,
    "security.OAuthService/IntrospectToken": lambda app, user, req: message(IntrospectTokenResponse, active=True,
                                                                            username=user),
}
