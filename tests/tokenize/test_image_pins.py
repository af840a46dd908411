"""The CPU image's stand-in (.venv-kaggle-cpu) holds the versions of Colab's freeze that Kaggle's CPU image builds
on (scripts/image_pins/kaggle-cpu.txt, each with its line in googlecolab/backend-info's pip-freeze.txt; issue 50),
or what Kaggle/docker-python's Dockerfile.tmpl puts over it (protobuf): a stand-in newer than the image hid that the
image's datasets could not be upgraded. The TPU image's list leaves unpinned what Kaggle/docker-python does."""

import json
import re
import subprocess

from helpers import REPO

PINS = REPO / "scripts" / "image_pins" / "kaggle-cpu.txt"
TPU_PINS = REPO / "scripts" / "image_pins" / "kaggle-tpu.txt"


def cpu_image_pins() -> dict[str, str]:
    """name -> version, each pin's line cited from Colab's freeze (or from Kaggle/docker-python's Dockerfile.tmpl,
    which reinstalls a package over it)."""
    pins = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            # Colab's freeze, the image's Dockerfile, or the image's own freeze as a session measured it
            # (scripts/rebuild_image_pins.py)
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)\s+# (CB pip-freeze\.txt|DP Dockerfile\.tmpl|measured "
                             r"kaggle-cpu-freeze\.txt):\d+.*",
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


def test_the_cpu_images_protobuf_is_the_one_docker_python_reinstalls_over_colabs():
    """Dockerfile.tmpl:32 at 78aaa43: `uv pip install --system --force-reinstall ... "protobuf==5.29.5"`, after the
    requirements (:17); Colab's freeze has 5.29.6 (pip-freeze.txt:430)."""
    line = next(x for x in PINS.read_text().splitlines() if x.startswith("protobuf=="))
    assert cpu_image_pins()["protobuf"] == "5.29.5" and "# DP Dockerfile.tmpl:32" in line


def test_the_tpu_images_list_caps_only_what_its_sources_cap():
    """tpu/requirements.in leaves transformers unpinned (:54), and tunix caps safetensors below 0.8: the resolver
    then takes the newest transformers that accepts it (5.0.0 asks safetensors>=0.4.3; 5.23.0 >=0.8.0), not one
    below 5."""
    reqs = {re.split(r"[<>=!]", line.split("#")[0].strip())[0]: line.split("#")[0].strip()
            for line in TPU_PINS.read_text().splitlines() if line.split("#")[0].strip()}
    assert reqs["transformers"] == "transformers" and reqs["safetensors"] == "safetensors<0.8"


def test_the_cpu_images_stand_in_has_exactly_the_pinned_versions(image_pythons):
    pins = cpu_image_pins()
    code = ("import json, sys; from importlib import metadata; "
            "print(json.dumps({n: metadata.version(n) for n in json.loads(sys.argv[1])}))")
    proc = subprocess.run([str(image_pythons["cpu"]), "-c", code, json.dumps(sorted(pins))], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == pins
