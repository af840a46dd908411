"""The exact-version fetch (shared/kaggle/bootstrap.py fetch_dataset_version) with a kagglehub older than its
`output_dir` (0.4.3): Kaggle/docker-python asks only kagglehub>=0.4.2, and the TPU image leaves it unpinned."""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

from shared.kaggle import bootstrap


def test_a_kagglehub_without_output_dir_downloads_into_its_cache_under_the_destination(monkeypatch, tmp_path):
    calls = []

    def dataset_download(handle: str, path: str | None = None, *, force_download: bool | None = False) -> str:
        """kagglehub 0.4.2's signature (datasets.py L34): the cache folder is KAGGLEHUB_CACHE, read on each call."""
        calls.append((handle, os.environ.get("KAGGLEHUB_CACHE"), os.environ.get(bootstrap.CACHE_OFF_ENV)))
        folder = Path(os.environ["KAGGLEHUB_CACHE"]) / "datasets" / "alice" / "ckpt" / "versions" / "2"
        folder.mkdir(parents=True)
        return str(folder)

    monkeypatch.setitem(sys.modules, "kagglehub", SimpleNamespace(dataset_download=dataset_download))
    monkeypatch.delenv("KAGGLEHUB_CACHE", raising=False)
    monkeypatch.delenv(bootstrap.CACHE_OFF_ENV, raising=False)
    dest = tmp_path / "fetch"
    got = bootstrap.fetch_dataset_version("alice/ckpt", 2, dest)
    assert calls == [("alice/ckpt/versions/2", str(dest), "1")]
    assert got == dest / "datasets" / "alice" / "ckpt" / "versions" / "2" and got.is_dir()
    assert "KAGGLEHUB_CACHE" not in os.environ and bootstrap.CACHE_OFF_ENV not in os.environ  # as they were


def test_a_kagglehub_with_output_dir_downloads_straight_into_the_destination(monkeypatch, tmp_path):
    calls = []
    kagglehub = SimpleNamespace(dataset_download=lambda handle, path=None, *, force_download=False, output_dir=None:
                                calls.append((handle, output_dir, os.environ.get("KAGGLEHUB_CACHE"))) or output_dir)
    monkeypatch.setitem(sys.modules, "kagglehub", kagglehub)
    monkeypatch.delenv("KAGGLEHUB_CACHE", raising=False)
    assert bootstrap.fetch_dataset_version("alice/ckpt", 3, tmp_path / "d") == tmp_path / "d"
    assert calls == [("alice/ckpt/versions/3", str(tmp_path / "d"), None)]
