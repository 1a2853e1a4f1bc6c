"""The exception hierarchy: callers catch ``FusionError`` or one of its typed subclasses."""

import reprlib


class FusionError(Exception):
    """Base of every error fusionllm raises on purpose."""


class ConfigError(FusionError, ValueError):
    """A configuration value is out of range or inconsistent."""


class PeerError(FusionError):
    """A peer sent something we refuse; the connection to it may close, the node keeps running."""


class FrameError(PeerError):
    """A wire frame is malformed, truncated, over a limit or otherwise unacceptable."""


_PEER_REPR = reprlib.Repr()
_PEER_REPR.maxlevel = 3
_PEER_REPR.maxstring = _PEER_REPR.maxother = 60
_PEER_REPR.maxlist = _PEER_REPR.maxdict = _PEER_REPR.maxtuple = 8


def peer_repr(value: object) -> str:
    """A value a peer sent, for an error message: bounded in depth and length.

    A plain ``{value!r}`` of a 500-deep msgpack list raises RecursionError (an untyped error
    in the middle of raising a typed one), and of a long one builds a huge message.
    """
    return _PEER_REPR.repr(value)
