"""Rebuild a Kaggle image's pins (scripts/image_pins/kaggle-<image>.txt, which `bash scripts/setup.sh --kaggle-image`
installs into the image's stand-in) from a freeze a session saved: every package the pins name gets the version the
image really had. The freeze is written beside the pins (kaggle-<image>-freeze.txt) and each pin cites its line.

    .venv/bin/python scripts/rebuild_image_pins.py --image tpu runs/<chain>/sessions/train-01/session-facts.json

FREEZE: a session's session-facts.json (its image.freeze, shared/kaggle/facts.py) or a `pip freeze` text. Then run
`bash scripts/setup.sh --kaggle-image` to make the stand-in match.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.errors import UserError, run_cli  # noqa: E402

PINS_DIR = REPO / "scripts" / "image_pins"
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)")


def normalized(name: str) -> str:
    """A package name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> list[str]:
    """`name==version` lines of a freeze: a session's facts file (image.freeze) or a pip freeze text."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            freeze = json.loads(text)["image"]["freeze"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{path}: no image.freeze in it (a session's session-facts.json holds one)") from None
        return [str(line) for line in freeze]
    return [line.strip() for line in text.splitlines() if "==" in line and not line.startswith("#")]


def rebuild(pins_text: str, freeze: list[str], freeze_name: str) -> tuple[str, list[str]]:
    """(the pins with each package at the freeze's version, citing the freeze's line; the names the freeze lacks,
    whose lines stay as they were). A local version label (torch's +cpu, +libtpu) is dropped: the pins install
    from the package index."""
    versions = {}
    for number, line in enumerate(freeze, start=2):  # line 1 of the freeze file is its header
        name, _, version = line.partition("==")
        versions[normalized(name)] = (version.split("+", 1)[0].strip(), number)
    out, missing = [], []
    for line in pins_text.splitlines():
        match = _REQUIREMENT.match(line)
        if not match:
            out.append(line)
            continue
        name = match.group(1)
        if normalized(name) not in versions:
            missing.append(name)
            out.append(line)
            continue
        version, number = versions[normalized(name)]
        out.append(f"{f'{name}=={version}':<28} # measured {freeze_name}:{number}")
    return "\n".join(out) + "\n", missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", choices=("tpu", "cpu"), required=True)
    parser.add_argument("freeze", type=Path)
    parser.add_argument("--pins-dir", type=Path, default=PINS_DIR)
    args = parser.parse_args(argv)

    def run() -> None:
        pins = args.pins_dir / f"kaggle-{args.image}.txt"
        freeze = read_freeze(args.freeze)
        if not freeze:
            raise UserError(f"{args.freeze}: no name==version lines")
        freeze_file = args.pins_dir / f"kaggle-{args.image}-freeze.txt"
        freeze_file.write_text(f"# Kaggle's {args.image.upper()} image as a session measured it ({args.freeze})\n"
                               + "\n".join(freeze) + "\n")
        text, missing = rebuild(pins.read_text(), freeze, freeze_file.name)
        pins.write_text(text)
        print(f"rebuilt {pins} from {len(freeze)} packages in {args.freeze} (saved as {freeze_file})")
        for name in missing:
            print(f"warning: {name} is not in the freeze: its pin is left as it was")

    run_cli(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
