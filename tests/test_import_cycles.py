"""No import circle among the project's own modules (shared/, scripts/, kernels/): each file can be imported, read
and tested alone, with the layers below it only. Imports inside functions count too: a lazy import hides a circle
from Python, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "scripts", "kernels")


def module_names(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """`scripts.chain.config` -> its file; a package's `__init__.py` is the package's own name."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _absolute(node: ast.ImportFrom, name: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports. Importing `a.b.c` runs the packages `a` and `a.b` first, so those count
    too, except the importer's own packages: they were run before it, not because of it. A name taken from a
    package (`from scripts.chain import Chain`) needs that package's `__init__` finished, so it always counts."""
    explicit = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            explicit.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, name, path)
            submodules = {f"{module}.{alias.name}" for alias in node.names} & known.keys()
            explicit.update(submodules if len(submodules) == len(node.names) else {module, *submodules})
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    found = explicit & known.keys()
    for target in explicit:
        parts = target.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known and p not in own)
    return found - {name}


def import_cycles(root: Path, packages=PACKAGES) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (Tarjan's algorithm)."""
    known = module_names(root, packages)
    graph = {name: sorted(imports_of(name, path, known)) for name, path in known.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                on_stack.discard(member)
                component.append(member)
            on_stack.discard(node)
            if component:
                cycles.append(sorted([node, *component]))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_module_of_shared_scripts_or_kernels_is_in_an_import_circle():
    assert import_cycles(REPO) == []


def test_a_config_that_imports_a_stage_makes_a_circle_the_test_names(tmp_path):
    chain = tmp_path / "scripts" / "chain"
    chain.mkdir(parents=True)
    (tmp_path / "scripts" / "__init__.py").write_text("")
    (chain / "__init__.py").write_text('"""no imports"""\n')
    (chain / "limits.py").write_text("X = 1\n")
    (chain / "config.py").write_text("from scripts.chain.limits import X\n"
                                     "def check():\n    from scripts.chain.smoke import DEFAULTS\n")
    (chain / "context.py").write_text("from .config import check\n")
    (chain / "smoke.py").write_text("from scripts.chain import context\n")
    assert import_cycles(tmp_path, ("scripts",)) == [
        ["scripts.chain.config", "scripts.chain.context", "scripts.chain.smoke"]]
    (chain / "config.py").write_text("from scripts.chain.limits import X\n")
    assert import_cycles(tmp_path, ("scripts",)) == []


def test_a_module_that_takes_a_name_from_its_package_init_closes_a_circle_through_it(tmp_path):
    """An __init__ that re-exports the chain from its modules, and a module that reads a name from that __init__:
    the module needs the __init__ finished, which needs the module."""
    chain = tmp_path / "scripts" / "chain"
    chain.mkdir(parents=True)
    (tmp_path / "scripts" / "__init__.py").write_text("")
    (chain / "__init__.py").write_text("from scripts.chain.chain import Chain\n")
    (chain / "config.py").write_text("LIMIT = 1\n")
    (chain / "chain.py").write_text("from scripts.chain.stage import Stage\nclass Chain: ...\n")
    (chain / "stage.py").write_text("from scripts.chain.config import LIMIT\nclass Stage: ...\n")
    assert import_cycles(tmp_path, ("scripts",)) == []  # its own package ran before it: no circle
    (chain / "stage.py").write_text("from scripts.chain import LIMIT\nclass Stage: ...\n")
    (chain / "__init__.py").write_text("from scripts.chain.chain import Chain\n"
                                       "from scripts.chain.config import LIMIT\n")
    assert import_cycles(tmp_path, ("scripts",)) == [["scripts.chain", "scripts.chain.chain", "scripts.chain.stage"]]
