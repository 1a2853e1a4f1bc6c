"""Typed errors of the data plane: what the transport raises to its callers."""

from fusionllm.common.errors import ConfigError, FusionError, PeerError


class TransportError(PeerError):
    """A peer could not be reached, refused us, or broke a stream; the node keeps running."""


class DeadlineError(TransportError, TimeoutError):
    """A dial, read, write or wait ran past its configured deadline."""


class TransportClosedError(TransportError):
    """The transport was closed (or never started) while the call needed it."""


class IdentityError(ConfigError):
    """The identity key file is missing, unreadable, of the wrong type or too permissive."""


class PipelineError(FusionError):
    """The pipeline cannot go on: a bad layout, a missing micro-batch, a stage that failed."""


class StepAbortedError(PipelineError):
    """The step was given up on purpose (a member left, the node stops): do not wait longer."""


class PeerProtocolError(PeerError):
    """A pipeline peer sent a frame we did not ask for (wrong step, stage, kind or shape)."""


class ControlError(TransportError):
    """A control-plane call (gossip, bandwidth probe) failed; the node keeps running."""


class ProbeRefusedError(ControlError):
    """A peer refused our bandwidth probe: too large for it, too frequent, or it is busy."""


class FrameTimeoutError(PipelineError):
    """A frame did not come within its deadline: ``rank`` is the process we waited on, at
    ``step`` (training/blame.py asks the others whether that process was waiting too)."""

    def __init__(self, message: str, *, rank: int, step: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
