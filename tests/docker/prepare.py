"""The docker tests' image: built in the session (``build_image``), or ahead of it.

``python -m tests.docker.prepare --ready FILE`` builds the image the docker tests run, as their
session would, and writes FILE (JSON) last: ``{"image": TAG, "made": [...]}`` or
``{"error": REASON}``. CI (.ci/run) runs it in the background while lint and the other tests
run; with ``CI_FUSIONLLM_DOCKER_READY=FILE`` the session waits for FILE and takes that image (and
removes it after) instead of building one, or skips with the reason the build failed.
"""

import argparse
import configparser
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from importlib import metadata
from pathlib import Path

from fusionllm.common.logs import configure_logging, get_logger
from tests.docker.engine import Engine, build_context, engine_problem

logger = get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE_TIMEOUT_S = 900
READY_ENV = "CI_FUSIONLLM_DOCKER_READY"
WHEELS_DONE = "wheelhouse.complete"  # beside the wheels: pip made every one the image needs


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


def make_wheelhouse(into: Path) -> list[Path]:
    """``_wheelhouse`` into ``into``, marked complete (``WHEELS_DONE``) when pip made it all."""
    started = time.monotonic()
    into.mkdir(parents=True, exist_ok=True)
    wheels = _wheelhouse(into)
    if wheels:
        (into / WHEELS_DONE).write_text(f"{len(wheels)} wheels\n")
    logger.info("wheelhouse: %d wheels in %.0f s", len(wheels), time.monotonic() - started)
    return wheels


def build_image(engine: Engine, workdir: Path, wheels: Path | None = None) -> str:
    """The image from docker/Dockerfile on the local base, with this machine's wheels
    (``wheels``: a wheelhouse made ahead by ``make_wheelhouse``, if it is complete)."""
    cert, torch_wheels = _build_extras()
    if wheels is not None and (wheels / WHEELS_DONE).is_file():
        wheelhouse = sorted(wheels.glob("*.whl"))
        logger.info("wheelhouse: %d wheels made ahead in %s", len(wheelhouse), wheels)
    else:
        wheelhouse = make_wheelhouse(workdir / "wheelhouse")
    (workdir / "context").mkdir()
    wheels_in = wheelhouse or torch_wheels
    context = build_context(REPO, workdir / "context", ca_bundle=cert, wheels=wheels_in,
                            complete=bool(wheelhouse))  # fmt: skip
    # Offline, the image's torch is the one in the wheelhouse: this machine's.
    torch = {"TORCH_SPEC": f"torch=={metadata.version('torch')}"} if wheelhouse else {}
    return engine.build(context, args=torch)


def wait_ready(path: Path, timeout_s: float, *, poll_s: float = 2.0) -> dict:
    """What the background build wrote to ``path``, once it has; an error after
    ``timeout_s`` without it."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return {"error": f"the background build wrote no {path} in {timeout_s:.0f} s"}
        time.sleep(poll_s)
    try:
        ready = json.loads(path.read_text())
    except ValueError as exc:
        return {"error": f"{path} is not JSON: {exc}"}
    if not isinstance(ready, dict):
        return {"error": f"{path} holds no JSON object: {ready!r:.200}"}
    if isinstance(ready.get("error"), str):
        return ready
    made = ready.get("made")
    if not isinstance(ready.get("image"), str) or not isinstance(made, list):
        return {"error": f"{path} names neither an image nor an error: {ready!r:.200}"}
    return ready


def _write_ready(path: Path, ready: dict) -> None:
    """Atomically: a reader never sees half of it."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(ready) + "\n")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.docker.prepare",
        description="Build the docker tests' image ahead of their session (CI: .ci/run).",
    )
    ready_help = f"JSON written last: the image, or why none (the tests' {READY_ENV})"
    parser.add_argument("--ready", type=Path, help=ready_help)
    work_help = "where the wheelhouse and the build context are made (removed after)"
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help=work_help)
    wheels_help = ("a wheelhouse made ahead (--wheels-only), taken if complete; with "
                   "--wheels-only, where to make it")  # fmt: skip
    parser.add_argument("--wheels", type=Path, help=wheels_help)
    only_help = "only make the wheelhouse in --wheels (no engine needed: it overlaps the engine's)"
    parser.add_argument("--wheels-only", action="store_true", help=only_help)
    args = parser.parse_args(argv)
    configure_logging()
    if args.wheels_only:
        if args.wheels is None:
            parser.error("--wheels-only needs --wheels DIR")
        return 0 if make_wheelhouse(args.wheels) else 1
    if args.ready is None:
        parser.error("--ready FILE is needed to build")
    started = time.monotonic()
    problem = engine_problem()
    if problem:
        _write_ready(args.ready, {"error": f"no docker engine: {problem}"})
        return 1
    engine = Engine(tag=f"ci-{uuid.uuid4().hex[:8]}")
    workdir = args.workdir / f"fusionllm-docker-{engine.tag}"
    try:
        workdir.mkdir(parents=True)
        image = build_image(engine, workdir, args.wheels)
    except Exception as exc:  # any failure is the tests' skip reason, in full in the log
        logger.exception("the image build failed")
        engine.cleanup()
        # the tests' skip reason: the end of it, where the build says what failed
        _write_ready(args.ready, {"error": f"the image build failed: ...{str(exc)[-600:]}"})
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = round(time.monotonic() - started)
    _write_ready(args.ready, {"image": image, "made": engine.images, "seconds": seconds})
    logger.info("built %s in %d s in all", image, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
