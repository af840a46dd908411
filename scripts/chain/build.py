"""Building a self-contained kernel: a Kaggle session has only the kernel's code file and its inputs.

A built kernel is one file: a bootstrap that unpacks the `shared` package (embedded as a zip) onto the import path
and resolves the baked settings against the session's folders (`{input:owner/slug}`, `{working}`, `{temp}`),
then the kernel's own source (kernels/<name>.py) with `BAKED_SETTINGS` set to those settings (and the train
kernel's `BAKED_PUBLISH` to what it publishes after training: shared/kaggle/bootstrap.py).
The same code also comes as a notebook (a bootstrap cell and a kernel cell) for the Kaggle UI's Save & Run All.
`kernel-metadata.json` is filled from `kernel-metadata/<name>.json`.

Every kernel starts with KERNEL_PREAMBLE, the one place its import path is set up, for both ways it runs:
- from a checkout, `python kernels/<name>.py`: Python puts kernels/ first on sys.path, and kernels/tokenize.py
  there would shadow the standard library's `tokenize` (which dataclasses, inspect, linecache and datasets
  import). The preamble takes the kernel's own folder off the path and puts its parent, the repository root,
  first, so `shared` is the checkout's (ahead of any installed copy);
- built: the bootstrap has already imported the embedded `shared` before the kernel's source runs, so the
  preamble's path changes cannot swap it (a package's submodules load from its own folder).
The build refuses a kernel without the preamble, so the three stay the same.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

from scripts.chain.limits import MACHINE_SHAPES, session_devices
from shared.config import KERNEL_SETTINGS
from shared.errors import UserError
from shared.flags import check_known
from shared.train_sections import section_fields

REPO = Path(__file__).resolve().parents[2]
KERNEL_NAMES = ("tokenize", "train", "eval")
KERNEL_SOURCES = {name: f"kernels/{name}.py" for name in KERNEL_NAMES}
# The lines of a kernel that the build replaces with what the bootstrap resolved (shared.kaggle.bootstrap.BuiltKernel):
# every kernel has the settings line; the train kernel also has the publish line.
BAKED_LINES = {"settings": re.compile(r"^BAKED_SETTINGS: dict = \{\}", re.M),
               "publish": re.compile(r"^BAKED_PUBLISH = None", re.M)}
# The first lines of every kernel's source (the module docstring above them): see this module's docstring.
KERNEL_PREAMBLE = """\
import os
import sys

# The import path, the same in every kernel (why: scripts/chain/build.py).
_KERNELS_DIR = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _KERNELS_DIR]
sys.path.insert(0, os.path.dirname(_KERNELS_DIR))
"""


def check_settings(kernel: str, settings: dict, where: str, shape: str = "") -> None:
    """The kernel's own settings class (shared/config.py KERNEL_SETTINGS) built from `settings`: the checks the
    session runs at its start, run here first. A train config also splits its micro-batch over the devices of a
    session on machine `shape` ('': CPU) with its backend."""
    cls = KERNEL_SETTINGS[kernel]
    train = kernel == "train"  # a train kernel's settings are baked flat, by setting name (section_fields)
    check_known(settings, section_fields() if train else [f.name for f in dataclasses.fields(cls)], where, kernel)
    try:
        config = cls.from_dict(settings) if train else cls(**settings)
        if train:
            config.validate(session_devices(shape, config.step.backend))
    except UserError as err:
        raise UserError(f"{where}: {err}") from None


def shared_zip_b64(repo: Path = REPO) -> str:
    """The `shared` package as a deterministic zip (fixed timestamps, sorted names), base64-encoded."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for path in sorted((repo / "shared").rglob("*.py")):
            info = zipfile.ZipInfo(path.relative_to(repo).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, path.read_bytes())
    return base64.b64encode(buf.getvalue()).decode("ascii")


_BOOTSTRAP = '''\
__doc__ = {doc!r}
# Built by scripts/build_kernels.py from {source} ({build_id}). The `shared` package is embedded below, so this
# file runs on Kaggle with nothing but its inputs; edit the repository and build again, not this file.
import base64 as _gpt2k_b64
import io as _gpt2k_io
import json as _gpt2k_json
import os as _gpt2k_os
import sys as _gpt2k_sys
import tempfile as _gpt2k_tempfile
import zipfile as _gpt2k_zipfile

_GPT2K_BUILD = _gpt2k_json.loads({build_json!r})
_GPT2K_SHARED_ZIP = (
{zip_lines}
)


def _gpt2k_bootstrap():
    root = _gpt2k_tempfile.mkdtemp(prefix="gpt2k-shared-")
    with _gpt2k_zipfile.ZipFile(_gpt2k_io.BytesIO(_gpt2k_b64.b64decode(_GPT2K_SHARED_ZIP))) as z:
        z.extractall(root)
    _gpt2k_sys.path.insert(0, root)
    for name in [m for m in _gpt2k_sys.modules if m == "shared" or m.startswith("shared.")]:
        del _gpt2k_sys.modules[name]
    _gpt2k_sys.argv = _gpt2k_sys.argv[:1]  # a kernel runs with no arguments (a notebook's argv is Jupyter's)
    from shared.errors import UserError
    from shared.kaggle.bootstrap import resolve_build

    print(f"{{_GPT2K_BUILD['kernel']}} kernel, build {{_GPT2K_BUILD['build_id']}}: shared from {{root}}", flush=True)
    try:
        return resolve_build(_GPT2K_BUILD)
    except UserError as err:
        print(f"error: {{err}}", file=_gpt2k_sys.stderr, flush=True)
        raise SystemExit(2) from None


if "__file__" not in globals():  # a notebook
    __file__ = _gpt2k_os.path.join(_gpt2k_os.getcwd(), _GPT2K_BUILD["code_file"])
_GPT2K_BAKED = _gpt2k_bootstrap()
'''


def render_kernel(kernel: str, build: dict, repo: Path = REPO) -> tuple[str, str]:
    """(bootstrap, kernel source with the baked line replaced): the two halves of a built kernel."""
    source_path = repo / KERNEL_SOURCES[kernel]
    if not source_path.exists():
        raise UserError(f"{KERNEL_SOURCES[kernel]} does not exist; cannot build the {kernel} kernel")
    source = source_path.read_text()
    if "from __future__" in source:
        raise UserError(f"{KERNEL_SOURCES[kernel]}: a kernel may not use `from __future__` (the build prepends code)")
    if KERNEL_PREAMBLE not in source:
        raise UserError(f"{KERNEL_SOURCES[kernel]}: the kernel does not start with KERNEL_PREAMBLE "
                        "(scripts/chain/build.py), the import path every kernel sets up the same way")
    source, n = BAKED_LINES["settings"].subn("BAKED_SETTINGS: dict = _GPT2K_BAKED.settings  # baked by the build",
                                             source)
    if n != 1:
        raise UserError(f"{KERNEL_SOURCES[kernel]}: expected one `BAKED_SETTINGS: dict = {{}}` line")
    source, n = BAKED_LINES["publish"].subn("BAKED_PUBLISH = _GPT2K_BAKED.publish  # baked by the build", source)
    if n != (kernel == "train"):  # a train kernel that could not publish would lose its sessions' work
        raise UserError(f"{KERNEL_SOURCES[kernel]}: expected {'one' if kernel == 'train' else 'no'} "
                        "`BAKED_PUBLISH = None` line")
    doc = ast.get_docstring(ast.parse(source)) or ""
    b64 = shared_zip_b64(repo)
    zip_lines = "\n".join(f'    "{b64[i:i + 100]}"' for i in range(0, len(b64), 100))
    bootstrap = _BOOTSTRAP.format(doc=doc, source=KERNEL_SOURCES[kernel], build_id=build["build_id"],
                                  build_json=json.dumps(build, sort_keys=True), zip_lines=zip_lines)
    return bootstrap, source


def notebook_json(title: str, bootstrap: str, source: str) -> str:
    def cell(kind: str, text: str) -> dict:
        c = {"cell_type": kind, "metadata": {}, "source": text}
        if kind == "code":
            c.update(execution_count=None, outputs=[])
        return c

    nb = {"cells": [cell("markdown", f"# {title}\nBuilt by `scripts/build_kernels.py`; run with **Save & Run All**."
                                      " The first cell unpacks the project's `shared` package, the second is the "
                                      "kernel."),
                    cell("code", bootstrap), cell("code", source)],
          "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(nb, indent=1)


def _fill(value, subs: dict):
    if isinstance(value, str):
        for k, v in subs.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    return value


def fill_metadata(template_path: Path, *, user: str, slug: str, title: str, code_file: str, kernel_type: str,
                  accelerator: str | None = None, internet: bool | None = None, dataset_sources: list | None = None,
                  kernel_sources: list | None = None) -> dict:
    """kernel-metadata.json from a template: placeholders filled, sources added, the accelerator checked."""
    try:
        template = json.loads(template_path.read_text())
    except OSError as err:
        raise UserError(f"{template_path}: cannot read the metadata template ({err.strerror})") from None
    except ValueError as err:
        raise UserError(f"{template_path}: not valid JSON ({err})") from None
    meta = _fill(template, {"user": user, "slug": slug, "title": title, "code_file": code_file,
                            "kernel_type": kernel_type})
    meta["code_file"], meta["kernel_type"] = code_file, kernel_type
    if accelerator is not None:
        meta["machine_shape"] = accelerator
    shape = meta.get("machine_shape") or ""
    if shape and shape not in MACHINE_SHAPES:
        raise UserError(f"{template_path}: unknown machine_shape {shape!r}; valid: {', '.join(MACHINE_SHAPES)} "
                        "(or \"\" for CPU)")
    if not shape:
        meta.pop("machine_shape", None)
    # machine_shape picks the machine; enable_gpu/enable_tpu are deprecated for it (kagglesdk
    # kernels_api_service.py:1999-2014) but the kaggle client still sends both, so they agree with the shape.
    meta["enable_gpu"] = MACHINE_SHAPES.get(shape) == "gpu"
    meta["enable_tpu"] = MACHINE_SHAPES.get(shape) == "tpu"
    if internet is not None:
        meta["enable_internet"] = bool(internet)
    for key, extra in (("dataset_sources", dataset_sources), ("kernel_sources", kernel_sources)):
        meta[key] = list(dict.fromkeys(list(meta.get(key) or []) + list(extra or [])))
    # The kaggle client refuses a kernel slug under five characters (kaggle_api_extended.py:8987-8988).
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*/[a-z0-9][a-z0-9-]{4,}", meta.get("id", "")):
        raise UserError(f"{template_path}: kernel id {meta.get('id')!r} is not owner/slug (slug: lowercase letters, "
                        "digits and dashes, at least 5)")
    return meta


def build_kernel(kernel: str, out_dir: str | os.PathLike, *, user: str, slug: str, settings: dict | None = None,
                 title: str = "", kernel_type: str = "script", accelerator: str | None = None,
                 internet: bool | None = None, dataset_sources: list | None = None,
                 kernel_sources: list | None = None, checkpoint_dataset: dict | None = None,
                 push_id: str = "", template_dir: str | os.PathLike | None = None, repo: Path = REPO) -> Path:
    """Write `out_dir/<slug>.py|.ipynb` and `out_dir/kernel-metadata.json`; returns out_dir."""
    if kernel not in KERNEL_NAMES:
        raise UserError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNEL_NAMES)}")
    if kernel_type not in ("script", "notebook"):
        raise UserError(f"kernel_type must be script or notebook, not {kernel_type!r}")
    settings = dict(settings or {})
    template_dir = Path(template_dir) if template_dir else repo / "kernel-metadata"
    title = title or slug.replace("-", " ")
    code_file = f"{slug}.{'ipynb' if kernel_type == 'notebook' else 'py'}"
    meta = fill_metadata(template_dir / f"{kernel}.json", user=user, slug=slug, title=title, code_file=code_file,
                         kernel_type=kernel_type, accelerator=accelerator, internet=internet,
                         dataset_sources=dataset_sources, kernel_sources=kernel_sources)
    shape = meta.get("machine_shape") or ""
    check_settings(kernel, settings, f"{kernel} settings", shape)
    build = {"kernel": kernel, "code_file": code_file, "settings": settings, "push_id": push_id,
             "accelerator": meta.get("machine_shape") or ""}
    if checkpoint_dataset:
        build["checkpoint_dataset"] = checkpoint_dataset
    digest = hashlib.sha256(json.dumps(build, sort_keys=True).encode() + shared_zip_b64(repo).encode()
                            + (repo / KERNEL_SOURCES[kernel]).read_bytes()).hexdigest()[:12]
    build["build_id"] = digest
    bootstrap, source = render_kernel(kernel, build, repo)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if kernel_type == "notebook":
        (out / code_file).write_text(notebook_json(title, bootstrap, source))
    else:
        (out / code_file).write_text(bootstrap + "\n\n# " + "-" * 100 + f"\n# {KERNEL_SOURCES[kernel]}\n" + source)
    (out / "kernel-metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out

