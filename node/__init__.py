"""The node: transport, daemon, command line, hardware/bandwidth probes, planning glue.

- cli.py:  the ``fusionllm`` console script (``version``, ``demo``)
- demo.py: the compression demo the README's main command runs until the daemon exists
- transport.py:      ``Transport`` (trio thread + bridge: send/recv/connect/stats/close),
                     ``TransportConfig``, ``TensorSpec``, ``Received``, ``PeerStats``
- framing.py:        ``FrameHeader``, ``FrameKind``, the length-prefixed frame and its read loop
- host.py:           ``new_secure_host`` (py-libp2p, Noise + Yamux only), ``TENSOR_PROTOCOL``
- identity.py:       ``load_or_create_identity``, the Ed25519 key file (mode 0600)
- errors.py:         ``TransportError``, ``DeadlineError``, ``TransportClosedError``,
                     ``IdentityError``
- transport_main.py: a bare transport node as a process (tests, benchmarks)
"""
