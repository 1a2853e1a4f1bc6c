"""The docker engine as the docker tests use it: the ``docker`` CLI, one call at a time.

``Engine`` runs ``docker`` commands with deadlines, and remembers every container, network
and image it made so that ``cleanup`` removes them, even after a failure. ``Container``
reads a node's ``--events`` JSON lines back from ``docker logs`` (polled: a ``docker logs -f``
child would outlive the test's process checks).
"""

import json
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

BASE_IMAGE = "fusionllm-base:bookworm"  # docker/ci_engine.sh imports it
BUILD_TIMEOUT_S = 1200  # a cold build here: pip downloads the dependencies, fastecdsa compiles
# What docker/Dockerfile copies; .dockerignore lets the same through from a checkout.
CONTEXT = ("setup.cfg", "pyproject.toml", "constraints.txt", "README.md", "common",
           "compression", "dag", "data", "dht", "node", "testbed", "docker")  # fmt: skip


class DockerError(RuntimeError):
    """A docker command failed or ran past its deadline."""


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"docker {' '.join(args[:3])} ran past {timeout} s") from exc
    if check and result.returncode != 0:
        raise DockerError(f"docker {' '.join(args)}: {result.stderr.strip()[-2000:]}")
    return result


def engine_problem() -> str | None:
    """Why the docker tests cannot run here, or None when they can."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH (as root: docker/ci_engine.sh installs and starts one)"
    try:
        if docker("info", timeout=20, check=False).returncode != 0:
            return "no docker engine answers (as root: docker/ci_engine.sh starts one)"
        if docker("image", "inspect", BASE_IMAGE, timeout=20, check=False).returncode != 0:
            return f"no {BASE_IMAGE} image (as root: docker/ci_engine.sh makes it)"
    except DockerError as exc:
        return str(exc)
    return None


def build_context(
    repo: Path, into: Path, *, ca_bundle: Path | None, wheels: list[Path], complete: bool = False
) -> Path:
    """A build context with what the image needs, and the build-only extras of this machine
    (its CA bundle, the CPU torch wheel) in docker/extras/, never in the checkout.
    ``complete``: ``wheels`` are all the image needs, so the build installs offline."""
    for name in CONTEXT:
        source = repo / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.whl", "ca.pem")
            shutil.copytree(source, into / name, ignore=ignore)
        else:
            shutil.copy2(source, into / name)
    extras = into / "docker" / "extras"
    if ca_bundle is not None:
        shutil.copy2(ca_bundle, extras / "ca.pem")
    for wheel in wheels:
        try:
            (extras / wheel.name).hardlink_to(wheel)  # ~190 MB: no copy where one filesystem
        except OSError:
            shutil.copy2(wheel, extras / wheel.name)
    if complete:
        (extras / "wheels.complete").write_text("docker/Dockerfile: pip installs offline\n")
    return into


def _dangling_images() -> list[str]:
    return docker("images", "-q", "--no-trunc", "--filter", "dangling=true").stdout.split()


@dataclass
class Container:
    name: str
    engine: "Engine"
    started: float = field(default_factory=time.time)

    def logs(self) -> tuple[str, str]:
        result = self.engine.run_docker("logs", self.name, timeout=30)
        return result.stdout, result.stderr

    def events(self) -> list[dict]:
        found = []
        for line in self.logs()[0].splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    logger.debug("not an event line: %r", line[:200])
        return found

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events()) if e["event"] == kind), None)

    def state(self) -> dict:
        out = self.engine.run_docker("inspect", "-f", "{{json .State}}", self.name).stdout
        return json.loads(out)


@dataclass
class Engine:
    """Docker objects made by one test session, all removed by ``cleanup``."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)

    def run_docker(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return docker(*args, timeout=timeout)

    def build(self, context: Path, *, base: str = BASE_IMAGE, args: dict | None = None) -> str:
        """Build the image (``args``: more build arguments); the build stage's image
        (untagged) is removed with it later."""
        image = f"fusionllm-test:{self.tag}"
        self.images.append(image)
        before = set(_dangling_images())
        started = time.monotonic()
        values = {"BASE_IMAGE": base, **(args or {})}
        build_args = [f"--build-arg={k}={v}" for k, v in values.items()]
        try:  # --force-rm: a failed step's container goes too
            docker("build", "-q", "--force-rm", "-f", str(context / "docker" / "Dockerfile"),
                   "-t", image, *build_args, str(context), timeout=BUILD_TIMEOUT_S)  # fmt: skip
        finally:  # a failed build leaves its last step's image, and its parents under it
            self.images += [i for i in _dangling_images() if i not in before]
        logger.info("built %s in %.0f s", image, time.monotonic() - started)
        return image

    def network(self, name: str) -> tuple[str, str]:
        """A user-defined bridge network: (its name, its gateway address, i.e. this host's)."""
        full = f"fusionllm-test-{name}-{self.tag}"
        docker("network", "create", full)
        self.networks.append(full)
        out = docker("network", "inspect", "-f", "{{json .IPAM.Config}}", full).stdout
        return full, json.loads(out)[0]["Gateway"]

    def volume(self, name: str) -> str:
        full = f"fusionllm-test-{name}-{self.tag}"
        docker("volume", "create", full)
        self.volumes.append(full)
        return full

    def start(self, image: str, name: str, args: list[str], *, docker_args=()) -> Container:
        full = f"fusionllm-test-{name}-{self.tag}"
        self.containers.append(full)
        docker("run", "-d", "--name", full, *docker_args, image, *args)
        return Container(full, self)

    def cleanup(self) -> None:
        """Remove everything this session made; go on past what fails, then say what did."""
        failures, started = [], time.monotonic()
        removals = [(("rm", "-f", "-v"), self.containers), (("network", "rm"), self.networks),
                    (("volume", "rm"), self.volumes), (("rmi", "-f"), self.images)]  # fmt: skip
        for command, names in removals:
            for name in names:
                args = (*command, name)
                result = docker(*args, timeout=300, check=False)
                if result.returncode != 0 and "No such" not in result.stderr:
                    failures.append(f"docker {' '.join(args)}: {result.stderr.strip()}")
            names.clear()
        logger.info("removed the session's docker objects in %.0f s", time.monotonic() - started)
        if failures:
            raise DockerError("; ".join(failures))
