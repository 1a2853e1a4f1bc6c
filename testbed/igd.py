"""A home router that maps ports on request: Debian's ``miniupnpd`` (UPnP-IGD and NAT-PMP,
nftables backend, package ``miniupnpd-nftables``) in the router's namespace.

miniupnpd answers SSDP and SOAP on the router's LAN side and writes its mappings (DNAT plus a
forward accept) as rules in chains it is given; the tables and hooks are ours (``ruleset``),
as Debian's ``nft_init.sh`` would make them. The home router's own forward chain drops what
it did not see leave (nat.py), so a mapped connection is let through there by its DNAT status.

miniupnpd refuses to map on a router whose WAN address is private ("Reserved / private IP
address ... Port forwarding is impossible"), as a real one behind a carrier NAT would: a
testbed with an IGD needs a globally routed ``TestbedConfig.subnet`` (harmless: the
namespaces' only way out is the emulator). Needs root; ``unavailable`` says why not.
"""

import contextlib
import shutil
import subprocess
import time
from pathlib import Path

from fusionllm.testbed import netns
from fusionllm.testbed.errors import TestbedError
from fusionllm.testbed.nat import HOME_TABLE, LAN_DEVICE, WAN_DEVICE, HomeLan

TABLE = "fltb_upnp"
HTTP_PORT = 5000  # miniupnpd's SOAP port on the LAN side (-p)
_BINARY = "miniupnpd"
_STOP_WAIT_S = 5.0


def _binary() -> str | None:
    """miniupnpd's path: on PATH, or in /usr/sbin (not on a plain user's PATH)."""
    found = shutil.which(_BINARY)
    if found is None and Path("/usr/sbin", _BINARY).exists():
        found = f"/usr/sbin/{_BINARY}"
    return found


def unavailable() -> str | None:
    """None when a router can run an IGD here; else why not."""
    if _binary() is None:
        return "miniupnpd is not installed (apt-get install miniupnpd-nftables)"
    return None


def ruleset() -> str:
    """The tables and hooked chains miniupnpd writes its rules into (``nft -f`` input)."""
    return f"""\
table inet {TABLE} {{
    chain forward {{
        type filter hook forward priority filter; policy accept;
        jump miniupnpd
    }}
    chain miniupnpd {{
    }}
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        jump prerouting_miniupnpd
    }}
    chain prerouting_miniupnpd {{
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        jump postrouting_miniupnpd
    }}
    chain postrouting_miniupnpd {{
    }}
}}
add rule ip {HOME_TABLE} forward ct status dnat accept
"""


def config(lan: HomeLan, *, lease_file: Path, min_lifetime_s: int = 120) -> str:
    """miniupnpd.conf for a router with ``lan``: UPnP and NAT-PMP on the LAN side, mappings
    to the asking host only (secure mode), tables as ``ruleset`` makes them."""
    return f"""\
ext_ifname={WAN_DEVICE}
listening_ip={LAN_DEVICE}
port={HTTP_PORT}
enable_natpmp=yes
enable_upnp=yes
secure_mode=yes
min_lifetime={min_lifetime_s}
max_lifetime=86400
lease_file={lease_file}
uuid=3d3cec3a-8cf0-11e0-98ee-001a6bd2d07b
upnp_table_name={TABLE}
upnp_nat_table_name={TABLE}
upnp_forward_chain=miniupnpd
upnp_nat_chain=prerouting_miniupnpd
upnp_nat_postrouting_chain=postrouting_miniupnpd
allow 1024-65535 {lan.network}/{lan.prefix_len} 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


class RouterIgd:
    """miniupnpd running on ``router_ns`` (a home router of ``lan``) until ``close``."""

    def __init__(self, router_ns: str, lan: HomeLan, workdir: Path) -> None:
        reason = unavailable()
        if reason:
            raise TestbedError(reason)
        self._ns, self._lan = router_ns, lan
        self._conf = Path(workdir) / "miniupnpd.conf"
        self._conf.write_text(config(lan, lease_file=Path(workdir) / "miniupnpd.leases"))
        self._log = Path(workdir) / "miniupnpd.log"
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "RouterIgd":
        netns.in_netns(self._ns, "nft", "-f", "-", stdin=ruleset())
        argv = [_binary() or f"/usr/sbin/{_BINARY}", "-d", "-f", str(self._conf)]
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                ["ip", "netns", "exec", self._ns, *argv],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self._wait_listening(timeout_s)
        return self

    def mappings(self) -> str:
        """The DNAT rules miniupnpd holds now (``nft list chain``), as text."""
        return netns.in_netns(self._ns, "nft", "list", "chain", "inet", TABLE,
                              "prerouting_miniupnpd")  # fmt: skip

    @property
    def log(self) -> str:
        return self._log.read_text(errors="replace")

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_WAIT_S)

    def __enter__(self) -> "RouterIgd":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wait_listening(self, timeout_s: float) -> None:
        """Until miniupnpd's SOAP port answers on the LAN address (from the router's side)."""
        deadline = time.monotonic() + timeout_s
        probe = (
            "import socket,sys;socket.create_connection((sys.argv[1],int(sys.argv[2])),1).close()"
        )
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise TestbedError(f"miniupnpd exited: {self.log[-2000:]}")
            with contextlib.suppress(TestbedError):
                netns.in_netns(self._ns, "python3", "-c", probe, self._lan.router, str(HTTP_PORT))
                return
            time.sleep(0.2)
        raise TestbedError(f"miniupnpd did not listen within {timeout_s} s: {self.log[-2000:]}")
