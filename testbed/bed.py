"""``Testbed``: hosts in network namespaces behind the emulator, set up and torn down whole.

    with Testbed(load_topology("B")) as bed:
        server = bed.popen("e1", [sys.executable, "-m", "http.server", "--bind", bed.address("e1")])
        bed.run("w1", ["curl", f"http://{bed.address('e1')}:8000/"], timeout=30)

Every kernel object it makes carries its tag, ``fltb-<pid>-<n>``: a namespace per host
(``<tag>-<host>``, a TUN device renamed ``wan0`` inside, address ``<subnet>.<i+1>/24``), a CPU
cgroup per host (``/sys/fs/cgroup/cpu/<tag>/<host>``). A host behind NAT (``nat`` in the
topology) is two namespaces: its router ``<tag>-<host>.nat`` holds the TUN and the public
address, and ``<tag>-<host>``, where its processes run, sits behind it on a veth LAN
(``<lan_prefix>.<i+1>.2/24``; see ``nat`` and ``router``). ``close`` (leaving the ``with``
block, also on an exception, Ctrl-C or SIGTERM) kills every process started in a host (by pid,
then whatever is left in its namespace or cgroup), stops the emulator, deletes the namespaces
and cgroups, and raises TestbedError if any of that failed. ``sweep_stale`` removes what a
testbed whose process died (SIGKILL) left behind.
"""

import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from fusionllm.common.logs import get_logger
from fusionllm.testbed import cgroups, netns, router
from fusionllm.testbed.emulator import EmulatorConfig, HostWire, LinkWire
from fusionllm.testbed.errors import TestbedError
from fusionllm.testbed.nat import home_lan
from fusionllm.testbed.topology import Topology, queue_bytes
from fusionllm.testbed.tun import open_tun

logger = get_logger(__name__)

TAG_PREFIX = "fltb-"
_TAG = re.compile(r"^fltb-(\d+)-(\d+)")
_counter = itertools.count()
_MBPS = 125_000.0  # bytes/s in one Mbit/s
_KILL_WAIT_S = 5.0


def unavailable() -> str | None:
    """None when a testbed can run here; else the reason it cannot (for a test's skip)."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, TUN devices, cgroups)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    return cgroups.available()


@dataclass(frozen=True, kw_only=True)
class TestbedConfig:
    __test__ = False

    subnet: str = "10.250.0"  # hosts get .1, .2, ... inside their own namespaces only
    lan_prefix: str = "192.168"  # the i-th host, if behind NAT, is <prefix>.<i+1>.2 at home
    tcp_mem_max: int = 64 << 20  # tcp_wmem/tcp_rmem maximum per namespace (long fat links)
    realtime: bool = True  # the emulator at SCHED_FIFO where allowed
    seed: int = 0  # the emulator's random loss
    ready_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts):
            raise ValueError(f"subnet {self.subnet!r}: want three octets, e.g. '10.250.0'")
        home_lan(self.lan_prefix, 0)  # ValueError if it cannot be
        if self.tcp_mem_max < 1 << 20:
            raise ValueError(f"tcp_mem_max {self.tcp_mem_max} below 1 MiB")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s {self.ready_timeout_s} must be positive")


def emulator_config(topology: Topology, fds: dict[str, int], config: TestbedConfig):
    """What the emulator needs of ``topology``, given each host's TUN fd. Pure."""
    hosts = tuple(
        HostWire(
            name=h.name,
            fd=fds[h.name],
            addr=f"{config.subnet}.{i + 1}",
            up_rate=h.uplink_mbps * _MBPS if h.uplink_mbps else None,
            up_limit=queue_bytes(h.uplink_mbps, topology.queue_ms),
            down_rate=h.downlink_mbps * _MBPS if h.downlink_mbps else None,
            down_limit=queue_bytes(h.downlink_mbps, topology.queue_ms),
        )
        for i, h in enumerate(topology.hosts)
    )
    links = tuple(
        LinkWire(
            src=src,
            dst=dst,
            rate=spec.rate_mbps * _MBPS if spec.rate_mbps else None,
            limit=queue_bytes(spec.rate_mbps, spec.queue_ms),
            delay_s=spec.delay_ms / 1000,
            loss=spec.loss,
        )
        for (src, dst), spec in sorted(topology.links.items())
    )
    return EmulatorConfig(hosts=hosts, links=links, seed=config.seed, realtime=config.realtime)


class Testbed:
    """The hosts of ``topology``, each in its own namespace behind the emulated links."""

    __test__ = False

    def __init__(self, topology: Topology, config: TestbedConfig | None = None) -> None:
        self.topology = topology
        self.config = config or TestbedConfig()
        self.tag = f"{TAG_PREFIX}{os.getpid()}-{next(_counter)}"
        self.hosts = [h.name for h in topology.hosts]
        self._index = {name: i for i, name in enumerate(self.hosts)}
        self._namespaces: list[str] = []
        self._cgroups: list[Path] = []
        self._processes: list[subprocess.Popen] = []
        self._emulator: subprocess.Popen | None = None
        self.realtime = False

    # ----- naming -----------------------------------------------------------------------------

    def address(self, host: str) -> str:
        """The address ``host``'s processes bind: its LAN address if it sits behind NAT."""
        if self.nat(host):
            return home_lan(self.config.lan_prefix, self._index[host]).node
        return self.wan_address(host)

    def wan_address(self, host: str) -> str:
        """The address others reach ``host`` at: its router's if it sits behind NAT."""
        return f"{self.config.subnet}.{self._index[host] + 1}"

    def nat(self, host: str) -> str | None:
        """The kind of NAT ``host`` sits behind (None: a public host)."""
        return self.topology.host(host).nat

    def netns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def router_netns(self, host: str) -> str:
        """The namespace of ``host``'s home router ('.' is in no host name: no clash)."""
        if not self.nat(host):
            raise TestbedError(f"host {host} is not behind NAT")
        return f"{self.tag}-{host}.nat"

    def cgroup(self, host: str) -> Path:
        return cgroups.CPU_ROOT / self.tag / host

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs inside ``host`` (its namespace and CPU share)."""
        return [
            sys.executable, "-m", "fusionllm.testbed.enter", "--netns", self.netns(host),
            "--cgroup", str(self.cgroup(host)), "--", *argv,
        ]  # fmt: skip

    # ----- up ---------------------------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        self._sigterm = _exit_on_sigterm()
        try:
            self.up()
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        try:
            self.close()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
                self._sigterm = None

    def up(self) -> None:
        reason = unavailable()
        if reason is None and any(h.nat for h in self.topology.hosts):
            reason = router.unavailable()
        if reason:
            raise TestbedError(reason)
        fds: dict[str, int] = {}
        try:
            for i, host in enumerate(self.topology.hosts):
                fds[host.name] = self._host_up(i, host.name, host.cpu)
                if host.nat:
                    lan = home_lan(self.config.lan_prefix, i)
                    router.connect_home(self.router_netns(host.name), self.netns(host.name),
                                        host.nat, lan)  # fmt: skip
            self._start_emulator(emulator_config(self.topology, fds, self.config))
        finally:
            for fd in fds.values():  # the emulator holds its own copies
                os.close(fd)
        logger.info("testbed %s up: %s", self.tag, ", ".join(
            f"{h}={self.address(h)}" for h in self.hosts))  # fmt: skip

    def _host_up(self, i: int, host: str, cores: float | None) -> int:
        """The host's namespace(s), address and cgroup; returns its TUN fd (in its router's
        namespace if it sits behind NAT, which ``up`` then connects)."""
        ns = self._add_netns(self.netns(host))
        wan_ns = self._add_netns(self.router_netns(host)) if self.nat(host) else ns
        if not self._cgroups:
            self._cgroups.append(cgroups.CPU_ROOT / self.tag)
        self._cgroups.append(cgroups.create(f"{self.tag}/{host}", cores))
        device = f"ft{os.getpid():x}{self._counter_hex()}{i:02x}"
        fd = open_tun(device)
        try:
            netns.ip("link", "set", "dev", device, "netns", wan_ns)
            netns.ip("-n", wan_ns, "link", "set", "dev", device, "name", "wan0")
            netns.ip("-n", wan_ns, "addr", "add", f"{self.wan_address(host)}/24", "dev", "wan0")
            netns.ip("-n", wan_ns, "link", "set", "dev", "wan0", "mtu", "1500", "up")
            mem = f"4096 131072 {self.config.tcp_mem_max}"
            for space in {ns, wan_ns}:
                netns.ip("-n", space, "link", "set", "dev", "lo", "up")
                netns.in_netns(
                    space, "sysctl", "-q", "-w", f"net.ipv4.tcp_wmem={mem}",
                    f"net.ipv4.tcp_rmem={mem}", "net.ipv6.conf.all.disable_ipv6=1",
                )  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _add_netns(self, ns: str) -> str:
        netns.ip("netns", "add", ns)
        self._namespaces.append(ns)
        return ns

    def _counter_hex(self) -> str:
        return f"{int(self.tag.rsplit('-', 1)[1]) % 256:02x}"

    def _start_emulator(self, config: EmulatorConfig) -> None:
        fds = [h.fd for h in config.hosts]
        self._emulator = subprocess.Popen(
            [sys.executable, "-m", "fusionllm.testbed.emulator"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=fds,
            start_new_session=True,  # Ctrl-C in a terminal stops the nodes, not their network
        )
        self._emulator.stdin.write(config.to_json().encode() + b"\n")
        self._emulator.stdin.flush()
        ready = self._emulator_says("ready", self.config.ready_timeout_s)
        self.realtime = bool(ready["realtime"])

    def _emulator_says(self, kind: str, timeout: float) -> dict:
        """The emulator's next stdout line, which must be event ``kind``."""
        emulator = self._emulator
        if emulator is None or emulator.stdout is None:
            raise TestbedError("the emulator is not running")
        fd = emulator.stdout.fileno()
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            byte = os.read(fd, 1)  # unbuffered: the next line stays for the next call
            if not byte:
                break
            line += byte
        try:
            event = json.loads(line)
        except ValueError:
            event = {}
        if event.get("event") != kind:
            raise TestbedError(
                f"the emulator did not say {kind!r} in {timeout}s "
                f"(exit code {emulator.poll()}, said {line[:200]!r})"
            )
        return event

    def emulator_stats(self) -> dict:
        """Counters of every FIFO: packets, bytes, dropped (queue full), lost (random)."""
        if self._emulator is None or self._emulator.poll() is not None:
            raise TestbedError("the emulator is not running")
        self._emulator.stdin.write(b"stats\n")
        self._emulator.stdin.flush()
        return self._emulator_says("stats", 10.0)

    @property
    def emulator_pid(self) -> int:
        if self._emulator is None:
            raise TestbedError("the emulator is not running")
        return self._emulator.pid

    # ----- processes --------------------------------------------------------------------------

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; killed (with its tree) by ``close``."""
        process = subprocess.Popen(self.command(host, argv), **kwargs)
        self._processes.append(process)
        return process

    def run(self, host: str, argv: list[str], *, timeout: float) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to its end; its output as text (no exit-code check)."""
        process = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    # ----- down -------------------------------------------------------------------------------

    def close(self) -> None:
        """Tear everything down; TestbedError naming what could not be removed."""
        problems: list[str] = []
        for process in self._processes:
            _kill_tree(process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_KILL_WAIT_S)
        self._processes.clear()
        for ns in self._namespaces:  # what escaped the trees (a node's DHT worker, p2pd)
            netns.kill_all(ns)
        for path in reversed(self._cgroups):
            try:
                cgroups.remove(path)
            except TestbedError as exc:
                problems.append(str(exc))
        self._cgroups.clear()
        self._stop_emulator()
        for ns in reversed(self._namespaces):
            try:
                netns.delete(ns)
            except TestbedError as exc:
                problems.append(str(exc))
        self._namespaces.clear()
        if problems:
            raise TestbedError(f"testbed {self.tag} teardown: " + "; ".join(problems))

    def _stop_emulator(self) -> None:
        emulator, self._emulator = self._emulator, None
        if emulator is None:
            return
        with contextlib.suppress(OSError):
            emulator.stdin.close()
        try:
            emulator.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            emulator.kill()
            emulator.wait(_KILL_WAIT_S)
        with contextlib.suppress(OSError):
            emulator.stdout.close()


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(victims, timeout=_KILL_WAIT_S)


def leftovers(tag_prefix: str = TAG_PREFIX) -> list[str]:
    """Namespaces and cgroups whose names start with ``tag_prefix`` (a test's check)."""
    found = [f"netns {ns}" for ns in netns.names() if ns.startswith(tag_prefix)]
    with contextlib.suppress(OSError):
        found += [
            f"cgroup {p}" for p in cgroups.CPU_ROOT.iterdir() if p.name.startswith(tag_prefix)
        ]
    return found


def sweep_stale() -> list[str]:
    """Remove the namespaces and cgroups of testbeds whose process is gone; what was removed."""
    removed = []
    for ns in netns.names():
        match = _TAG.match(ns)
        if match and not psutil.pid_exists(int(match.group(1))):
            netns.kill_all(ns)
            netns.delete(ns)
            removed.append(f"netns {ns}")
    with contextlib.suppress(OSError):
        for path in list(cgroups.CPU_ROOT.iterdir()):
            match = _TAG.match(path.name)
            if match and not psutil.pid_exists(int(match.group(1))):
                cgroups.remove(path)
                removed.append(f"cgroup {path}")
    return removed


def _exit_on_sigterm():
    """SIGTERM as SystemExit while a testbed is up, so ``with`` tears it down: by default the
    signal ends the process at once and leaves namespaces, cgroups and node processes behind
    (a `pkill` of a benchmark did). Only where nobody handles SIGTERM yet, from the main
    thread (the only one that may set handlers); returns the handler to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)
