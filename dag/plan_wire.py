"""A Plan as canonical JSON bytes and back, strictly: plans travel between peers.

``plan_to_json(plan)`` is exactly the text ``Plan.digest()`` hashes, so the sha256 of the
bytes is the plan's digest on every node. ``plan_from_json`` trusts nothing: exact fields,
types, lengths and finiteness, else ``PlanWireError`` (a ConfigError).
"""

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any

from fusionllm.common.errors import ConfigError
from fusionllm.dag.planner import LinkPlan, Plan, StagePlan

MAX_PLAN_JSON_BYTES = 512 << 10
_MAX_ITEMS = 4096
_MAX_STR = 256


class PlanWireError(ConfigError):
    """Bytes that do not describe a well-formed plan."""


def plan_to_json(plan: Plan) -> bytes:
    return json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":")).encode()


def plan_from_json(data: bytes) -> Plan:
    if not isinstance(data, bytes) or len(data) > MAX_PLAN_JSON_BYTES:
        raise PlanWireError(f"a plan must be at most {MAX_PLAN_JSON_BYTES} bytes of JSON")
    try:
        wire = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise PlanWireError(f"plan is not JSON: {exc}") from exc
    return _build(Plan, wire, "plan")


def _build(cls: type, wire: Any, where: str) -> Any:
    if not isinstance(wire, dict):
        raise PlanWireError(f"{where} must be an object")
    fields, hints = _schema(cls)
    if set(wire) != set(fields):
        raise PlanWireError(
            f"{where}: missing {sorted(set(fields) - set(wire))}, "
            f"unexpected {sorted(set(wire) - set(fields))[:5]}"
        )
    values = {name: _value(hints[name], wire[name], f"{where}.{name}") for name in fields}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise PlanWireError(f"{where}: {exc}") from exc


@functools.cache
def _schema(cls: type) -> tuple[frozenset[str], dict[str, Any]]:
    """A dataclass's field names and resolved hints: resolving them is most of a parse's cost,
    and every node parses every member's proposal each epoch."""
    return frozenset(f.name for f in dataclasses.fields(cls)), typing.get_type_hints(cls)


def _value(hint: Any, value: Any, where: str) -> Any:
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool) or abs(value) > 1 << 62:
            raise PlanWireError(f"{where} must be an integer")
        return value
    if hint is float:
        if value == "inf":
            return math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PlanWireError(f"{where} must be a number")
        if isinstance(value, int) and abs(value) > 1 << 62:  # float() of a huge int overflows
            raise PlanWireError(f"{where} is out of range")
        if not math.isfinite(value):
            raise PlanWireError(f"{where} must be finite")
        return float(value)
    if hint is str:
        if not isinstance(value, str) or len(value) > _MAX_STR:
            raise PlanWireError(f"{where} must be a string of at most {_MAX_STR} characters")
        return value
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or len(value) > _MAX_ITEMS:
            raise PlanWireError(f"{where} must be a list of at most {_MAX_ITEMS} items")
        (item, ellipsis) = typing.get_args(hint)
        if ellipsis is not Ellipsis:
            raise PlanWireError(f"{where}: unsupported type {hint}")
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if hint in (StagePlan, LinkPlan):
        return _build(hint, value, where)
    if isinstance(hint, types.UnionType):
        raise PlanWireError(f"{where}: unsupported type {hint}")
    raise PlanWireError(f"{where}: unsupported type {hint}")
