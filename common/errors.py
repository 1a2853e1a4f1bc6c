"""The exception hierarchy: callers catch ``FusionError`` or one of its typed subclasses."""


class FusionError(Exception):
    """Base of every error fusionllm raises on purpose."""


class ConfigError(FusionError, ValueError):
    """A configuration value is out of range or inconsistent."""


class PeerError(FusionError):
    """A peer sent something we refuse; the connection to it may close, the node keeps running."""


class FrameError(PeerError):
    """A wire frame is malformed, truncated, over a limit or otherwise unacceptable."""
