"""What a serving node admits: sessions bounded in count and in KV-cache bytes.

A session's cache is preallocated for its whole length when it opens, so admission is
decided on its exact size, before any memory is taken; over either bound the session is
refused (the client sees ``OverloadedError``) and nothing already admitted is touched.
"""

import threading
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve.api import OverloadedError


@dataclass(frozen=True, kw_only=True)
class ServeLimits:
    max_sessions: int = 16
    max_cache_bytes: int = 1 << 30  # all sessions' KV caches together
    idle_s: float = 60.0  # a session whose client sends nothing this long is ended
    max_len: int = 4096  # positions one session may ask for (also capped by the model)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_cache_bytes", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ServeLimits.{name} must be an int >= 1, got {value!r}")
        if not 0 < self.idle_s <= 3600:
            raise ConfigError(f"ServeLimits.idle_s must be in (0, 3600], got {self.idle_s}")


class SessionBook:
    """Counts admitted sessions and their cache bytes (any thread)."""

    def __init__(self, limits: ServeLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self.sessions = 0
        self.cache_bytes = 0

    def admit(self, nbytes: int) -> None:
        with self._lock:
            if self.sessions + 1 > self.limits.max_sessions:
                raise OverloadedError(
                    f"{self.sessions} sessions open, the bound is {self.limits.max_sessions}"
                )
            if self.cache_bytes + nbytes > self.limits.max_cache_bytes:
                raise OverloadedError(
                    f"a cache of {nbytes} bytes over the {self.cache_bytes} held passes the "
                    f"bound of {self.limits.max_cache_bytes}"
                )
            self.sessions += 1
            self.cache_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.sessions -= 1
            self.cache_bytes -= nbytes
