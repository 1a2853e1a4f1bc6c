"""Signing identities and a plain CPU device for tests of signed records."""

from fusionllm.dht.records import DeviceInfo
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of


class Identity:
    """A node's key as the record tests use it: its peer id, and signing."""

    def __init__(self, path) -> None:
        self.key_pair = load_or_create_identity(path)
        self.peer_id = peer_id_of(self.key_pair)

    def sign(self, data: bytes) -> bytes:
        return self.key_pair.private_key.sign(data)


def cpu_device() -> DeviceInfo:
    return DeviceInfo(
        name="cpu",
        kind="cpu",
        memory_bytes=8 << 30,
        flops=1e11,
        memory_bandwidth=2e10,
        op_overhead=1e-5,
        cpu_cores=4,
        ram_bytes=8 << 30,
    )
