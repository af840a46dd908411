"""The package's import graph: shared/ reads as the pipeline, so no stage imports a later one."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1] / "shared"
# pipeline order, each importing only those before it; shared/kaggle is the session's platform, beside them
STAGES = ("tokenize", "model", "runtime", "train", "eval")


def shared_imports(path: Path) -> set[str]:
    """Every `shared.X...` module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "shared":  # from shared import hellaswag
                found.update(f"shared.{a.name}" for a in node.names)
            elif node.module.startswith("shared."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("shared."))
    return found


def stage_of(module: str) -> int | None:
    """The pipeline position of `shared.<stage>...`; None for the common modules and shared.kaggle."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def backward_imports(root: Path) -> list[str]:
    arrows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        here = stage_of(".".join(rel.parts))
        # A common module (shared/*.py) sits before every stage but the first: it may use tokenize's tokenizer.
        limit = here if here is not None else (0 if path.parent == root else None)
        for module in shared_imports(path):
            there = stage_of(module)
            if limit is not None and there is not None and there > limit:
                arrows.append(f"{rel} -> {module}")
    return arrows


def test_no_stage_imports_a_later_one():
    assert backward_imports(SHARED) == []


def platform_imports(root: Path) -> list[str]:
    """Arrows against the layers around the stages: shared/kaggle (the session's platform: paths, secrets,
    packages, publishing) imports no stage, and the common modules (shared/*.py) import nothing of shared/kaggle,
    so stages may use the platform and the platform only the common modules."""
    arrows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        in_kaggle, common = rel.parts[1] == "kaggle", path.parent == root
        for module in shared_imports(path):
            if (in_kaggle and stage_of(module) is not None) or (common and module.startswith("shared.kaggle")):
                arrows.append(f"{rel} -> {module}")
    return arrows


def test_the_kaggle_platform_imports_no_stage_and_the_common_modules_no_platform(tmp_path):
    assert platform_imports(SHARED) == []
    root = tmp_path / "shared"
    (root / "kaggle").mkdir(parents=True)
    (root / "kaggle" / "publish.py").write_text("def f():\n    from shared.train.checkpoint import save\n")
    (root / "kaggle" / "env.py").write_text("from shared.tpu import tpu_devices_present\n")
    (root / "tpu.py").write_text("import shared.kaggle.env\n")
    assert platform_imports(root) == ["shared/kaggle/publish -> shared.train.checkpoint",
                                      "shared/tpu -> shared.kaggle.env"]


def test_a_backward_import_is_reported_even_inside_a_function(tmp_path):
    root = tmp_path / "shared"
    (root / "train").mkdir(parents=True)
    (root / "tokenize").mkdir()
    (root / "train" / "loop.py").write_text("def f():\n    from shared.eval.report import write\n")
    (root / "tokenize" / "part.py").write_text("import shared.model.model\nfrom shared.config import X\n")
    (root / "common.py").write_text("from shared.tokenize.tokenizer import gpt2_encoding\nfrom shared import eval\n")
    (root / "train" / "ok.py").write_text("from shared.tokenize import manifest\nfrom shared.kaggle.env import x\n")
    assert sorted(backward_imports(root)) == ["shared/common -> shared.eval",
                                              "shared/tokenize/part -> shared.model.model",
                                              "shared/train/loop -> shared.eval.report"]


def test_the_kernel_configs_and_the_chain_config_load_with_the_standard_library_only():
    """shared/config.py is the one light home of the three kernel configs: the chain (on the laptop) and every
    kernel load it before torch, numpy or safetensors, which --plan never needs."""
    import subprocess
    import sys

    code = ("import sys; import shared.config, scripts.chain.config; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'safetensors', 'kaggle'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=SHARED.parent, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_no_module_of_shared_scripts_or_kernels_is_over_500_lines():
    """DEVELOPERS.md: no module over 500 lines. A longer one is split along a seam of its own."""
    long = {str(p.relative_to(SHARED.parent)): n for folder in ("shared", "scripts", "kernels")
            for p in sorted((SHARED.parent / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_training_loop_reads_in_at_most_100_lines():
    """train() reads top to bottom on one screen: set up, resume, the loop, end; the rest is calls with names."""
    tree = ast.parse((SHARED / "train" / "trainer.py").read_text())
    train = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 100


def layout_table_paths() -> list[str]:
    """The paths docs/layout.md's table names: each row's first cell, one or more `path`s (a folder ends in /,
    `bench_*.py` is a pattern)."""
    paths = []
    for line in (SHARED.parent / "docs" / "layout.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            paths += re.findall(r"`([^`]+)`", cells[1])
    return paths


def test_the_layout_table_names_every_module_and_only_files_that_exist():
    root = SHARED.parent
    named = layout_table_paths()
    assert [p for p in named if not list(root.glob(p.rstrip("/")))] == []  # nothing named that is gone
    modules = [p.relative_to(root).as_posix() for folder in ("shared", "scripts", "kernels")
               for p in sorted((root / folder).rglob("*.py")) if p.name != "__init__.py"]
    unnamed = [m for m in modules if not any(fnmatch.fnmatch(m, p) for p in named)]
    assert unnamed == []


def test_the_readme_is_a_quick_start_with_the_demo_and_test_commands_and_every_page_it_points_to_exists():
    root = SHARED.parent
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    commands = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert "bash scripts/setup.sh && .venv/bin/python scripts/chain_sessions.py --local-demo\n" in commands
    assert "bash scripts/setup.sh --kaggle-image && .venv/bin/ruff check . && .venv/bin/python -m pytest -q -n 2\n" \
        in commands
    pages = set(re.findall(r"\bdocs/[\w./-]+\.md", readme))
    assert {"docs/usage.md", "docs/layout.md"} <= pages
    assert [p for p in sorted(pages) if not (root / p).exists()] == []
