"""Self-contained Kaggle kernels, and a chain of 9-hour sessions that trains GPT-2 through them.

Build (`scripts/build_kernels.py`): a kernel on Kaggle has only its code file and its inputs, so a built kernel
is one file: a bootstrap that unpacks the `shared` package (embedded as a zip) onto the import path and resolves
the baked settings against the session's folders (`{input:owner/slug}`, `{working}`, `{temp}`), then the
kernel's own source (kernels/<name>.py) with `BAKED_SETTINGS` (or `DEFAULTS`) set to those settings. The same
code also comes as a notebook (a bootstrap cell and a kernel cell) for the Kaggle UI's Save & Run All.
`kernel-metadata.json` is filled from `kernel-metadata/<name>.json`.

Chain (`scripts/chain_sessions.py`): from one config, push the missing tokenize parts (one kernel per part,
each reading the previous part's output), then train sessions one after another (one kernel, one version per
session) that resume from and publish to a checkpoint dataset, then the eval kernel. Every push is recorded
in a JSON state file before and after it happens (with a push id written into the pushed code), so a chain
killed at any point and started again continues without pushing a session twice.

Module-level imports are the standard library only (the chain never needs torch).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import time
import uuid
import zipfile
from pathlib import Path

from shared.errors import UserError

REPO = Path(__file__).resolve().parents[1]
KERNEL_NAMES = ("tokenize", "train", "eval")
KERNEL_SOURCES = {name: f"kernels/{name}.py" for name in KERNEL_NAMES}
# The line of each kernel that the build replaces with the baked settings.
BAKED_LINE = re.compile(r"^(BAKED_SETTINGS|DEFAULTS): dict = \{\}", re.M)
SETTINGS_CLASSES = {"tokenize": ("shared/tokenize_corpus.py", "TokenizeConfig"),
                    "train": ("shared/config.py", "TrainConfig"),
                    "eval": ("shared/eval.py", "EvalConfig")}
# Machine shapes Kaggle has accepted (kaggle-cli docs/kernels.md, Feb 2026 list) and the weekly quota each counts
# against; "" is CPU. The Sep 2026 list (docs/kernels.md @13dad8ee) drops RETIRED_SHAPES: TPU v5e-8 and v6e-8 are
# the TPUs offered now (docs/kaggle-api.md).
MACHINE_SHAPES = {
    "TpuV38": "tpu", "Tpu1VmV38": "tpu", "TpuV5E8": "tpu", "TpuV6E8": "tpu",
    "NvidiaTeslaT4": "gpu", "NvidiaTeslaT4Highmem": "gpu", "NvidiaTeslaP100": "gpu", "NvidiaTeslaA100": "gpu",
    "NvidiaL4": "gpu", "NvidiaL4X1": "gpu", "NvidiaH100": "gpu", "NvidiaRtxPro6000": "gpu",
}
RETIRED_SHAPES = ("TpuV38", "Tpu1VmV38", "NvidiaTeslaP100")
NINE_HOURS_S = 9 * 3600
# The longest session Kaggle runs on each kind of machine: 9 h on a TPU, 12 h on a GPU or CPU (Kaggle's notebook
# docs, kaggle.com/docs/notebooks; not verified from a primary source here, docs/kaggle-api.md). kagglesdk says
# only that sessionTimeoutSeconds "must be lower than the global maximum" (kernels_api_service.py:2015-2017).
SESSION_MAX_S = {"tpu": NINE_HOURS_S, "gpu": 12 * 3600, "cpu": 12 * 3600}
# /kaggle/working, the session's output, holds 20 GB (Kaggle's notebook docs; not verified here). Checkpoints
# that do not fit go to /kaggle/temp, which is not kept: the session publishes from there.
OUTPUT_LIMIT_BYTES = 20 * 10**9
# Upload rate assumed for sizing the publish margin of large checkpoints (not measured on Kaggle).
ASSUMED_UPLOAD_BYTES_PER_S = 10 * 10**6


def one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:400] if lines else ""


# =============================================================================================================
# Building kernels
# =============================================================================================================

def settings_fields(kernel: str, repo: Path = REPO) -> list[str] | None:
    """The field names of a kernel's settings dataclass, read from its source (no import: no torch)."""
    rel, cls_name = SETTINGS_CLASSES[kernel]
    path = repo / rel
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return None


def check_settings(kernel: str, settings: dict, where: str, repo: Path = REPO) -> None:
    fields = settings_fields(kernel, repo)
    if fields is None:
        return
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown {kernel} setting(s) {', '.join(unknown)}; known: {', '.join(fields)}")


def shared_zip_b64(repo: Path = REPO) -> str:
    """The `shared` package as a deterministic zip (fixed timestamps, sorted names), base64-encoded."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for path in sorted((repo / "shared").glob("*.py")):
            info = zipfile.ZipInfo(f"shared/{path.name}", date_time=(1980, 1, 1, 0, 0, 0))
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


def _gpt2k_bootstrap() -> dict:
    root = _gpt2k_tempfile.mkdtemp(prefix="gpt2k-shared-")
    with _gpt2k_zipfile.ZipFile(_gpt2k_io.BytesIO(_gpt2k_b64.b64decode(_GPT2K_SHARED_ZIP))) as z:
        z.extractall(root)
    _gpt2k_sys.path.insert(0, root)
    for name in [m for m in _gpt2k_sys.modules if m == "shared" or m.startswith("shared.")]:
        del _gpt2k_sys.modules[name]
    _gpt2k_sys.argv = _gpt2k_sys.argv[:1]  # a kernel runs with no arguments (a notebook's argv is Jupyter's)
    from shared.errors import UserError
    from shared.publish import resolve_build_settings

    print(f"{{_GPT2K_BUILD['kernel']}} kernel, build {{_GPT2K_BUILD['build_id']}}: shared from {{root}}", flush=True)
    try:
        return resolve_build_settings(_GPT2K_BUILD)
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
    source, n = BAKED_LINE.subn(lambda m: f"{m.group(1)}: dict = _GPT2K_BAKED  # baked by the build", source)
    if n != 1:
        raise UserError(f"{KERNEL_SOURCES[kernel]}: expected one `BAKED_SETTINGS: dict = {{}}` (or DEFAULTS) line")
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
    check_settings(kernel, settings, f"{kernel} settings", repo)
    template_dir = Path(template_dir) if template_dir else repo / "kernel-metadata"
    title = title or slug.replace("-", " ")
    code_file = f"{slug}.{'ipynb' if kernel_type == 'notebook' else 'py'}"
    meta = fill_metadata(template_dir / f"{kernel}.json", user=user, slug=slug, title=title, code_file=code_file,
                         kernel_type=kernel_type, accelerator=accelerator, internet=internet,
                         dataset_sources=dataset_sources, kernel_sources=kernel_sources)
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


# =============================================================================================================
# The chain's config
# =============================================================================================================

@dataclasses.dataclass
class ChainConfig:
    name: str = "gpt2"  # prefix of every slug
    user: str = ""  # Kaggle user owning the kernels and datasets ('': the API credentials' user)
    total_steps: int = 19073  # optimizer steps of the whole run
    # machine_shape of train (and eval) sessions ("" for CPU): TPU v5e-8, the TPU of Kaggle's Sep 2026 list
    # (kaggle-cli docs/kernels.md @13dad8ee); TpuV6E8 where offered.
    accelerator: str = "TpuV5E8"
    kernel_type: str = "script"  # script or notebook
    session_limit_s: float = NINE_HOURS_S  # a session's time limit (Kaggle: 9 h)
    startup_margin_s: float = 600  # start-up before training begins (imports, data, compile)
    publish_margin_s: float = 0  # the final checkpoint's upload (0: sized from the checkpoint, at least 1200 s)
    max_train_sessions: int = 0  # stop training after this many sessions, then evaluate (0: until total_steps)
    max_failed_sessions: int = 3  # consecutive sessions without progress before the chain gives up
    train: dict = dataclasses.field(default_factory=dict)  # TrainConfig settings (model, batch, lr, ...)
    tokenize: dict = dataclasses.field(default_factory=dict)  # parts, settings, inputs, accelerator
    token_datasets: list = dataclasses.field(default_factory=list)  # existing datasets of shards (instead/as well)
    token_kernels: list = dataclasses.field(default_factory=list)  # existing kernels whose output holds shards
    eval: dict = dataclasses.field(default_factory=dict)  # enabled, settings, inputs, accelerator
    slugs: dict = dataclasses.field(default_factory=dict)  # tokenize, train, eval, checkpoints
    poll_initial_s: float = 10.0
    poll_max_s: float = 120.0
    # A finished status read before the pushed version was ever seen queued or running may still be the
    # previous version's (the status call names no version): it counts only this long after the push.
    stale_status_s: float = 600.0
    retry_attempts: int = 6
    retry_base_s: float = 5.0

    def slug(self, what: str) -> str:
        default = {"tokenize": f"{self.name}-tokens", "train": f"{self.name}-train", "eval": f"{self.name}-eval",
                   "checkpoints": f"{self.name}-checkpoints"}[what]
        return self.slugs.get(what) or default

    @property
    def time_budget(self) -> float:
        return self.session_limit_s - self.startup_margin_s - self.publish_margin_s

    @property
    def accelerator_kind(self) -> str:
        return MACHINE_SHAPES.get(self.accelerator, "cpu")

    @property
    def checkpoint_bytes(self) -> int:
        from shared.config import TrainConfig

        return TrainConfig(**self.train).model.checkpoint_bytes()  # the keys were checked by check_settings


_TOKENIZE_KEYS = {"parts", "settings", "inputs", "accelerator"}
_EVAL_KEYS = {"enabled", "settings", "inputs", "accelerator"}


def load_config(path: str | os.PathLike, overrides: dict | None = None) -> ChainConfig:
    """A chain config from JSON or TOML, checked field by field (one-line errors)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"--config {path}: cannot read it ({err.strerror})") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except ValueError as err:
        raise UserError(f"--config {path}: not valid {path.suffix.lstrip('.') or 'JSON'} ({one_line(err)})") from None
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # "_comment" keys
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return config_from_dict(raw, str(path))


def config_from_dict(raw: dict, where: str = "config") -> ChainConfig:
    fields = {f.name: f for f in dataclasses.fields(ChainConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    cfg = ChainConfig(**raw)
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{2,}", cfg.name):
        raise UserError(f"{where}: name {cfg.name!r} must be lowercase letters, digits and dashes (3+), a slug prefix")
    if cfg.total_steps <= 0:
        raise UserError(f"{where}: total_steps must be positive, got {cfg.total_steps}")
    if cfg.accelerator and cfg.accelerator not in MACHINE_SHAPES:
        raise UserError(f"{where}: unknown accelerator {cfg.accelerator!r}; valid: {', '.join(MACHINE_SHAPES)} "
                        "(or \"\" for CPU)")
    if cfg.kernel_type not in ("script", "notebook"):
        raise UserError(f"{where}: kernel_type must be script or notebook, not {cfg.kernel_type!r}")
    longest = SESSION_MAX_S[cfg.accelerator_kind]
    if cfg.session_limit_s > longest:
        raise UserError(f"{where}: session_limit_s {cfg.session_limit_s:g} is over the {longest / 3600:g} h Kaggle "
                        f"allows a {cfg.accelerator_kind.upper()} session ({cfg.accelerator or 'CPU'})")
    check_settings("train", cfg.train, f"{where}: train")
    _place_checkpoints(cfg, where)
    if cfg.time_budget <= 0:
        raise UserError(f"{where}: session_limit_s {cfg.session_limit_s:g} leaves no training time after "
                        f"startup_margin_s {cfg.startup_margin_s:g} + publish_margin_s {cfg.publish_margin_s:g}")
    for key in ("data_dir", "out_dir", "resume_from", "max_steps", "time_budget", "wandb_run_id"):
        if key in cfg.train:
            raise UserError(f"{where}: train.{key} is set by the chain; remove it")
    for section, keys in (("tokenize", _TOKENIZE_KEYS), ("eval", _EVAL_KEYS)):
        extra = sorted(set(getattr(cfg, section)) - keys)
        if extra:
            raise UserError(f"{where}: unknown {section} key(s) {', '.join(extra)}; known: {', '.join(sorted(keys))}")
    check_settings("tokenize", cfg.tokenize.get("settings", {}), f"{where}: tokenize.settings")
    check_settings("eval", cfg.eval.get("settings", {}), f"{where}: eval.settings")
    shape = cfg.tokenize.get("accelerator", "")
    if shape and shape not in MACHINE_SHAPES:
        raise UserError(f"{where}: unknown tokenize.accelerator {shape!r}")
    if not cfg.tokenize.get("parts") and not cfg.token_datasets and not cfg.token_kernels:
        raise UserError(f"{where}: no training data: set tokenize.parts, token_datasets or token_kernels")
    unknown_slugs = sorted(set(cfg.slugs) - {"tokenize", "train", "eval", "checkpoints"})
    if unknown_slugs:
        raise UserError(f"{where}: unknown slugs key(s) {', '.join(unknown_slugs)}")
    return cfg


def _place_checkpoints(cfg: ChainConfig, where: str) -> None:
    """Checkpoints must fit the session's 20 GB output, with one more being written before the oldest goes:
    models too large for that keep one checkpoint in /kaggle/temp (the session publishes it from there); a
    setting that would overflow the output is an error here, not a full disk hours into a session. The publish
    margin grows with the checkpoint."""
    size = cfg.checkpoint_bytes
    if not cfg.publish_margin_s:
        cfg.publish_margin_s = max(1200.0, 600.0 + size / ASSUMED_UPLOAD_BYTES_PER_S)
    ckpt_dir = str(cfg.train.get("checkpoint_dir", ""))
    keep = int(cfg.train.get("keep_checkpoints", 2))
    if ckpt_dir.startswith("{temp}"):
        return
    if ckpt_dir and not ckpt_dir.startswith("{working}"):
        raise UserError(f"{where}: train.checkpoint_dir {ckpt_dir!r} must be under {{working}} or {{temp}}")
    peak = (keep + 1) * size
    if peak <= OUTPUT_LIMIT_BYTES:
        return
    if "checkpoint_dir" in cfg.train or "keep_checkpoints" in cfg.train:
        raise UserError(f"{where}: {keep} kept checkpoints of {size / 1e9:.1f} GB ({keep + 1} while one is written, "
                        f"{peak / 1e9:.1f} GB) overflow the session's {OUTPUT_LIMIT_BYTES / 1e9:g} GB output; set "
                        "train.checkpoint_dir to \"{temp}/checkpoints\" and train.keep_checkpoints to 1")
    cfg.train = {**cfg.train, "checkpoint_dir": "{temp}/checkpoints", "keep_checkpoints": 1}


# =============================================================================================================
# The state file
# =============================================================================================================

class State:
    """The chain's memory (JSON, written atomically after every change)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text())
        except FileNotFoundError:
            self.data = {"format": 1, "pushes": {}, "train_sessions": [], "events": []}
        except ValueError as err:
            raise UserError(f"{path}: the chain's state file is not valid JSON ({err}); fix or move it") from None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    @property
    def pushes(self) -> dict:
        return self.data["pushes"]


# =============================================================================================================
# The chain
# =============================================================================================================

TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
# KernelWorkerStatus (kagglesdk kernels_enums.py:31-38): CANCEL_REQUESTED is on the way to CANCEL_ACKNOWLEDGED.
TERMINAL = {"COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED"}
ACTIVE = {"QUEUED", "RUNNING", "NEW_SCRIPT", "CANCEL_REQUESTED"}


def http_status(err: BaseException) -> int | None:
    return getattr(getattr(err, "response", None), "status_code", None)


def is_transient(err: BaseException) -> bool:
    status = http_status(err)
    if status is not None:
        return status in TRANSIENT_STATUS
    name = type(err).__name__
    return name in {"ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "ChunkedEncodingError",
                    "ProtocolError", "RemoteDisconnected", "ConnectionResetError"}


def status_name(status) -> str:
    text = getattr(status, "name", None) or str(status)
    return text.rsplit(".", 1)[-1].upper()


def stream_to_file(url: str, target: Path, chunk_bytes: int = 1 << 20) -> int:
    """GET `url` into `target` a chunk at a time (through a temporary file, renamed when complete); the size is
    checked against Content-Length. Returns the bytes written."""
    import requests

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    written = 0
    with requests.get(url, stream=True, timeout=(30, 300)) as resp:
        resp.raise_for_status()
        expected = resp.headers.get("Content-Length")
        encoded = resp.headers.get("Content-Encoding")
        size = int(expected) if expected and expected.isdigit() else None
        bar = None
        if size and size >= 256 << 20:  # a checkpoint: show how it goes (on stderr)
            from tqdm import tqdm

            bar = tqdm(total=size, unit="B", unit_scale=True, desc=target.name, mininterval=2.0)
        with open(partial, "wb") as out:
            for chunk in resp.iter_content(chunk_bytes):
                out.write(chunk)
                written += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
    if expected is not None and expected.isdigit() and int(expected) != written and not encoded:
        partial.unlink(missing_ok=True)
        raise OSError(f"{url}: {written} bytes arrived of {expected}")
    os.replace(partial, target)
    return written


def _normalize_single_download(dest: Path, name: str) -> None:
    """The kaggle client names a downloaded file after its URL, and Kaggle may serve one file zipped: leave
    `dest/name` whichever way it came."""
    if (dest / name).is_file() and not zipfile.is_zipfile(dest / name):
        return
    files = [p for p in dest.iterdir() if p.is_file()]
    for f in files:
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                members = [m for m in z.namelist() if Path(m).name == name]
                if members:
                    (dest / name).write_bytes(z.read(members[0]))
                    return
    if len(files) == 1 and files[0].name != name:
        files[0].rename(dest / name)


class Chain:
    def __init__(self, cfg: ChainConfig, workdir: str | os.PathLike, api=None, log=print, sleep=time.sleep):
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state = State(self.workdir / "state.json")
        self.log = log
        self.sleep = sleep
        self.api = api
        self.user = cfg.user

    # ----- the API, with retries -----------------------------------------------------------------------------

    def connect(self) -> None:
        from shared.publish import kaggle_api

        if self.api is None:
            self.api = kaggle_api(from_secrets=False)
        api_user = self.api.get_config_value("username") or ""
        self.user = self.cfg.user or api_user
        if not self.user:
            raise UserError("no Kaggle user: set user in the config or KAGGLE_USERNAME")

    def call(self, what: str, fn, *args, **kwargs):
        """fn(*args), retried with exponential backoff on transient errors (429, 5xx, connection)."""
        from shared.publish import describe_error

        delay = self.cfg.retry_base_s
        for attempt in range(1, self.cfg.retry_attempts + 1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    return fn(*args, **kwargs)
            except UserError:
                raise
            except Exception as err:
                if not is_transient(err) or attempt == self.cfg.retry_attempts:
                    raise ApiFailure(f"{what}: {describe_error(err, self._secrets())}", http_status(err)) from None
                wait = delay
                retry_after = getattr(getattr(err, "response", None), "headers", {}).get("Retry-After")
                if retry_after and str(retry_after).isdigit():
                    wait = max(wait, float(retry_after))
                self.log(f"  {what}: {describe_error(err, self._secrets())}; retrying in {wait:g}s "
                         f"(attempt {attempt}/{self.cfg.retry_attempts})")
                self.sleep(wait)
                delay = min(delay * 2, 300)
        raise AssertionError("unreachable")

    def _secrets(self) -> list[str]:
        """The key from the environment and the one the client read (e.g. from kaggle.json): masked everywhere."""
        config = getattr(self.api, "config_values", None) or {}
        return [k for k in (os.environ.get("KAGGLE_KEY", ""), config.get("key", ""), config.get("token", "")) if k]

    def ref(self, slug: str) -> str:
        return f"{self.user}/{slug}"

    def dataset_exists(self, ref: str) -> bool:
        """404 is missing; 403 (it exists, but these credentials may not read it) is an error, not missing."""
        try:
            self.call(f"dataset {ref}", self.api.dataset_status, ref)
            return True
        except ApiFailure as err:
            if err.status == 404:
                return False
            if err.status in (401, 403):
                raise UserError(f"dataset {ref}: Kaggle refuses {self.user} access (HTTP {err.status}); it is "
                                "another user's private dataset, or the credentials are wrong") from None
            raise

    def kernel_info(self, ref: str):
        """(current version number, source of that version) or (0, "") if the kernel does not exist."""
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

        owner, slug = ref.split("/")

        def get():
            with self.api.build_kaggle_client() as client:
                req = ApiGetKernelRequest()
                req.user_name, req.kernel_slug = owner, slug
                return client.kernels.kernels_api_client.get_kernel(req)

        try:
            resp = self.call(f"kernel {ref}", get)
        except ApiFailure as err:
            if err.status == 404:
                return 0, ""
            if err.status in (401, 403):
                raise UserError(f"kernel {ref}: Kaggle refuses {self.user} access (HTTP {err.status}); it is "
                                "another user's private kernel, or the credentials are wrong") from None
            raise
        return int(resp.metadata.current_version_number or 0), (resp.blob.source or "") if resp.blob else ""

    def kernel_status(self, ref: str) -> tuple[str, str]:
        resp = self.call(f"status of {ref}", self.api.kernels_status, ref)
        return status_name(resp.status), getattr(resp, "failure_message", "") or ""

    # ----- checks before anything is pushed ----------------------------------------------------------------------

    def check_inputs(self) -> None:
        for ref in list(self.cfg.tokenize.get("inputs", [])) + list(self.cfg.token_datasets) + \
                list(self.cfg.eval.get("inputs", [])):
            if not self.dataset_exists(ref):
                raise UserError(f"dataset {ref} does not exist (or is not visible to {self.user}); check the config")
        for ref in self.cfg.token_kernels:
            version, _ = self.kernel_info(ref)
            if not version:
                raise UserError(f"kernel {ref} does not exist (or is not visible to {self.user}); check token_kernels")

    # ----- pushing exactly once ----------------------------------------------------------------------------------

    def push_once(self, key: str, ref: str, build) -> int:
        """Push the kernel `build(push_id)` builds, once for `key` however often the chain is restarted.

        Before the push the state records the push id (which the built code carries) and the kernel's version;
        a restart finds an unrecorded push by that id in the kernel's newest source.
        """
        rec = self.state.pushes.get(key)
        if rec and rec.get("version"):
            return rec["version"]
        if rec:  # pushed before a kill? The newest version's code carries the push id if so.
            version, source = self.kernel_info(ref)
            if version > rec["prev_version"] and rec["push_id"] in source:
                rec.update(version=version, pushed=time.time())
                self.state.save()
                self.log(f"  found {ref} version {version} pushed before a restart")
                return version
        else:
            rec = {"push_id": f"{key}-{uuid.uuid4().hex[:12]}", "ref": ref}
            self.state.pushes[key] = rec
        rec["prev_version"], _ = self.kernel_info(ref)
        self.state.save()
        folder = build(rec["push_id"])
        for attempt in range(1, self.cfg.retry_attempts + 1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    resp = self.api.kernels_push(str(folder), timeout=self._session_timeout())
                break
            except Exception as err:
                from shared.publish import describe_error

                if not is_transient(err) or attempt == self.cfg.retry_attempts:
                    raise ApiFailure(f"push of {ref}: {describe_error(err, self._secrets())}", http_status(err)) \
                        from None
                version, source = self.kernel_info(ref)  # did it land although the answer was lost?
                if version > rec["prev_version"] and rec["push_id"] in source:
                    rec.update(version=version, pushed=time.time())
                    self.state.save()
                    return version
                self.log(f"  push of {ref}: {describe_error(err, self._secrets())}; retrying (attempt {attempt})")
                self.sleep(self.cfg.retry_base_s * 2 ** (attempt - 1))
        if getattr(resp, "error", None):
            del self.state.pushes[key]
            self.state.save()
            raise UserError(f"push of {ref} refused: {one_line(resp.error)}")
        rec.update(version=int(resp.version_number or 0) or self.kernel_info(ref)[0], pushed=time.time())
        self.state.save()
        invalid = list(resp.invalid_dataset_sources or []) + list(resp.invalid_kernel_sources or [])
        if invalid:
            raise UserError(f"{ref} version {rec['version']} was pushed without inputs that do not exist: "
                            f"{', '.join(invalid)}")
        return rec["version"]

    def _session_timeout(self) -> str | None:
        """sessionTimeoutSeconds "must be lower than the global maximum" (kagglesdk): at the maximum, none is sent
        and Kaggle's own limit applies."""
        if self.cfg.session_limit_s >= SESSION_MAX_S[self.cfg.accelerator_kind]:
            return None
        return str(int(self.cfg.session_limit_s))

    def wait(self, ref: str, label: str, key: str | None = None) -> tuple[str, str, float]:
        """Poll until the version pushed for `key` ends; backoff from poll_initial_s to poll_max_s.

        The status call names no version: right after a push it may still report the previous version's end.
        A finished status counts once the pushed version was seen queued or running, or stale_status_s after
        the push (a session that ended between two polls)."""
        rec = self.state.pushes.get(key) if key else None
        interval, last, start, told = self.cfg.poll_initial_s, None, time.monotonic(), False
        while True:
            status, message = self.kernel_status(ref)
            if status != last:
                self.log(f"  {label}: {status.lower()}" + (f" ({message})" if message else ""))
                last = status
            if rec is not None and status in ACTIVE and not rec.get("seen_active"):
                rec["seen_active"] = True
                self.state.save()
            if status in TERMINAL:
                pushed = rec.get("pushed", 0) if rec is not None else 0
                if rec is None or rec.get("seen_active") or time.time() - pushed >= self.cfg.stale_status_s:
                    return status, message, time.monotonic() - start
                if not told:
                    self.log(f"  {label}: not seen queued or running yet; taking {status.lower()} as the previous "
                             f"version's until it is, or {self.cfg.stale_status_s:g}s after the push")
                    told = True
            self.sleep(interval)
            interval = min(interval * 1.5, self.cfg.poll_max_s)

    def download_output(self, ref: str, dest: Path, pattern: str | None = None) -> list[str]:
        """The output files of `ref`'s newest session whose path matches `pattern` (re.search), each streamed to
        disk (an 18 GB checkpoint never sits in memory, unlike the kaggle client's kernels_output), and the
        session's log as `<slug>.log`, as the kaggle client writes it. Paths are checked to stay under `dest`."""
        from kagglesdk.kernels.types.kernels_api_service import ApiListKernelSessionOutputRequest

        owner, slug = ref.split("/")
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        wanted = re.compile(pattern) if pattern is not None else None
        files: list[str] = []
        token, log_text = "", None
        while True:
            def page(token=token):
                with self.api.build_kaggle_client() as client:
                    request = ApiListKernelSessionOutputRequest()
                    request.user_name, request.kernel_slug, request.page_size = owner, slug, 200
                    request.page_token = token
                    return client.kernels.kernels_api_client.list_kernel_session_output(request)

            resp = self.call(f"output of {ref}", page)
            log_text = resp.log if log_text is None else log_text
            for item in resp.files or []:
                if wanted is not None and not wanted.search(item.file_name):
                    continue
                target = (dest / item.file_name).resolve()
                if not target.is_relative_to(dest.resolve()):
                    raise ApiFailure(f"output of {ref}: file name {item.file_name!r} points outside {dest}")
                self.call(f"output file {item.file_name} of {ref}", stream_to_file, item.url, target)
                files.append(str(target))
            token = resp.next_page_token
            if not token:
                break
        if log_text:
            (dest / f"{slug}.log").write_text(log_text)
            files.append(str(dest / f"{slug}.log"))
        return files

    # ----- the checkpoint dataset --------------------------------------------------------------------------------

    def dataset_step(self, ref: str) -> int:
        """The step of the checkpoint the dataset's newest version holds (0: none yet)."""
        from shared.publish import MANIFEST, checkpoint_step

        dest = self.workdir / "dataset-probe"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        try:
            self.call(f"dataset {ref}", self.api.dataset_download_file, ref, MANIFEST, str(dest), force=True,
                      quiet=True)
        except ApiFailure as err:
            if err.status == 404:
                return 0
            raise
        _normalize_single_download(dest, MANIFEST)
        return checkpoint_step(dest) or 0

    def wait_dataset_ready(self, ref: str, timeout_s: float = 3600) -> None:
        """A new dataset version takes a while to process on Kaggle; the next session must mount it, not the
        previous one, so wait until the newest version is ready."""
        interval, deadline = self.cfg.poll_initial_s, time.monotonic() + timeout_s
        while True:
            status = str(self.call(f"dataset {ref}", self.api.dataset_status, ref)).lower()
            if status == "ready":
                return
            if status in ("failed", "deleted"):  # DatabundleVersionStatus (kagglesdk dataset_enums.py:3-12)
                raise UserError(f"dataset {ref}: its newest version is {status} on Kaggle; see the dataset's page")
            if time.monotonic() > deadline:
                raise UserError(f"dataset {ref} is still {status!r} after {timeout_s / 60:.0f} minutes; run the chain "
                                "again later")
            self.sleep(interval)
            interval = min(interval * 1.5, self.cfg.poll_max_s)

    def ensure_checkpoint_dataset(self, ref: str) -> None:
        """Create the checkpoint dataset with a placeholder, so session 1 can already attach it."""
        from shared.publish import PLACEHOLDER_FILE, push_dataset_folder, write_dataset_folder

        if self.dataset_exists(ref):
            return
        folder = self.workdir / "dataset-init"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        readme = folder / PLACEHOLDER_FILE
        readme.write_text(f"# Checkpoints of the {self.cfg.name} run\n\nEach version holds the newest checkpoint of "
                          "a training session (model, AdamW state, data position, metrics). Version 1 holds none.\n")
        write_dataset_folder(folder / "upload", ref, f"{self.cfg.name} checkpoints", [readme])
        self.call(f"create dataset {ref}", push_dataset_folder, self.api, folder / "upload", ref, "no checkpoint yet")
        self.wait_dataset_ready(ref)
        self.log(f"created the checkpoint dataset {ref}")

    # ----- the stages --------------------------------------------------------------------------------------------

    def token_part_ref(self, part: int) -> str:
        return self.ref(f"{self.cfg.slug('tokenize')}-part-{part}")

    def run_tokenize(self) -> None:
        parts = int(self.cfg.tokenize.get("parts") or 0)
        done = self.state.data.setdefault("tokenize", {})
        for part in range(parts):
            ref = self.token_part_ref(part)
            if done.get(str(part)) == "COMPLETE":
                continue
            failures = 0
            for attempt in range(1, self.cfg.max_failed_sessions + 2):
                key = f"tokenize-{part}-{attempt}"
                if key not in self.state.pushes:
                    version, _ = self.kernel_info(ref)
                    if version and attempt == 1:
                        status, _ = self.kernel_status(ref)
                        if status == "COMPLETE":
                            self.log(f"tokenize part {part}: {ref} already complete (version {version}); not pushed")
                            break
                self.log(f"tokenize part {part + 1}/{parts}: {ref}")
                version = self.push_once(key, ref, lambda pid, p=part: self.build_tokenize(p, pid))
                status, message, secs = self.wait(ref, f"{ref} v{version}", key)
                if status == "COMPLETE":
                    self.log(f"  part {part} done in {secs:.0f}s")
                    break
                failures += 1
                logs = self.workdir / "sessions" / f"tokenize-{part}-{attempt}"
                self.download_output(ref, logs, pattern=r"^$")
                self.log(f"  part {part} failed: {message or status}; log in {logs}")
                if failures >= self.cfg.max_failed_sessions:
                    raise UserError(f"tokenize part {part} failed {failures} times in a row "
                                    f"(last: {message or status}); see {logs}")
            done[str(part)] = "COMPLETE"
            self.state.save()

    def build_tokenize(self, part: int, push_id: str) -> Path:
        t = self.cfg.tokenize
        settings = {"progress": False, **t.get("settings", {}), "part": part, "out_dir": "{working}"}
        kernel_sources = []
        if part > 0:
            prev = self.token_part_ref(part - 1)
            settings["prev_dir"] = "{input:" + prev + "}"
            kernel_sources.append(prev)
        return build_kernel("tokenize", self.workdir / "build" / f"tokenize-part-{part}", user=self.user,
                            slug=self.token_part_ref(part).split("/")[1], settings=settings,
                            kernel_type=self.cfg.kernel_type, accelerator=t.get("accelerator", ""),
                            dataset_sources=t.get("inputs", []), kernel_sources=kernel_sources, push_id=push_id)

    def data_sources(self) -> tuple[list[str], list[str], str]:
        parts = int(self.cfg.tokenize.get("parts") or 0)
        kernels = [self.token_part_ref(p) for p in range(parts)] + list(self.cfg.token_kernels)
        datasets = list(self.cfg.token_datasets)
        data_dir = ",".join("{input:" + r + "}" for r in kernels + datasets)
        return datasets, kernels, data_dir

    def build_train(self, push_id: str, expect_step: int = 0) -> Path:
        datasets, kernels, data_dir = self.data_sources()
        ckpt = self.ref(self.cfg.slug("checkpoints"))
        settings = {"progress": False, "run_name": self.cfg.name, **self.cfg.train, "data_dir": data_dir,
                    "out_dir": "{working}/train", "max_steps": self.cfg.total_steps,
                    "time_budget": self.cfg.time_budget, "wandb_run_id": self.wandb_run_id()}
        return build_kernel("train", self.workdir / "build" / "train", user=self.user, slug=self.cfg.slug("train"),
                            settings=settings, kernel_type=self.cfg.kernel_type, accelerator=self.cfg.accelerator,
                            internet=True, dataset_sources=[ckpt] + datasets, kernel_sources=kernels,
                            checkpoint_dataset={"dataset": ckpt, "resume_setting": "resume_from", "publish": True,
                                                "title": f"{self.cfg.name} checkpoints", "expect_step": expect_step},
                            push_id=push_id)

    def wandb_run_id(self) -> str:
        """One W&B run per chain, made once and kept in the state: every session resumes it, and no two chains
        (even of one name) share a run."""
        if not self.state.data.get("wandb_run_id"):
            self.state.data["wandb_run_id"] = f"{self.cfg.name}-{uuid.uuid4().hex[:8]}"
            self.state.save()
        return self.state.data["wandb_run_id"]

    def quota_left_s(self) -> tuple[float, float, str] | None:
        """(seconds left, seconds allowed, reset time) of the accelerator's weekly quota, None for CPU."""
        kind = MACHINE_SHAPES.get(self.cfg.accelerator)
        if kind is None or not hasattr(self.api, "quota_view"):  # CPU, or a kaggle client without quota calls
            return None
        resp = self.call("quota", self.api.quota_view)
        quota = getattr(resp, f"{kind}_quota", None)
        if quota is None:
            return None
        if quota.total_time_allowed is None:
            return None
        # A week with no use (or nothing reserved) may leave the field out: None, not zero.
        used = sum(t.total_seconds() for t in (quota.time_used, getattr(quota, "time_reserved", None)) if t)
        total = quota.total_time_allowed.total_seconds()
        reset = getattr(resp, "quota_refresh_time", None)
        return total - used, total, str(reset) if reset else "next Saturday"

    def run_train(self) -> None:
        cfg = self.cfg
        ckpt_ref = self.ref(cfg.slug("checkpoints"))
        self.ensure_checkpoint_dataset(ckpt_ref)
        sessions = self.state.data["train_sessions"]
        step = self.dataset_step(ckpt_ref)
        if step >= cfg.total_steps:
            if not sessions:
                raise UserError(f"nothing to train: checkpoint dataset {ckpt_ref} already holds step {step} of "
                                f"total_steps {cfg.total_steps} (raise total_steps to train further)")
            return
        failures = sum(1 for _ in _trailing_failures(sessions))
        kind = MACHINE_SHAPES.get(cfg.accelerator, "cpu").upper()
        while step < cfg.total_steps:
            n = len(sessions) + (0 if sessions and not sessions[-1].get("ended") else 1)
            if cfg.max_train_sessions and n > cfg.max_train_sessions:
                self.log(f"stopping training after {cfg.max_train_sessions} sessions (max_train_sessions) at step "
                         f"{step} of {cfg.total_steps}")
                break
            if not sessions or sessions[-1].get("ended"):
                quota = self.quota_left_s()
                if quota is not None and quota[0] < cfg.session_limit_s:
                    raise UserError(
                        f"stopping: the weekly {kind} quota would be exceeded: {quota[0] / 3600:.2f} h left of "
                        f"{quota[1] / 3600:g} h, a session may use {cfg.session_limit_s / 3600:.2f} h; it resets at "
                        f"{quota[2]}; run the chain again then (it continues at step {step})")
                sessions.append({"n": n, "key": f"train-{n}", "step_before": step})
                self.state.save()
            sess = sessions[-1]
            ref = self.ref(cfg.slug("train"))
            self.log(f"train session {n} of {self.sessions_total(n, step, sessions)}: {ref}, from step {step}")
            sess["version"] = self.push_once(sess["key"], ref, lambda pid, at=step: self.build_train(pid, at))
            self.state.save()
            status, message, secs = self.wait(ref, f"{ref} v{sess['version']}", sess["key"])
            new_step, info = self.after_session(ref, sess, ckpt_ref, step)
            sess.update(ended=time.time(), status=status, message=message, seconds=round(secs, 1),
                        step_after=new_step, **info)
            self.state.save()
            if new_step > step:
                failures = 0
            else:
                failures += 1
            self.report(sess, step, new_step, status, message, secs)
            step = new_step
            if failures >= cfg.max_failed_sessions:
                raise UserError(f"stopping: {failures} train sessions in a row made no progress (last: "
                                f"{message or status}); logs in {self.workdir / 'sessions'}")

    def after_session(self, ref: str, sess: dict, ckpt_ref: str, step_before: int) -> tuple[int, dict]:
        """Fetch the session's log, metrics and plot; publish its checkpoint from its output if it could not."""
        from shared.publish import PUBLISH_RECORD, checkpoint_step, publish_checkpoint

        dest = self.workdir / "sessions" / f"train-{sess['n']:02d}"
        self.download_output(ref, dest, pattern=r"^(publish\.json|train/metrics\.jsonl|train/loss\.png)$")
        info: dict = {"logs": str(dest)}
        for name in ("metrics.jsonl", "loss.png"):
            if (dest / "train" / name).exists():
                shutil.copyfile(dest / "train" / name, self.workdir / name)
        record = {}
        if (dest / PUBLISH_RECORD).exists():
            record = json.loads((dest / PUBLISH_RECORD).read_text())
        self.wait_dataset_ready(ckpt_ref)
        step = self.dataset_step(ckpt_ref)
        out_step = record.get("step") or 0
        if out_step > step:  # the session saved a newer checkpoint than the dataset holds: publish it from here
            name = f"step_{out_step:06d}"
            ckpt_dir = self.workdir / "fallback" / name
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            got = self.download_output(ref, self.workdir / "fallback", pattern=rf"^train/checkpoints/{name}/")
            src = self.workdir / "fallback" / "train" / "checkpoints" / name
            if not [f for f in got if not f.endswith(".log")]:
                self.log(f"  warning: the session's output holds no checkpoint {name} (large models keep theirs in "
                         "/kaggle/temp, gone with the session); not published")
            elif checkpoint_step(src) == out_step and _verify_files(src):
                reason = record.get("reason") or "the session did not publish it"
                self.log(f"  publishing step {out_step} from the kernel output ({reason})")
                self.call(f"publish to {ckpt_ref}", publish_checkpoint, self.api, src, ckpt_ref, self.workdir,
                          f"{self.cfg.name} checkpoints", f"checkpoint at step {out_step} (published by the chain)")
                info["published_by"] = "chain"
                self.wait_dataset_ready(ckpt_ref)
                step = self.dataset_step(ckpt_ref)
            else:
                self.log(f"  warning: the output's checkpoint {name} is incomplete; not published")
        elif record.get("published"):
            info["published_by"] = "session"
        return max(step, 0), info

    def sessions_total(self, n: int, step: int, sessions: list) -> str:
        """"~N" sessions in all (this one included), from the steps the finished ones made; "?" before any."""
        if not any(s.get("ended") and s.get("step_after", 0) > s.get("step_before", 0) for s in sessions):
            return f"{self.cfg.max_train_sessions} (max_train_sessions)" if self.cfg.max_train_sessions else "?"
        total = n - 1 + self.sessions_left(step, sessions)
        if self.cfg.max_train_sessions and total > self.cfg.max_train_sessions:
            return f"{self.cfg.max_train_sessions} (max_train_sessions; ~{total} to reach total_steps)"
        return f"~{total}"

    def sessions_left(self, step: int, sessions: list) -> int:
        done = [s for s in sessions if s.get("ended") and s.get("step_after", 0) > s.get("step_before", 0)]
        if not done:
            return 1
        per = sum(s["step_after"] - s["step_before"] for s in done) / len(done)
        return max(1, math.ceil((self.cfg.total_steps - step) / per))

    def report(self, sess: dict, before: int, after: int, status: str, message: str, secs: float) -> None:
        from shared.metrics import read_metrics

        records = read_metrics(self.workdir / "metrics.jsonl") if (self.workdir / "metrics.jsonl").exists() else []
        losses = [r for r in records if r.get("loss") is not None and before < r.get("step", 0) <= after]
        speeds = [r["tokens_per_s"] for r in losses[1:] if r.get("tokens_per_s")]
        loss = f"loss {losses[-1]['loss']:.4f}" if losses else "no loss logged"
        speed = f"{sum(speeds) / len(speeds):,.0f} tokens/s" if speeds else "tokens/s n/a"
        left = self.sessions_left(after, self.state.data["train_sessions"]) if after < self.cfg.total_steps else 0
        self.log(f"  session {sess['n']} {status.lower()} in {secs:.0f}s: step {before} -> {after} of "
                 f"{self.cfg.total_steps}, {loss}, {speed}" + (f" ({message})" if message else ""))
        quota = None
        try:
            quota = self.quota_left_s()
        except ApiFailure:
            pass
        quota_text = (f", {MACHINE_SHAPES[self.cfg.accelerator].upper()} quota left {quota[0] / 3600:.2f} h "
                      f"(~{int(quota[0] // self.cfg.session_limit_s)} sessions)") if quota else ""
        self.log(f"  ~{left} more session(s){quota_text}")
        self.log(f"  logs: {sess.get('logs') or ''}  metrics: {self.workdir / 'metrics.jsonl'}  "
                 f"plot: {self.workdir / 'loss.png'}")

    def run_eval(self) -> None:
        ev = self.cfg.eval
        if ev.get("enabled", True) is False:
            return
        if (self.state.data.get("eval") or {}).get("status") == "COMPLETE":
            return
        if not (REPO / KERNEL_SOURCES["eval"]).exists():
            self.log("notice: kernels/eval.py does not exist yet; skipping the eval kernel")
            return
        ckpt_ref = self.ref(self.cfg.slug("checkpoints"))
        _datasets, kernels, _ = self.data_sources()
        ref = self.ref(self.cfg.slug("eval"))
        settings = {"out_dir": "{working}", **ev.get("settings", {})}
        if kernels and "data_dir" not in settings:
            settings["data_dir"] = "{input:" + kernels[0] + "}"

        def build(push_id: str) -> Path:
            return build_kernel("eval", self.workdir / "build" / "eval", user=self.user, slug=self.cfg.slug("eval"),
                                settings=settings, kernel_type=self.cfg.kernel_type,
                                accelerator=ev.get("accelerator", self.cfg.accelerator), internet=True,
                                dataset_sources=[ckpt_ref] + list(ev.get("inputs", [])), kernel_sources=kernels[:1],
                                checkpoint_dataset={"dataset": ckpt_ref, "resume_setting": "checkpoint"},
                                push_id=push_id)

        self.log(f"eval: {ref}")
        version = self.push_once("eval", ref, build)
        status, message, secs = self.wait(ref, f"{ref} v{version}", "eval")
        dest = self.workdir / "eval"
        try:
            self.download_output(ref, dest, pattern=r"^(?!hf/)")
        except ApiFailure as err:
            self.log(f"  warning: could not download the eval output ({err})")
        self.state.data["eval"] = {"version": version, "status": status, "message": message, "dir": str(dest)}
        self.state.save()
        if status == "COMPLETE":
            self.log(f"  eval done in {secs:.0f}s: report in {dest}")
        else:
            self.log(f"  warning: the eval kernel ended {status.lower()} ({message}); its log is in {dest}")

    def run(self) -> dict:
        data = self.state.data
        if data.get("done"):
            raise UserError(f"this chain is already finished (step {data.get('final_step')} of total_steps "
                            f"{self.cfg.total_steps}; results in {self.workdir}); raise total_steps to train further")
        self.connect()
        self.log(f"chain {self.cfg.name}: {self.cfg.total_steps} steps on {self.cfg.accelerator or 'CPU'} as "
                 f"{self.user}; state {self.state.path}")
        for shape in sorted({self.cfg.accelerator, self.cfg.eval.get("accelerator", ""),
                             self.cfg.tokenize.get("accelerator", "")} & set(RETIRED_SHAPES)):
            self.log(f"notice: {shape} is not in Kaggle's Sep 2026 accelerator list (TPU: TpuV5E8, TpuV6E8; GPU: "
                     "NvidiaTeslaT4 and up); Kaggle may refuse the push")
        self.check_inputs()
        self.run_tokenize()
        self.run_train()
        self.run_eval()
        final_step = self.dataset_step(self.ref(self.cfg.slug("checkpoints")))
        data.update(done=True, final_step=final_step)
        self.state.save()
        self.log(f"done: step {final_step} of {self.cfg.total_steps} in "
                 f"{len(data['train_sessions'])} train sessions.")
        self.log(f"results: {self.workdir}  (metrics.jsonl, loss.png, sessions/ with each session's log, eval/)")
        self.log(f"checkpoint: Kaggle dataset {self.ref(self.cfg.slug('checkpoints'))}")
        return data


class ApiFailure(UserError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def _trailing_failures(sessions: list):
    for s in reversed(sessions):
        if not s.get("ended"):
            continue
        if s.get("step_after", 0) > s.get("step_before", 0):
            return
        yield s


def _verify_files(folder: Path) -> bool:
    """The checkpoint's files match its manifest (sizes and sha256)."""
    from shared.fsutil import sha256_file

    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        for name, meta in manifest["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError):
        return False
    return True
