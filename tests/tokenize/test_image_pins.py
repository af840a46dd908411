"""The CPU image's stand-in (.venv-kaggle-cpu) holds the versions of Colab's freeze that Kaggle's CPU image builds
on (scripts/image_pins/kaggle-cpu.txt, each with its line in googlecolab/backend-info's pip-freeze.txt; issue 50):
a stand-in newer than the image hid that the image's datasets could not be upgraded."""

import json
import re
import subprocess

from helpers import REPO

PINS = REPO / "scripts" / "image_pins" / "kaggle-cpu.txt"


def cpu_image_pins() -> dict[str, str]:
    """name -> version, each pin's line cited from Colab's freeze."""
    pins = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            # Colab's freeze, or the image's own as a session measured it (scripts/rebuild_image_pins.py)
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)\s+# (CB pip-freeze|measured kaggle-cpu-freeze)\.txt:\d+",
                             line.strip())
            assert m, f"not a cited pin: {line}"
            pins[m.group(1)] = m.group(2)
    return pins


def test_the_cpu_image_pins_are_the_freezes_for_what_the_tokenize_kernel_reads_with():
    pins = cpu_image_pins()
    assert {name: pins[name] for name in ("datasets", "huggingface_hub", "pyarrow", "fsspec", "kagglehub", "kaggle",
                                          "requests")} == {
        "datasets": "4.0.0", "huggingface_hub": "1.11.0", "pyarrow": "18.1.0", "fsspec": "2025.3.0",
        "kagglehub": "1.0.0", "kaggle": "2.0.2", "requests": "2.32.4"}


def test_the_cpu_images_stand_in_has_exactly_the_pinned_versions(image_pythons):
    pins = cpu_image_pins()
    code = ("import json, sys; from importlib import metadata; "
            "print(json.dumps({n: metadata.version(n) for n in json.loads(sys.argv[1])}))")
    proc = subprocess.run([str(image_pythons["cpu"]), "-c", code, json.dumps(sorted(pins))], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == pins
