"""The stream of documents a corpus is tokenized from: a Hugging Face dataset, or local parquet/jsonl files, both
read with `datasets` streaming (deterministic order), and resumable at any batch boundary.

Stdlib only at module level; datasets, pyarrow and huggingface_hub load inside functions.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from shared.data import natural_key
from shared.errors import UserError, describe_error, duration_text, http_status, is_transient
from shared.retry import Backoff
from shared.tokenize.hub_client import describe_hub_error, limit_hub_silence

if TYPE_CHECKING:  # annotations only: importing these for real would be circular (the config) or slow (datasets)
    import datasets

    from shared.config import TokenizeConfig


def _text_sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json"}


def _file_format(path: str) -> str | None:
    name = path.lower()
    for ext, fmt in sorted(_FORMATS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(ext):
            return fmt
    return None


def resolve_local_files(spec: str, text_column: str = "") -> tuple[list[str], str, dict]:
    """Expand `--data-files` (comma-separated globs) into readable files of one format, in natural order;
    with `text_column`, every parquet file must hold it as strings.

    Returns the files, their format, and the row count of each parquet file (from its footer).
    """
    files: list[str] = []
    rows: dict[str, int] = {}
    schemas: dict = {}
    for pattern in (p.strip() for p in spec.split(",")):
        if not pattern:
            continue
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True), key=natural_key)
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise UserError(f"--data-files: no file matches {pattern}")
        files += [m for m in matches if m not in files]
    if not files:
        raise UserError("--data-files: no pattern given")
    formats = set()
    for path in files:
        fmt = _file_format(path)
        if fmt is None:
            raise UserError(f"{path}: unsupported input file type (expected .parquet, .jsonl or .json)")
        formats.add(fmt)
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError as err:
            raise UserError(f"{path}: cannot read input file ({err.strerror})") from None
        if not head:
            raise UserError(f"{path}: empty input file")
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.read_metadata(path)
                rows[path], schemas[path] = meta.num_rows, meta.schema.to_arrow_schema()
            except Exception as err:  # noqa: BLE001 - any failure means the file is unusable
                raise UserError(f"{path}: unreadable parquet file ({describe_error(err)})") from None
    if len(formats) > 1:
        raise UserError(f"--data-files: mixes file types ({', '.join(sorted(formats))}); use one")
    if text_column:
        for path, schema in schemas.items():  # each file, not only the first one the stream reads its schema from
            if text_column not in schema.names:
                raise UserError(f"{path}: no text column {text_column!r} (columns: {', '.join(schema.names)}); "
                                "see --text-column")
            kind = schema.field(text_column).type
            if not _is_text_type(kind):
                raise UserError(f"{path}: column {text_column!r} holds {kind}, not text; see --text-column")
    return files, formats.pop(), rows


def _is_text_type(kind) -> bool:
    """Strings, or a column of nulls only (empty documents)."""
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind) or \
        str(kind) == "string_view"


# Set (where the user has not) before huggingface_hub is imported, which reads them then. Its 10 s default read
# timeout can take a slow but live link for a dead one; a stalled one is still noticed within a minute. The download
# timeout is also the limit on silence of every other Hub request (shared/tokenize/hub_client.py).
HUB_ENV_DEFAULTS = {"HF_HUB_DOWNLOAD_TIMEOUT": "60", "HF_HUB_ETAG_TIMEOUT": "60", "HF_HUB_DISABLE_TELEMETRY": "1"}


# datasets' own retries of a streaming read (datasets/config.py, 5.2.0 lines 256-261; the 429 and 504 waits from
# 4.4.1 on), set whichever version reads: its defaults allow 20 tries, up to 20 min of 60-s waits on 429s that
# nothing logs and no session deadline bounds. Five tries leave a brief fault to it (25 s on resets, 5 min on 429s);
# a longer one reaches our own layer, which logs each wait, honours Retry-After and stops at the deadline.
STREAMING_RETRIES = {"STREAMING_READ_MAX_RETRIES": 5, "STREAMING_READ_RETRY_INTERVAL": 5,
                     "STREAMING_READ_SERVER_UNAVAILABLE_RETRY_INTERVAL": 20,
                     "STREAMING_READ_RATE_LIMIT_RETRY_INTERVAL": 60,
                     "STREAMING_OPEN_MAX_RETRIES": 5, "STREAMING_OPEN_RETRY_INTERVAL": 5}


def hub_endpoint() -> str:
    """Where the Hub is read from (HF_ENDPOINT, as huggingface_hub reads it), with HUB_ENV_DEFAULTS set."""
    for name, value in HUB_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def library_versions() -> dict:
    """What reads the stream, for the manifest: which retries a run had depends on them (docs/tokenize.md)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("datasets", "huggingface_hub", "pyarrow", "fsspec"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def describe_source(cfg: TokenizeConfig) -> dict:
    """What the stream is made from, as recorded in the manifest (and compared between parts)."""
    if cfg.data_files:
        files, fmt, rows = resolve_local_files(cfg.data_files, cfg.text_column)
        return {
            "kind": "local",
            "format": fmt,
            "files": [{"name": os.path.basename(p), "bytes": os.path.getsize(p)} for p in files],
            "paths": [os.path.abspath(p) for p in files],
            "empty": [os.path.abspath(p) for p in files if rows.get(p) == 0],  # not read: datasets chokes on them
            "text_column": cfg.text_column,
        }
    return {
        "kind": "hub",
        "dataset": cfg.dataset,
        "config": cfg.config,
        "split": cfg.split,
        "revision": cfg.revision,
        "text_column": cfg.text_column,
    }


def resolve_hub_revision(dataset: str, revision: str, backoff: Backoff | None = None,
                         log: Callable[[str], None] | None = None) -> str:
    """The commit sha behind `revision`, so that every part reads the same snapshot. A Hub that cannot say (after
    retries of what may pass) is an error: an unpinned part could read another snapshot than the parts after it."""
    from huggingface_hub import HfApi

    limit_hub_silence()  # dataset_info sends no timeout of its own: a silent Hub would hold it for good
    backoff = backoff or Backoff(total_s=300.0)
    while True:
        try:
            sha = HfApi().dataset_info(dataset, revision=revision or None).sha
            break
        except Exception as err:  # noqa: BLE001 - the library's own types: retried where they may pass, else one line
            wait = backoff.next_wait(err) if is_transient(err) else None
            if wait is None:
                hint = "; attach a Hugging Face token as the secret HF_TOKEN" if http_status(err) in (401, 403) else ""
                raise UserError(f"{dataset}: cannot pin the revision {revision or 'main'} to a commit "
                                f"({describe_error(err)}){hint}") from None
            if log:
                log(f"retrying: {dataset}'s revision ({describe_hub_error(err)}) in {duration_text(wait)}")
            backoff.sleep(wait)
    if not sha:
        raise UserError(f"{dataset}: the Hub named no commit for revision {revision or 'main'}")
    return sha


def same_source(a: dict, b: dict) -> str | None:
    """None if `a` and `b` describe the same stream, else the first difference in words."""
    keys = ["kind", "format", "files", "text_column"] if a.get("kind") == "local" else [
        "kind", "dataset", "config", "split", "revision", "text_column"]
    for key in keys:
        if a.get(key) != b.get(key):
            return f"{key} {a.get(key)!r} vs {b.get(key)!r}"
    return None


def open_stream(source: dict) -> datasets.IterableDataset:
    """A `datasets` IterableDataset over the source, yielding pyarrow tables (deterministic order)."""
    import datasets

    datasets.disable_progress_bars()
    for name, value in STREAMING_RETRIES.items():
        setattr(datasets.config, name, value)
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # read errors become our own one-line error
    try:
        if source["kind"] == "local":
            paths = [p for p in source["paths"] if p not in source.get("empty", ())]
            if not paths:
                raise UserError(f"{source_label(source)}: no documents in the input")
            ds = datasets.load_dataset(source["format"], data_files=paths, split="train", streaming=True)
        else:
            limit_hub_silence()
            ds = _load_hub_dataset(datasets, source)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing dataset, config, split or network: one line
        raise _read_error(source, err, "cannot open the dataset") from err
    col = source["text_column"]
    names = ds.column_names
    if names is not None:
        if col not in names:
            raise UserError(_no_column_message(source, col, names))
        ds = ds.select_columns([col])
    return ds.with_format("arrow")


def _load_hub_dataset(datasets, source: dict):
    """The Hub dataset's stream, asking a parquet reader for the text column only (the rest is not parsed); a
    builder without that option (json, csv) is asked again without it."""
    args = dict(path=source["dataset"], name=source["config"] or None, split=source["split"], streaming=True,
                revision=source["revision"] or None)
    try:
        return datasets.load_dataset(**args, columns=[source["text_column"]])
    except ValueError as err:
        if "'columns'" not in str(err):
            raise
        return datasets.load_dataset(**args)


def source_label(source: dict) -> str:
    if source["kind"] == "local":
        n = len(source["files"])
        return source["paths"][0] + (f" (+{n - 1} more files)" if n > 1 else "")
    return f"{source['dataset']}" + (f" ({source['config']})" if source["config"] else "")


def _no_column_message(source: dict, col: str, names) -> str:
    if not list(names):  # e.g. a jsonl file of blank lines: no rows, so no columns either
        return f"{source_label(source)}: no documents in the input"
    return f"{source_label(source)}: no text column {col!r} (columns: {', '.join(map(str, names))}); see --text-column"


def _state_of(ds):
    try:
        return ds.state_dict()
    except Exception:  # noqa: BLE001 - an old `datasets`: resume by reading from the start instead
        return None


class StreamFault(UserError):
    """A read or open of the stream failed in a way another try may not meet (a dropped connection, a 429 or 5xx
    past the libraries' own retries): `stream_batches` reopens the stream and goes on."""


class _ResumeMismatch(Exception):
    pass


def _read_error(source: dict, err: BaseException, what: str) -> UserError:
    cls = StreamFault if is_transient(err) else UserError
    return cls(f"{source_label(source)}: {what} ({describe_hub_error(err)})")


def stream_batches(open_ds: Callable[[], datasets.IterableDataset], source: dict, checkpoint: dict, batch_docs: int,
                   first_doc: int, log: Callable[[str], None] | None = None,
                   backoff: Backoff | None = None) -> Iterator[tuple[int, list[str], dict]]:
    """Yield (doc index of texts[0], texts, checkpoint) for the documents from `first_doc` on.

    `checkpoint` ({"doc", "state", "batch_docs", "text_sha"}) is where reading starts: a `datasets`
    state_dict taken at document `doc` while reading batches of `batch_docs` (the state is only valid for
    that batch size, so it is read with it), or no state: read from the start, dropping the first `doc` documents.
    The text hash of document `doc` proves the resume landed where it should; a state that does not (another
    `datasets` version), or fails to load at all, is read again from the start. Each batch carries the checkpoint of
    the boundary it was read from.

    A `StreamFault` (the Hub or the link failing past the libraries' retries) reopens the stream at the boundary
    after the last batch yielded, after a wait from `backoff`, until its total is spent: the caller's pool and the
    shard it is filling never see it.
    """
    log = log or (lambda msg: None)
    backoff = backoff or Backoff()
    at = dict(checkpoint)  # where the next open starts; moves to each boundary read past
    while True:
        try:
            for doc, texts, ckpt, after in _resumable(open_ds, source, at, batch_docs, first_doc, log):
                backoff.progress()
                at = after
                first_doc = doc + len(texts)
                yield doc, texts, ckpt
            return
        except StreamFault as fault:
            wait = backoff.next_wait(fault.__cause__ or fault)
            if wait is None:
                raise UserError(f"{fault} (gave up after {backoff.retries} retries over "
                                f"{duration_text(backoff.waited_s)} of waiting)") from None
            log(f"retrying: {fault}; reopening the stream at document {at['doc']} in {duration_text(wait)} "
                f"(retry {backoff.retries}, {duration_text(backoff.waited_s)} of {duration_text(backoff.total_s)} "
                "waited)")
            backoff.sleep(wait)


def _resumable(open_ds, source: dict, checkpoint: dict, batch_docs: int, first_doc: int, log):
    """_batches from `checkpoint`'s state, or from the start where it has none or it does not resume."""
    if checkpoint.get("state"):
        try:
            yield from _batches(open_ds(), source, checkpoint, checkpoint.get("batch_docs") or batch_docs, first_doc)
            return
        except _ResumeMismatch:
            log(f"warning: the saved stream state does not resume at document {checkpoint['doc']}; "
                "reading from the start instead (slower)")
    try:
        yield from _batches(open_ds(), source, {**checkpoint, "state": None}, batch_docs, first_doc)
    except _ResumeMismatch:
        raise UserError(
            f"{source_label(source)}: document {checkpoint['doc']} is not the one the manifest recorded; "
            "the source changed since the previous run"
        ) from None


def _batches(ds, source: dict, checkpoint: dict, batch_docs: int, first_doc: int):
    """Yield (doc, texts, checkpoint it was read from, checkpoint after it). With no state in `checkpoint`, reading
    starts at document 0 (the documents before `checkpoint['doc']` are read and dropped), so that every boundary
    still has a state for the next part (a skipped stream's states would not load into a plain one)."""
    col = source["text_column"]
    state = checkpoint.get("state")
    check_doc, expect_sha = int(checkpoint["doc"]), checkpoint.get("text_sha")
    doc = check_doc if state else 0
    first_doc = max(first_doc, check_doc)
    if state:
        try:
            ds.load_state_dict(state)
        except Exception:  # noqa: BLE001 - any state that will not load is one that does not resume
            raise _ResumeMismatch() from None
    it = iter(ds.iter(batch_size=batch_docs))
    while True:
        try:
            table = next(it)
        except StopIteration:
            if expect_sha is not None and check_doc:
                raise _ResumeMismatch() from None  # the stream ends before the document the manifest recorded
            return
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - the network, or corrupt input found while reading
            if state and doc == check_doc and not is_transient(err):
                raise _ResumeMismatch() from None  # the state's first read: the state may be what is wrong
            raise _read_error(source, err, "cannot read input") from err
        if col not in table.column_names:
            raise UserError(_no_column_message(source, col, table.column_names))
        column = table.column(col)
        kind = column.type
        if not _is_text_type(kind):
            raise UserError(f"{source_label(source)}: column {col!r} holds {kind}, not text; see --text-column")
        texts = column.to_pylist()
        if column.null_count:
            texts = ["" if t is None else t for t in texts]
        if not texts:
            continue
        end = doc + len(texts)
        if expect_sha is not None and doc <= check_doc < end:
            if _text_sha(texts[check_doc - doc]) != expect_sha:
                raise _ResumeMismatch()
            expect_sha = None
        ckpt = {"doc": doc, "state": state, "batch_docs": batch_docs, "text_sha": _text_sha(texts[0])}
        state = _state_of(ds)
        after = {"doc": end, "state": state, "batch_docs": batch_docs, "text_sha": None}
        if end > first_doc:
            skip = max(0, first_doc - doc)
            yield doc + skip, texts[skip:], ckpt, after
        doc = end
