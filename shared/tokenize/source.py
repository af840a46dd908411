"""The stream of documents a corpus is tokenized from: a Hugging Face dataset, or local parquet/jsonl files, both
read with `datasets` streaming (deterministic order), and resumable at any batch boundary.

Stdlib only at module level; datasets, pyarrow and huggingface_hub load inside functions.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from shared.data import natural_key
from shared.errors import UserError, describe_error

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


def resolve_hub_revision(dataset: str, revision: str) -> str:
    """The commit sha behind `revision` (so every part reads the same snapshot); the name itself if offline."""
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(dataset, revision=revision or None).sha
        return sha or revision
    except Exception as err:  # noqa: BLE001 - pinning is best effort; the stream itself will report errors
        print(f"warning: could not resolve the revision of {dataset} ({describe_error(err)})", file=sys.stderr)
        return revision


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
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # read errors become our own one-line error
    try:
        if source["kind"] == "local":
            paths = [p for p in source["paths"] if p not in source.get("empty", ())]
            if not paths:
                raise UserError(f"{source_label(source)}: no documents in the input")
            ds = datasets.load_dataset(source["format"], data_files=paths, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(
                source["dataset"], source["config"] or None, split=source["split"], streaming=True,
                revision=source["revision"] or None,
            )
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a missing dataset, config, split or network: one line
        label = source.get("dataset") or source["paths"][0]
        raise UserError(f"{label}: cannot open the dataset ({describe_error(err)})") from None
    col = source["text_column"]
    names = ds.column_names
    if names is not None:
        if col not in names:
            raise UserError(_no_column_message(source, col, names))
        ds = ds.select_columns([col])
    return ds.with_format("arrow")


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
    except Exception:  # noqa: BLE001 - an old `datasets`: resume by skipping documents instead
        return None


class _ResumeMismatch(Exception):
    pass


def stream_batches(open_ds: Callable[[], datasets.IterableDataset], source: dict, checkpoint: dict, batch_docs: int,
                   first_doc: int, log: Callable[[str], None] | None = None) -> Iterator[tuple[int, list[str], dict]]:
    """Yield (doc index of texts[0], texts, checkpoint) for the documents from `first_doc` on.

    `checkpoint` ({"doc", "state", "batch_docs", "text_sha"}) is where reading starts: a `datasets`
    state_dict taken at document `doc` while reading batches of `batch_docs` (the state is only valid for
    that batch size, so it is read with it), or no state: skip `doc` documents. The text hash of document
    `doc` proves the resume landed where it should; if a state does not (another `datasets` version), the
    stream is read again with skip. Each batch carries the checkpoint of the boundary it was read from.
    """
    state = checkpoint.get("state")
    if state:
        try:
            yield from _batches(open_ds(), source, checkpoint, checkpoint.get("batch_docs") or batch_docs,
                                first_doc, use_state=True)
            return
        except _ResumeMismatch:
            if log:
                log(f"warning: the saved stream state does not resume at document {checkpoint['doc']}; "
                    "skipping documents from the start instead (slower)")
    try:
        yield from _batches(open_ds(), source, {**checkpoint, "state": None}, batch_docs, first_doc,
                            use_state=not checkpoint["doc"])
    except _ResumeMismatch:
        raise UserError(
            f"{source_label(source)}: document {checkpoint['doc']} is not the one the manifest recorded; "
            "the source changed since the previous run"
        ) from None


def _batches(ds, source: dict, checkpoint: dict, batch_docs: int, first_doc: int, use_state: bool):
    col = source["text_column"]
    doc = int(checkpoint["doc"])
    state = checkpoint.get("state")
    expect_sha = checkpoint.get("text_sha")
    if state:
        ds.load_state_dict(state)
    elif doc:
        ds = ds.skip(doc)  # states of a skipped stream do not load into a plain one: use_state is False
    it = iter(ds.iter(batch_size=batch_docs))
    while True:
        try:
            table = next(it)
        except StopIteration:
            return
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - corrupt input found while reading
            raise UserError(f"{source_label(source)}: cannot read input ({describe_error(err)})") from None
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
        if expect_sha is not None:
            if _text_sha(texts[0]) != expect_sha:
                raise _ResumeMismatch()
            expect_sha = None
        ckpt = {"doc": doc, "state": state if use_state else None, "batch_docs": batch_docs,
                "text_sha": _text_sha(texts[0])}
        end = doc + len(texts)
        if end > first_doc:
            skip = max(0, first_doc - doc)
            yield doc + skip, texts[skip:], ckpt
        doc = end
        state = _state_of(ds) if use_state else None
