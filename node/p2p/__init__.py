"""The data and gossip planes on py-libp2p.

- host.py:          ``new_secure_host`` (Noise + Yamux only), ``TENSOR_PROTOCOL``
- identity.py:      ``load_or_create_identity``, the Ed25519 key file (mode 0600)
- framing.py:       ``FrameHeader``, ``FrameKind``, the length-prefixed frame and its read loop
- transport.py:     ``Transport`` (send/recv/connect/stats of tensor frames), ``TransportConfig``,
                    ``TensorSpec``, ``Received``, ``PeerStats``
- control_host.py:  ``ControlHost``, ``ControlConfig``: gossipsub + bandwidth/RTT probes
"""
