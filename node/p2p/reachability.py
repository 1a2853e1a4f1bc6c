"""A node's reachability verdict from its members' dial-back answers (dialback.py). Pure.

- ``announced``: ``--announce-addr`` says where peers reach the node (a port forward the
  user made): nothing is checked, the announced addresses are what peers dial;
- ``public``: members reached it at an address it listens on;
- ``mapped``: members reached it at another address (its router's, where a forward or a
  UPnP/NAT-PMP mapping leads to it): that is the address to announce;
- ``private``: members could not reach it: peers can only meet it through a relay;
- ``unknown``: too few members answered yet, or they disagree.

One member's word never decides: an address counts as reachable once ``confirmations``
distinct members reached it, and ``private`` needs as many members that reached nothing.
Where fewer members could be asked, ``Settler`` demotes a node only on repeated checks.
"""

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionllm.dht.records import REACH_VERDICTS as VERDICTS
from fusionllm.node.p2p.dialback import DialBackAnswer

# Verdicts of nodes others can dial: members worth asking for a dial-back, or to relay.
REACHABLE = ("public", "mapped", "announced")


@dataclass(frozen=True, kw_only=True)
class Reachability:
    verdict: str
    addrs: tuple[str, ...] = ()  # "IP:PORT" peers reach it at (public, mapped, announced)
    observed_ips: tuple[str, ...] = ()  # what answering members saw it come from
    answers: int = 0  # members that tried (a refusal is no answer)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} not one of {VERDICTS}")


def announced(addrs: Iterable[str]) -> Reachability:
    """The verdict of a node given ``--announce-addr``: no dial-back asked."""
    return Reachability(verdict="announced", addrs=tuple(addrs))


def judge(
    answers: Iterable[DialBackAnswer], *, listen_ips: Sequence[str], confirmations: int = 2
) -> Reachability:
    """The verdict from ``answers`` (the last one of each member counts). A node listening
    on every interface (0.0.0.0) takes any address it was reached at as its own."""
    if confirmations < 1:
        raise ValueError(f"confirmations {confirmations} must be >= 1")
    latest = {a.peer: a for a in answers if not a.refused}
    reached_by: dict[str, set[str]] = {}  # "IP:PORT" -> members that reached it
    blind = 0  # members that reached nothing
    for answer in latest.values():
        hits = [port for port, ok in sorted(answer.reached.items()) if ok]
        blind += not hits
        for port in hits:
            reached_by.setdefault(f"{answer.observed_ip}:{port}", set()).add(answer.peer)
    observed = tuple(sorted({a.observed_ip for a in latest.values()}))
    confirmed = tuple(sorted(a for a, peers in reached_by.items() if len(peers) >= confirmations))
    if confirmed:
        anywhere = any(ipaddress.ip_address(ip).is_unspecified for ip in listen_ips)
        own = anywhere or all(addr.rsplit(":", 1)[0] in listen_ips for addr in confirmed)
        verdict = "public" if own else "mapped"
    elif blind >= confirmations and not reached_by:
        verdict = "private"
    else:
        verdict = "unknown"
    return Reachability(
        verdict=verdict, addrs=confirmed, observed_ips=observed, answers=len(latest)
    )


# Verdicts that make a node a DHT client and send it to relays (relay_use.py).
_DEMOTING = ("private", "mapped")


class Settler:
    """Whether a fresh verdict replaces the current one. Where fewer members than
    ``confirmations`` could be asked, one member's answer decided it: thin evidence (one
    dial-back lost to a loaded member makes a public node "private"). A thin verdict that
    demotes the node replaces the current one only after ``repeats`` checks in a row gave it.
    Pure: the caller keeps it across checks."""

    def __init__(self, *, confirmations: int, repeats: int) -> None:
        if confirmations < 1 or repeats < 1:
            raise ValueError(f"confirmations {confirmations} and repeats {repeats} must be >= 1")
        self._confirmations, self._repeats = confirmations, repeats
        self._thin: tuple[str, int] = ("", 0)  # a thin demoting verdict, checks in a row

    @property
    def pending(self) -> bool:
        """A thin verdict waits for its next check."""
        return self._thin[1] > 0

    def settle(self, current: Reachability, fresh: Reachability) -> Reachability:
        thin = fresh.answers < self._confirmations
        if fresh.verdict not in _DEMOTING or fresh.verdict == current.verdict or not thin:
            self._thin = ("", 0)
            return fresh
        verdict, times = self._thin
        times = times + 1 if verdict == fresh.verdict else 1
        if times >= self._repeats:
            self._thin = ("", 0)
            return fresh
        self._thin = (fresh.verdict, times)
        return current


def punch_ip(reach: Reachability) -> str | None:
    """Where a private node punches from (lane/punch.py): the one IP its members saw it at.
    None while it is not private (nothing to punch: peers dial it), or was seen at several
    IPs (it cannot tell which one a peer will see)."""
    if reach.verdict != "private" or len(reach.observed_ips) != 1:
        return None
    return reach.observed_ips[0]


def explain(
    verdict: str, addrs: Sequence[str] = (), observed: Sequence[str] = (), upnp: bool = False
) -> str:
    """What a verdict means to the person running the node, and what they may do; ``upnp``:
    the router forwards because this node asked it to (port_mapper.py)."""
    at = ", ".join(addrs) or "?"
    if verdict in ("public", "announced"):
        return f"reachability {verdict}: peers can dial this node at {at}"
    if verdict == "mapped":
        how = "asked over UPnP; renewed, removed when the node stops" if upnp else "a forward"
        return (
            f"reachability mapped: peers reach this node at {at}, where its router forwards ({how})"
        )
    if verdict == "private":
        seen = ", ".join(observed) or "?"
        return (
            f"reachability private: members see this node at {seen} but cannot dial it back "
            "(a NAT or a firewall); it is reached only over connections it opens. To be "
            "reachable, forward its ports on the router and give --announce-addr"
        )
    return "reachability unknown: no member has dialled this node back yet"
