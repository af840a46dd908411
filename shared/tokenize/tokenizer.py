"""GPT-2's BPE through tiktoken, with an offline route for the merge ranks.

`tiktoken.get_encoding("gpt2")` downloads its files on first use. Offline (CI, Kaggle without internet)
we build the same encoding from a local ranks file: the openai-whisper source distribution on the package
index ships GPT-2's ranks as `whisper/assets/gpt2.tiktoken`, and `fetch_gpt2_ranks` extracts it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from shared.errors import UserError

EOT_TOKEN = 50256  # <|endoftext|>
RANKS_ENV = "GPT2_TIKTOKEN_RANKS"
DEFAULT_RANKS_PATH = Path.home() / ".cache" / "gpt2-on-kaggle" / "gpt2.tiktoken"
WHISPER_SDIST = "openai-whisper==20250625"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_gpt2_ranks(dest: Path = DEFAULT_RANKS_PATH) -> Path:
    """Put GPT-2's ranks file at `dest`, taken from the openai-whisper sdist on the package index."""
    dest = Path(dest)
    if dest.exists() and _sha256(dest) == RANKS_SHA256:
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               WHISPER_SDIST, "-d", tmp]
        subprocess.run(cmd, check=True)
        (sdist,) = Path(tmp).glob("openai_whisper-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
            data = tar.extractfile(member).read()
    if hashlib.sha256(data).hexdigest() != RANKS_SHA256:
        raise UserError(f"{WHISPER_SDIST}: gpt2.tiktoken has an unexpected sha256")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")  # processes fetching at once each write their own
    tmp_dest.write_bytes(data)
    os.replace(tmp_dest, dest)
    return dest


def resolve_ranks_path(ranks_path: str | os.PathLike | None = None) -> Path | None:
    """The local ranks file to use: the argument, then $GPT2_TIKTOKEN_RANKS, then the default cache path."""
    if ranks_path:
        path = Path(ranks_path)
        if not path.is_file():
            raise UserError(f"GPT-2 ranks file not found: {path}")
        return path
    if os.environ.get(RANKS_ENV):
        return resolve_ranks_path(os.environ[RANKS_ENV])
    return DEFAULT_RANKS_PATH if DEFAULT_RANKS_PATH.is_file() else None


def gpt2_encoding(ranks_path: str | os.PathLike | None = None):
    """tiktoken's GPT-2 encoding; from a local ranks file when one is found, else tiktoken's download."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    path = resolve_ranks_path(ranks_path)
    if path is None:
        return tiktoken.get_encoding("gpt2")
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": EOT_TOKEN},
        explicit_n_vocab=EOT_TOKEN + 1,
    )
