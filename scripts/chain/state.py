"""The chain's state file: what it has pushed and what each session did, so that a chain killed at any point
and started again continues without pushing a session twice."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.errors import UserError


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
