"""The docker tests' session: one engine check, one image build, everything removed after.

The image is built here, or ahead of the session in the background (tests/docker/prepare.py,
as .ci/run does): with ``CI_FUSIONLLM_DOCKER_READY`` naming the file that build writes last, the
session waits for it and takes its image, or skips with the reason it failed. The docker tests
run after all the others (``pytest_collection_modifyitems``) so that the build overlaps them.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docker.engine import Engine, engine_problem
from tests.docker.prepare import READY_ENV, build_image, wait_ready

# A bound for a background build that died without writing its file; .ci/run's own bound on
# that build is shorter, so with it the wait ends first.
READY_WAIT_S = 1500


def pytest_collection_modifyitems(config, items) -> None:
    """Docker tests last (a session-wide hook: it sees every collected test). A stable sort:
    everything else keeps its order, module-scoped fixtures their grouping."""
    items.sort(key=lambda item: item.get_closest_marker("docker") is not None)


@pytest.fixture(scope="session")
def prepared() -> dict | None:
    """What the background build wrote (its image), or None where there is none."""
    path = os.environ.get(READY_ENV)
    if not path:
        return None
    ready = wait_ready(Path(path), READY_WAIT_S)
    if "error" in ready:
        pytest.skip(f"docker tests: the background setup failed: {ready['error']} "
                    f"(its log: test-artifacts/docker-setup.log)")  # fmt: skip
    return ready


@pytest.fixture(scope="session")
def engine(prepared) -> Iterator[Engine]:
    problem = engine_problem()
    if problem:
        pytest.skip(f"docker tests need a docker engine: {problem}")
    made = Engine()
    if prepared:  # its image and build stage go with the session's own objects
        made.images += prepared["made"]
    yield made
    made.cleanup()


@pytest.fixture(scope="session")
def image(engine: Engine, prepared, tmp_path_factory) -> str:
    """The image, built once for the session from docker/Dockerfile on the local base."""
    if prepared:
        return prepared["image"]
    return build_image(engine, tmp_path_factory.mktemp("image"))
