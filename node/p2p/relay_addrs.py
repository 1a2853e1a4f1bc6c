"""Relayed addresses, ``<relay's peer address>/p2p-circuit/p2p/<peer id>``: text only (no
py-libp2p here, so that ``fusionllm status`` reads them without it)."""

CIRCUIT = "/p2p-circuit/p2p/"


def relayed_addr(relay_addr: str, peer: str) -> str:
    """Where ``peer`` is reached through the relay at ``relay_addr`` (``.../p2p/<relay>``)."""
    if "/p2p/" not in relay_addr or CIRCUIT in relay_addr:
        raise ValueError(f"not a relay's peer address: {relay_addr!r}")
    return f"{relay_addr}{CIRCUIT}{peer}"


def is_relayed(addr: str) -> bool:
    return CIRCUIT in addr


def relay_of(addr: str) -> str:
    """The relay's peer id in a relayed address; "" for a direct one."""
    if not is_relayed(addr):
        return ""
    return addr.split(CIRCUIT)[0].rsplit("/p2p/", 1)[-1]
