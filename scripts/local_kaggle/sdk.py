"""kagglesdk's own types on the wire: each route's request and reply types, replies built through typed setters,
and their JSON as the client reads it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from kagglesdk.blobs.services.blob_api_service import BlobApiClient
from kagglesdk.datasets.services.dataset_api_service import DatasetApiClient
from kagglesdk.kaggle_object import KaggleObject
from kagglesdk.kernels.services.kernels_api_service import KernelsApiClient
from kagglesdk.security.services.oauth_service import OAuthClient


def utc(ts: float | None) -> dt.datetime | None:
    """A naive UTC datetime, as kagglesdk's DateTimeSerializer writes and reads them ("...Z")."""
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None)


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
