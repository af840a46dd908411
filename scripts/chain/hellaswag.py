"""The HellaSwag file the train sessions score at their evals (the chain config's `hellaswag`: "download" for the
validation set, "demo" for a small offline set made from the demo corpus, a local jsonl path, or "" for none).

The chain makes it a dataset of its own once (`<name>-hellaswag`) and the train kernel reads it from its inputs,
so every session scores the same examples (the first `train.hellaswag_examples`) without reaching the internet.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.chain.context import StageContext

HELLASWAG_FILE = "hellaswag_val.jsonl"
DEMO_EXAMPLES = 200


def hellaswag_ref(ctx: StageContext) -> str:
    return ctx.ref(f"{ctx.cfg.name}-hellaswag")


def _write_file(source: str, path: Path, log) -> Path:
    from shared.train.hellaswag import demo_examples, download, write_jsonl

    if source == "download":
        return download(path, log)
    if source == "demo":
        return write_jsonl(path, demo_examples(DEMO_EXAMPLES))
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, path)
    return path


def ensure_hellaswag_dataset(ctx: StageContext) -> str | None:
    """The dataset holding HELLASWAG_FILE (made and uploaded on first use, then waited for until ready), or None
    when the config asks for no in-training HellaSwag."""
    source = ctx.cfg.hellaswag
    if not source:
        return None
    ref = hellaswag_ref(ctx)
    if ctx.client.dataset_exists(ref):
        return ref
    from shared.kaggle.publish import push_dataset_folder, write_dataset_folder

    folder = ctx.workdir / "hellaswag"
    path = _write_file(source, folder / "files" / HELLASWAG_FILE, ctx.log)
    upload = write_dataset_folder(folder / "upload", ref, f"{ctx.cfg.name} HellaSwag", [path])
    ctx.client.call(f"create dataset {ref}", push_dataset_folder, ctx.client.api, upload, ref, "HellaSwag validation")
    ctx.client.wait_dataset_version(ref, 0)
    ctx.log(f"uploaded HellaSwag ({source}) as {ref}, for the train sessions' evals")
    return ref


def hellaswag_settings(ctx: StageContext, ref: str | None) -> dict:
    """The train kernel's setting for the file in its inputs (none where the config sets hellaswag_file itself)."""
    if not ref or "hellaswag_file" in ctx.cfg.train.settings:
        return {}
    return {"hellaswag_file": "{input:" + ref + "}/" + HELLASWAG_FILE}
