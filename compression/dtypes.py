"""The dtypes a frame may carry, by wire name; anything else is refused on both ends."""

import torch

from fusionllm.common.errors import FrameError, peer_repr

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
WIRE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def wire_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype we can send; ValueError for one we cannot."""
    try:
        return WIRE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent; allowed: {sorted(WIRE_DTYPES)}") from None


def dtype_from_wire(name: object, allowed: frozenset[str]) -> torch.dtype:
    """The dtype a peer named, if it is one we accept here."""
    if not isinstance(name, str) or name not in WIRE_DTYPES or name not in allowed:
        raise FrameError(f"dtype {peer_repr(name)} not allowed; allowed: {sorted(allowed)}")
    return WIRE_DTYPES[name]
