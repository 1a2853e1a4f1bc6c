"""The py-libp2p host of the data plane: TCP, Noise and Yamux, nothing else.

py-libp2p's ``new_host`` offers Noise, TLS, SECIO and *plaintext* by default, and Mplex beside
Yamux; we pass exactly one security and one muxer option, so a peer that only speaks plaintext
(or anything but Noise) fails the security negotiation and is never connected.
"""

import math

from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

TENSOR_PROTOCOL = TProtocol("/fusionllm/tensor/1.0.0")

# Connections in total (both directions) and to one peer. py-libp2p refuses an inbound
# connection over the total before its handshake, and closes the extra ones to one peer;
# the watermarks it prunes and re-dials by stay its own (pruning starts at the total), and so
# does its handshake deadline (10 s: a dialer that stalls holds an inbound slot that long).
MAX_CONNECTIONS = 300
MAX_CONNECTIONS_PER_PEER = 3


def new_secure_host(
    key_pair: KeyPair, *, negotiate_timeout_s: float, psk: str | None = None
) -> IHost:
    """A host with ``key_pair``'s identity that speaks only Noise + Yamux over TCP; with
    ``psk`` (64 hex digits), only to hosts with the same pre-shared key (py-libp2p's private
    network: every connection is encrypted with it under Noise, so without it the security
    negotiation reads noise and fails)."""
    # The Noise static key is per process on purpose: Noise authenticates it with a signature
    # by the identity key during the handshake, so it need not persist.
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        # multistream-select takes whole seconds; round up so a short deadline is not 0.
        negotiate_timeout=max(1, math.ceil(negotiate_timeout_s)),
        connection_config=ConnectionConfig(
            max_connections=MAX_CONNECTIONS,
            high_watermark=MAX_CONNECTIONS,
            max_connections_per_peer=MAX_CONNECTIONS_PER_PEER,
        ),
        psk=psk,
    )
