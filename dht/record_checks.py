"""Field checks for the strict wire schemas of records (records.py): each raises ``RecordError``
(a ``PeerError``) naming the field, so a reader can log and skip a peer's entry, never crash."""

import math
from collections.abc import Mapping
from typing import Any

from fusionllm.common.errors import PeerError, peer_repr


class RecordError(PeerError):
    """A record from the DHT or gossip is malformed, unsigned, misattributed or unsupported."""


def fields(
    wire: Any, required: set[str], what: str, optional: frozenset[str] = frozenset()
) -> Mapping[str, Any]:
    if not isinstance(wire, Mapping):
        raise RecordError(f"{what} must be a map, got {type(wire).__name__}")
    keys = set(wire)
    if not required <= keys <= required | optional:
        required = required | (keys & optional)
        missing, extra = sorted(required - keys, key=str), sorted(keys - required, key=str)
        raise RecordError(f"{what}: missing fields {missing}, unexpected fields {extra}")
    return wire


def text(value: Any, what: str, max_chars: int, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > max_chars or (not value and not empty):
        raise RecordError(f"{what} must have 1..{max_chars} characters, got {len(value)}")
    if not value.isprintable():
        raise RecordError(f"{what} has non-printable characters")
    return value


def integer(value: Any, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RecordError(f"{what} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise RecordError(f"{what} must be in [{low}, {high}], got {value}")
    return value


def number(value: Any, what: str, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(f"{what} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float range
        raise RecordError(f"{what} is out of range") from None
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise RecordError(f"{what} must be a finite number in {'(' if low_open else '['}"
                          f"{low}, {high}], got {value}")  # fmt: skip
    return value


def exactly(value: Any, what: str, n: int) -> list:
    found = items(value, what, n)
    if len(found) != n:
        raise RecordError(f"{what} must have {n} fields, got {len(found)}")
    return found


def items(value: Any, what: str, max_items: int) -> list:
    if not isinstance(value, list | tuple):
        raise RecordError(f"{what} must be a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise RecordError(f"{what} has {len(value)} items, at most {max_items} allowed")
    return list(value)


def digest(value: Any) -> str:
    hexed = text(value, "digest", 64)
    if len(hexed) != 64 or any(c not in "0123456789abcdef" for c in hexed):
        raise RecordError("digest must be 64 lowercase hex characters")
    return hexed


def version(wire: Any, what: str, supported: int) -> None:
    if not isinstance(wire, Mapping) or "v" not in wire:
        raise RecordError(f"{what} has no schema version")
    version = wire["v"]
    if type(version) is not int or version != supported:  # True == 1 == 1.0: not versions
        raise RecordError(
            f"{what} schema version {peer_repr(version)} is not supported (we speak v{supported})"
        )
