"""Notebook kernels run as scripts: the code cells of an .ipynb, in order."""

from __future__ import annotations

import json


def notebook_to_script(text: str) -> str:
    """The code cells of an .ipynb, in order, as one script (IPython magics skipped, `!cmd` via a shell)."""
    nb = json.loads(text)
    chunks = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list):
            source = "".join(source)
        lines = []
        for line in source.splitlines():
            stripped = line.lstrip()
            indent = line[: len(line) - len(stripped)]
            if stripped.startswith("!"):
                lines.append(f"{indent}__import__('subprocess').run({stripped[1:]!r}, shell=True, check=True)")
            elif stripped.startswith("%"):
                lines.append(f"{indent}pass  # magic skipped by the local Kaggle: {stripped}")
            else:
                lines.append(line)
        chunks.append(f"# --- cell {i} ---\n" + "\n".join(lines) + "\n")
    return "\n".join(chunks)
