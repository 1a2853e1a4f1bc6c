"""What benchmarks/fuzz.py feeds damaged input to: every parser of bytes a stranger can send.

Each ``Target`` turns one input (bytes, plus the seed's context) into what the node would act
on, the way the node does it, and names the typed errors it may raise; anything else it
raises is an untyped error (a crash of the caller). ``check`` states what an accepted input
must satisfy. Seeds are valid inputs; ``tree`` (optional) decodes an input into a msgpack/JSON
tree and encodes it back, so the fuzzer can damage structure, not just bytes. The targets live
in fuzz_frame_targets.py (tensor frames, heads) and fuzz_control_targets.py (the control plane).
"""

import tempfile
from pathlib import Path

from fuzz_control_targets import board_target, dht_targets, gossip_target, plan_target
from fuzz_frame_targets import Target, head_target, tensor_targets

__all__ = ["Target", "all_targets"]


def all_targets(workdir: Path | None = None) -> list[Target]:

    workdir = workdir or Path(tempfile.mkdtemp(prefix="fusionllm-fuzz-"))
    return [
        *tensor_targets(),
        head_target(),
        *dht_targets(workdir),
        gossip_target(),
        board_target(),
        plan_target(),
    ]
