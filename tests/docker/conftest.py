"""The docker tests' session: one engine check, one image build, everything removed after."""

import configparser
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from fusionllm.common.logs import get_logger
from tests.docker.engine import Engine, build_context, engine_problem

logger = get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE_TIMEOUT_S = 900


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


def _wheelhouse(into: Path) -> list[Path]:
    """Wheels of all the image installs (the project's requirements, its build backend, this
    machine's torch), made by this machine's pip from what it already holds (its cache and
    local wheels, where the host's own install found them), so that the build installs
    offline: in the engine, pip resolving and downloading the dependencies again and
    compiling fastecdsa was most of a cold build. Empty where pip cannot make them."""
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requires = [r for r in setup["options"]["install_requires"].splitlines() if r.strip()]
    backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    torch = f"torch=={metadata.version('torch')}"
    command = [sys.executable, "-m", "pip", "wheel", "-q", "-c", str(REPO / "constraints.txt"),
               "-w", str(into), *requires, torch, *backend]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=WHEELHOUSE_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        logger.warning("no wheelhouse (the build downloads): %s", result.stderr.strip()[-2000:])
        return []
    return sorted(into.glob("*.whl"))


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
    wheelhouse = _wheelhouse(tmp_path_factory.mktemp("wheelhouse"))
    context = build_context(REPO, tmp_path_factory.mktemp("context"), ca_bundle=cert,
                            wheels=wheelhouse or wheels, complete=bool(wheelhouse))  # fmt: skip
    # Offline, the image's torch is the one in the wheelhouse: this machine's.
    torch = {"TORCH_SPEC": f"torch=={metadata.version('torch')}"} if wheelhouse else {}
    return engine.build(context, args=torch)
