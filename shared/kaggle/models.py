"""Kaggle Models: the eval kernel's upload of its 🤗 export as a new version of a Kaggle Model instance, through
the session's authenticated API (shared/kaggle/publish.py `kaggle_api`), signed in as Kaggle's clients would: the
notebook's own token where the session has one, else the attached key (shared/kaggle/credential.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from shared.errors import UserError, within
from shared.kaggle.calls import kaggle_call
from shared.kaggle.credential import candidates, kaggle_api, use_credential

# The upload's limit: the kaggle client sets no timeout of its own, and a hung upload would hold the eval session
# (its evaluation comes after the export) until its kill. gpt2-xl's 6.2 GB take 10 min at an assumed 10 MB/s.
UPLOAD_LIMIT_S = 1800.0


def upload_kaggle_model(folder: Path, handle: str, notes: str, log=print, limit_s: float = UPLOAD_LIMIT_S) -> None:
    """Upload `folder` as a new version of the Kaggle Model instance `handle` (owner/model/framework/variation),
    creating the model and the instance on first use; a UserError after `limit_s` without an answer."""
    parts = handle.split("/")
    if len(parts) != 4 or not all(parts):
        raise UserError(f"--kaggle-model {handle!r}: expected owner/model/framework/variation")
    try:
        within(limit_s, lambda: _upload(folder, handle, notes, log))
    except UserError as err:
        if str(err).startswith("no answer within"):
            raise UserError(f"--kaggle-model {handle}: the upload gave {err}; the evaluation goes on") from None
        raise


def _upload(folder: Path, handle: str, notes: str, log) -> None:
    owner, model_slug, framework, variation = handle.split("/")
    available = candidates()
    if available:
        use_credential(available[0])
    api = kaggle_api(from_secrets=not available)  # with none, a UserError names what is missing
    # Each call tried again after a transient fault (a 5xx, a 429, a reset: shared/kaggle/calls.py), so that one
    # is never read as "the model does not exist yet".
    try:
        kaggle_call(lambda: api.model_instance_version_create(handle, str(folder), version_notes=notes, quiet=True),
                    f"uploading a version of Kaggle Model {handle}", log)
        log(f"uploaded {folder} as a new version of Kaggle Model {handle}")
        return
    except Exception as err:
        first = f"{type(err).__name__}: {str(err)[:200]}"
    try:  # the model or its instance may not exist yet
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "model-metadata.json").write_text(json.dumps({
                "ownerSlug": owner, "slug": model_slug, "title": model_slug, "isPrivate": True,
                "description": "GPT-2 pretrained with gpt2-on-kaggle"}))
            try:
                kaggle_call(lambda: api.model_create_new(tmp), f"creating Kaggle Model {owner}/{model_slug}", log)
            except Exception:
                pass  # it exists already
        staging = Path(tempfile.mkdtemp())
        for f in folder.iterdir():
            if f.is_file():
                shutil.copy2(f, staging / f.name)
        (staging / "model-instance-metadata.json").write_text(json.dumps({
            "ownerSlug": owner, "modelSlug": model_slug, "instanceSlug": variation, "framework": framework,
            "licenseName": "Apache 2.0", "overview": notes}))
        kaggle_call(lambda: api.model_instance_create(str(staging), quiet=True),
                    f"creating Kaggle Model instance {handle}", log)
        shutil.rmtree(staging, ignore_errors=True)
        log(f"created Kaggle Model {handle} from {folder}")
    except Exception as err:
        raise UserError(f"--kaggle-model {handle}: upload failed ({first}; then {type(err).__name__})") from None
