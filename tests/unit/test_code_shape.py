"""The house limits on size (DESIGN.md, Style): no source module over 500 lines, no function
over 60. Tests are left out: a scenario test reads best as one story, and its fixtures are
data. A module near the limit is split by concern, not squeezed under it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
SKIPPED = {".git", "tests", "build", "dist", ".whl", "test-artifacts"}


def _sources() -> list[Path]:
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if not SKIPPED.intersection(path.relative_to(ROOT).parts)
        and not any(part.startswith(".") or "venv" in part for part in path.parts)
    ]


def _too_long(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text()
    name = path.relative_to(root)
    found = []
    if (lines := text.count("\n")) > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_the_check_sees_a_long_function_and_a_long_module(tmp_path):
    fits = tmp_path / "fits.py"
    fits.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    assert _too_long(fits, tmp_path) == []
    long = tmp_path / "long.py"
    long.write_text("async def g():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert _too_long(long, tmp_path) == [f"long.py:1 g: {MAX_FUNCTION_LINES + 1} lines"]
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _too_long(big, tmp_path) == [f"big.py: {MAX_MODULE_LINES + 1} lines"]


def test_no_module_or_function_is_over_the_limits():
    sources = _sources()
    assert len(sources) > 150, "the walk no longer finds the sources"
    found = [problem for path in sources for problem in _too_long(path)]
    assert not found, "\n".join(found)
