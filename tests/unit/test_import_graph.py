"""No two fusionllm modules import each other, directly or around a loop.

Counts every import a module names: at the top, inside a function (a lazy import) and under
``TYPE_CHECKING``, because each of those hides a circle rather than removing it. Packages'
``__init__`` re-exports are left out: they sit above the modules they export by design.
"""

import ast
import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, Path]:
    """Every package setup.cfg installs, with its folder (subpackages sit under their parent)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    roots = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, path = (part.strip() for part in line.partition("="))
        roots[name] = ROOT / path
    dirs = {}
    for package in cfg["options"]["packages"].split():
        root = max((r for r in roots if package == r or package.startswith(r + ".")), key=len)
        dirs[package] = roots[root].joinpath(
            *package[len(root) + 1 :].split(".") if package != root else []
        )
    return dirs


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            if path.name != "__init__.py":
                found[f"{package}.{path.stem}"] = path
    return found


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    package = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name in known and name != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_the_checker_finds_a_circle_and_accepts_a_chain():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_lead_back_to_itself():
    modules = _modules()
    assert len(modules) > 100, "setup.cfg's package_dir no longer finds the sources"
    known = set(modules)
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
