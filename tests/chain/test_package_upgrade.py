"""A package an image has, but older than a kernel relies on (shared.kaggle.packages.upgrade): a newer pinned copy
is put first on the import path only where the image's packages meet what it declares, and otherwise the image's
copy stays with one line (issue 31: datasets retries the Hub's 429 and 504 from 4.4.1 on)."""

import importlib
import importlib.metadata
import sys
import time
from pathlib import Path

import pytest

from shared.kaggle import packages
from shared.kaggle.bootstrap import kernel_upgrades

FAKE = "gpt2k_fake_ds"


def write_distribution(folder: Path, version: str, requires: tuple[str, ...] = ()) -> Path:
    """What pip --target leaves for FAKE `version`: the module (saying its version) and its dist-info."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{FAKE}.py").write_text(f"VERSION = {version!r}\n")
    info = folder / f"{FAKE}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("\n".join(["Metadata-Version: 2.1", f"Name: {FAKE}", f"Version: {version}",
                                              *(f"Requires-Dist: {r}" for r in requires)]) + "\n")
    return folder


@pytest.fixture
def image_with_old_copy(session, tmp_path, monkeypatch):
    """A session whose image holds FAKE 1.0, where the kernel relies on 2.0 or later; newer candidates 3.0 and 2.5."""
    monkeypatch.setitem(packages.UPGRADES, "datasets", packages.Upgrade(
        FAKE, "2.0", (f"{FAKE}==3.0", f"{FAKE}==2.5"), "retrying", "our own retries cover it"))
    image = write_distribution(tmp_path / "image-site", "1.0")
    sys.path.append(str(image))
    importlib.invalidate_caches()
    yield session / "temp" / packages.TARGET_DIR
    sys.modules.pop(FAKE, None)


def installer_of(requires: dict[str, tuple[str, ...]], calls: list):
    """pip --target --no-deps as a session runs it, for the FAKE versions in `requires` (the rest: not found)."""
    def install(requirements, target: Path, no_deps: bool = False):
        calls.append((requirements, target.name, no_deps))
        version = requirements[0].split("==")[1]
        if version not in requires:
            return f"ERROR: No matching distribution found for {requirements[0]}"
        write_distribution(target, version, requires[version])
        return None
    return install


def test_an_older_copy_is_replaced_by_the_newest_candidate_the_images_packages_meet(image_with_old_copy):
    calls, lines = [], []
    install = installer_of({"3.0": ("numpy>=999",),  # needs what no image has
                            "2.5": ("numpy>=1.17", "packaging", 'gpt2k-absent-extra; extra == "audio"',
                                    'gpt2k-absent-old; python_version < "3"')}, calls)
    assert packages.upgrade("datasets", log=lines.append, installer=install) is None
    assert calls == [((f"{FAKE}==3.0",), f"{FAKE}-3.0", True), ((f"{FAKE}==2.5",), f"{FAKE}-2.5", True)]
    assert sys.path[0] == str(image_with_old_copy / f"{FAKE}-2.5")  # first: ahead of the image's copy
    assert not (image_with_old_copy / f"{FAKE}-3.0").exists()  # the rejected candidate is not left behind
    assert importlib.import_module(FAKE).VERSION == "2.5"
    (line,) = lines
    assert line.startswith(f"installed {FAKE}==2.5 for retrying in ")
    assert line.endswith(f"s over the image's {FAKE} 1.0, older than 2.0 (alone, ahead of the image's copy, on the "
                         "image's packages; gone with the session)")


def test_an_older_copy_stays_with_one_line_when_no_candidate_runs_on_the_image(image_with_old_copy):
    calls, lines = [], []
    install = installer_of({"3.0": ("numpy>=999",)}, calls)  # 2.5 not on the index
    path_before = list(sys.path)
    problem = packages.upgrade("datasets", log=lines.append, installer=install)
    numpy_version = importlib.metadata.version("numpy")
    assert problem == (f"kept the image's {FAKE} 1.0, older than 2.0, for want of a newer one ({FAKE}==3.0: it "
                       f"needs numpy>=999, and the image has numpy {numpy_version}; {FAKE}==2.5: ERROR: No matching "
                       f"distribution found for {FAKE}==2.5); our own retries cover it")
    assert lines == [] and sys.path == path_before
    assert importlib.import_module(FAKE).VERSION == "1.0"  # the session goes on with the image's copy


def test_a_missing_requirement_a_hung_index_or_any_failure_leaves_the_image_copy(image_with_old_copy, monkeypatch):
    calls = []
    install = installer_of({"3.0": ("gpt2k-nowhere>=1",)}, calls)
    problem = packages.upgrade("datasets", installer=install)
    assert f"{FAKE}==3.0: it needs gpt2k-nowhere>=1, and the image has no gpt2k-nowhere;" in problem
    calls.clear()

    def hung(requirements, target, no_deps=False):
        calls.append(requirements)
        time.sleep(0.01)
        return "ERROR: pip install ran past 4 min and was stopped"
    monkeypatch.setattr(packages, "PIP_TIMEOUT_S", 0.001)  # one install's limit spent: the session's start comes first
    problem = packages.upgrade("datasets", installer=hung)
    assert calls == [(f"{FAKE}==3.0",)]
    assert problem == (f"kept the image's {FAKE} 1.0, older than 2.0, for want of a newer one ({FAKE}==3.0: ERROR: pip "
                       f"install ran past 4 min and was stopped; {FAKE}==2.5: not tried, "
                       f"{packages.duration_text(0.001)} spent); our own retries cover it")

    def broken(requirements, target, no_deps=False):
        raise OSError(28, "No space left on device")
    assert packages.upgrade("datasets", installer=broken) == (
        f"kept the image's {FAKE}: replacing it failed (OSError: [Errno 28] No space left on device); "
        "our own retries cover it")


def test_a_copy_new_enough_or_a_laptop_installs_nothing(session, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing is installed")
    monkeypatch.setitem(packages.UPGRADES, "datasets", packages.Upgrade(
        FAKE, "2.0", (f"{FAKE}==3.0",), "retrying", "our own retries cover it"))
    sys.path.append(str(write_distribution(tmp_path / "image-site", "10.0")))  # newer by version, not by string
    importlib.invalidate_caches()
    assert packages.upgrade("datasets", installer=refuse) is None
    sys.path.pop()
    sys.path.append(str(write_distribution(tmp_path / "old-site", "1.9")))
    importlib.invalidate_caches()
    monkeypatch.delenv("LOCAL_KAGGLE_ROOT")  # not a session: the laptop's setup decides
    assert packages.upgrade("datasets", installer=refuse) is None


def test_the_tokenize_kernel_upgrades_datasets_only_where_it_streams_from_the_hub():
    assert kernel_upgrades("tokenize", {"dataset": "HuggingFaceFW/fineweb-edu"}) == ["datasets"]
    assert kernel_upgrades("tokenize", {"data_files": "/kaggle/input/corpus/*.parquet"}) == []
    assert kernel_upgrades("train", {}) == [] and kernel_upgrades("eval", {}) == []
