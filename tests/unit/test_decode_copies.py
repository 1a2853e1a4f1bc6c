"""How many host copies a received frame costs: one, from the receive buffer into its tensor.

A frame's payload is a view of the transport's receive buffer, which the next frame reuses,
so exactly one copy out of it is needed and none more: a dense or half-precision frame
decodes with one allocation and one copy (a float16/bfloat16 payload converts to float32 in
that same copy). Counted with a dispatch mode that records every aten op decode runs.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusionllm.compression import Float16Codec, decode_frame, pack_tensor, parse_frame

_ALLOCATING = ("empty", "zeros", "ones", "full", "clone", "_to_copy", "new_")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("codec", "dtype"),
    [
        (None, torch.float32),
        (None, torch.int64),
        (Float16Codec(torch.float16), torch.float32),
        (Float16Codec(torch.bfloat16), torch.float32),
        (Float16Codec(torch.float16), torch.float64),
    ],
)
def test_a_frame_decodes_with_one_allocation_and_one_copy(codec, dtype) -> None:
    source = (torch.randn(1 << 14) * 1000).to(dtype)  # (N,)
    body = bytearray(pack_tensor(source, codec))  # as the transport's reused receive buffer
    parsed = parse_frame(memoryview(body))
    with _Ops() as seen:
        decoded = decode_frame(parsed)
    allocations = [op for op in seen.ops if any(name in op for name in _ALLOCATING)]
    copies = [op for op in seen.ops if "copy" in op]
    assert allocations == ["aten.empty.memory_format"], seen.ops
    assert copies == ["aten.copy_.default"], seen.ops
    assert decoded.dtype == dtype
    assert decoded.shape == source.shape
    # The copy ends every tie to the buffer: the next frame may overwrite it.
    expected = decoded.clone()
    body[:] = bytes(len(body))
    assert torch.equal(decoded, expected)
    if codec is None:
        assert torch.equal(decoded, source)
