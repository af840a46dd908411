"""A limit on silence for every request huggingface_hub sends, whichever call sends it.

huggingface_hub 1.x and 2.x make their client with no timeout (`default_client_factory`, `timeout=None`: 1.11.0 and
2.4.0 `utils/_http.py`), and only some calls pass one: `HF_HUB_DOWNLOAD_TIMEOUT` covers range reads and downloads,
`HF_HUB_ETAG_TIMEOUT` metadata, but `HfApi.dataset_info` (`timeout=None` by default) and the first page of a tree
listing (`utils/_pagination.py`) send none. A connection that accepts and then sends nothing holds such a call until
the session's deadline. Here every request gets the limit on each phase it left unlimited (connect, each read of
bytes, each write, a free connection), so a silent connection raises a timeout, which the library's retries or ours
(`shared/retry.py`) take up. docs/tokenize.md, "A connection that sends nothing".

Standard library only at module level; huggingface_hub (and httpx or httpx2 under it) load inside functions.
"""

from __future__ import annotations

_installed: dict[str, float] = {}  # the limit set in this process, if any


def silence_limit_s() -> float:
    """The limit: huggingface_hub's HF_HUB_DOWNLOAD_TIMEOUT (shared/tokenize/source.py HUB_ENV_DEFAULTS sets 60 s
    where the user has not), read as the library read it."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _fill_timeouts(request, seconds: float) -> None:
    """An httpx/httpx2 request hook: each timeout the request left at None (no limit) becomes `seconds`."""
    limits = dict(request.extensions.get("timeout") or {})
    request.extensions = {**request.extensions,
                          "timeout": {phase: seconds if limits.get(phase) is None else limits[phase]
                                      for phase in ("connect", "read", "write", "pool")}}


def limit_hub_silence(seconds: float | None = None) -> float | None:
    """Make huggingface_hub's client cut any request that sends or receives nothing for `seconds` (default
    `silence_limit_s()`); the limit set, or None where this huggingface_hub has no client factory (0.x, on
    requests: no image the tokenize kernel runs on has it). Idempotent; a request's own shorter limit stays."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import _http
    except ImportError:
        return None
    if not hasattr(huggingface_hub, "set_client_factory") or not hasattr(_http, "default_client_factory"):
        return None
    seconds = float(seconds if seconds is not None else silence_limit_s())
    if _installed.get("seconds") == seconds:
        return seconds
    make_default = _http.default_client_factory

    def client_with_limits():
        client = make_default()  # the library's own: its request hooks (headers, token), redirects
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks.get("request", []),
                                                   lambda request: _fill_timeouts(request, seconds)]}
        return client

    huggingface_hub.set_client_factory(client_with_limits)  # also closes a client made before, so the next is ours
    _installed["seconds"] = seconds
    return seconds


def describe_hub_error(err: BaseException) -> str:
    """`describe_error(err)`, saying so where it is a connection cut for its silence under the limit set here."""
    from shared.errors import describe_error, error_chain

    text = describe_error(err)
    limit = _installed.get("seconds")
    if limit is not None and any(type(e).__name__ in _TIMEOUTS for e in error_chain(err)):
        return f"nothing received for {limit:g} s, the connection was cut: {text}"
    return text


# httpx's and httpx2's timeouts (one per phase), as huggingface_hub raises them unwrapped
_TIMEOUTS = {"ReadTimeout", "ConnectTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException"}
