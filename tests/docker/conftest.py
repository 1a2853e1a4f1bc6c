"""The docker tests' session: one engine check, one image build, everything removed after."""

import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.docker.engine import Engine, build_context, engine_problem

REPO = Path(__file__).resolve().parents[2]


def _pip_setting(name: str) -> list[str]:
    """A pip setting as this machine's pip sees it (environment and config files)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    values = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(f".{name}"):
            values += value.strip().strip("'\"").split()
    return values


def _build_extras() -> tuple[Path | None, list[Path]]:
    """The CA bundle pip trusts here and the torch wheel installed here, if pip takes them
    from local files: a build inside the engine needs both to reach the same packages."""
    cert = next((Path(p) for p in _pip_setting("cert") if Path(p).is_file()), None)
    version = metadata.version("torch")
    wheels = [w for d in _pip_setting("find-links") for w in Path(d).glob(f"torch-{version}-*.whl")]
    return cert, wheels[:1]


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    problem = engine_problem()
    if problem:
        pytest.skip(f"docker tests need a docker engine: {problem}")
    made = Engine()
    yield made
    made.cleanup()


@pytest.fixture(scope="session")
def image(engine: Engine, tmp_path_factory) -> str:
    """The image, built once for the session from docker/Dockerfile on the local base."""
    cert, wheels = _build_extras()
    context = build_context(REPO, tmp_path_factory.mktemp("context"), ca_bundle=cert, wheels=wheels)
    return engine.build(context)
