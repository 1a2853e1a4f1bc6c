"""Gossip's checks: what a received message must pass before it is delivered or forwarded.

Every message from another peer passes, in the trio thread: gossipsub's signature check
(strict signing: the author is the key that signed it; unsigned or mis-signed messages are
dropped and counted by ``GuardedPubsub``), then ``MessageChecks``: one topic per message,
``max_bytes``, a per-author token bucket, and the caller's ``validate(topic, author, data)``.
A message any of them rejects is neither delivered nor forwarded. Accepted messages wait in a
bounded ``Inbox`` for the node's threads.
"""

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.validators import signature_validator

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import DeadlineError, TransportClosedError

logger = get_logger(__name__)

# py-libp2p drops an outbound RPC over 1 MiB and resets a peer's whole pubsub stream for an
# inbound one; a message half that size always fits one RPC with its signature and envelope.
MAX_GOSSIP_BYTES = 512 << 10
MAX_TOPIC_CHARS = 256

# Per-author state is kept for at most this many peers; idle entries go first.
_MAX_TRACKED_PEERS = 4096

# validate(topic, author, data): the caller's own check of a message from another peer.
Validate = Callable[[str, str, bytes], bool]
# count(counter name): the owner's thread-safe counters (ControlStats fields).
Count = Callable[[str], None]


@dataclass(frozen=True)
class GossipMessage:
    topic: str
    author: str  # base58 peer id of the key that signed it (checked by gossipsub)
    data: bytes
    received_at: float  # time.time() when it passed validation here


def check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not 1 <= len(topic) <= MAX_TOPIC_CHARS:
        raise ValueError(f"topic must be a string of 1..{MAX_TOPIC_CHARS} chars, got {topic!r}")


class Inbox:
    """A bounded, thread-safe FIFO: a full inbox drops its oldest message (counted)."""

    def __init__(self, size: int) -> None:
        self._items: deque[GossipMessage] = deque()
        self._size = size
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: GossipMessage) -> bool:
        """Append; False if the oldest message had to go to make room."""
        with self._cond:
            dropped = len(self._items) >= self._size
            if dropped:
                self._items.popleft()
            self._items.append(item)
            self._cond.notify()
            return not dropped

    def get(self, timeout: float | None) -> GossipMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                if self._closed:
                    raise TransportClosedError("control host closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineError(f"no gossip message within {timeout}s")
                self._cond.wait(remaining)
            return self._items.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class TokenBuckets:
    """Per-peer token buckets: ``rate`` per second, bursts of up to max(1, rate)."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._burst = max(1.0, rate)
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, at)

    def allow(self, peer: str, now: float) -> bool:
        tokens, at = self._buckets.get(peer, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > _MAX_TRACKED_PEERS:
            self._forget_idle(now)
        return allowed

    def _forget_idle(self, now: float) -> None:
        # A refilled bucket is the same as no bucket, so forgetting it changes nothing.
        refill_s = self._burst / self._rate
        for peer, (_tokens, at) in list(self._buckets.items()):
            if now - at >= refill_s:
                del self._buckets[peer]


class MessageChecks:
    """The pubsub topic validator: size, per-author rate, then the caller's ``validate``.

    Runs in the trio thread, before a message is delivered or forwarded. Pubsub has verified
    the signature by then, so ``from_id`` is the author. Never raises: an exception here would
    end py-libp2p's pubsub service.
    """

    def __init__(
        self,
        *,
        my_id: ID,
        max_bytes: int,
        rate: float,
        validate: Validate | None,
        count: Count,
    ) -> None:
        self._my_id = my_id
        self._max_bytes = max_bytes
        self._author_rate = TokenBuckets(rate)
        self._validate = validate
        self._count = count

    def __call__(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            author = ID(msg.from_id)
            if author == self._my_id:
                return True  # our own publish (publish() checked it)
            verdict = self._verdict(author.to_base58(), msg)
        except Exception:
            logger.debug("checking a message from %s failed", forwarder, exc_info=True)
            verdict = "dropped_invalid"
        self._count(verdict)
        if verdict != "messages_accepted":
            logger.debug("message forwarded by %s: %s", forwarder, verdict)
        return verdict == "messages_accepted"

    def _verdict(self, author: str, msg: rpc_pb2.Message) -> str:
        if len(msg.topicIDs) != 1:
            return "dropped_invalid"  # we publish one topic per message; rate counts per message
        if len(msg.data) > self._max_bytes:
            return "dropped_oversize"
        # Before the caller's validator, so a flood cannot make us run it at the flood's rate.
        if not self._author_rate.allow(author, time.monotonic()):
            return "dropped_rate"
        if self._validate is not None:
            try:
                ok = self._validate(msg.topicIDs[0], author, bytes(msg.data))
            except Exception:
                logger.debug("validate() raised on a message from %s", author, exc_info=True)
                ok = False
            if ok is not True:
                return "dropped_invalid"
        return "messages_accepted"


def _signature_ok(msg: rpc_pb2.Message) -> bool:
    try:
        return bool(signature_validator(msg))
    except Exception:  # a malformed key or id raises inside py-libp2p: that is a bad signature
        logger.debug("signature check raised", exc_info=True)
        return False


class GuardedPubsub(Pubsub):
    """py-libp2p's Pubsub with its peer-facing entry point contained.

    ``push_msg`` runs as a task of the pubsub service for every received message, and an
    exception there stops the whole service (e.g. ``signature_validator`` raises on a malformed
    key instead of returning False). Here it costs only that message. Signature failures, which
    Pubsub drops silently, are counted; delivery goes to ``deliver`` instead of per-topic
    channels.
    """

    def __init__(
        self,
        host: IHost,
        router: GossipSub,
        *,
        deliver: Callable[[rpc_pb2.Message], None],
        count: Count,
    ) -> None:
        super().__init__(host, router, strict_signing=True)
        self._deliver = deliver
        self._count = count

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)  # our own publish: errors are ours
            return
        try:
            # Pubsub verifies too (after this), but drops failures without telling anyone.
            if not self._is_msg_seen(msg) and not _signature_ok(msg):
                self._count("dropped_bad_signature")
                logger.debug("dropped a badly signed message forwarded by %s", msg_forwarder)
                return
            await super().push_msg(msg_forwarder, msg)
        except Exception:
            self._count("pubsub_errors")
            logger.debug("pubsub failed on a message from %s", msg_forwarder, exc_info=True)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        self._deliver(publish_message)
