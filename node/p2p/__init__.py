"""The data and gossip planes on py-libp2p: one host per node, every protocol attached to it.

- peer_host.py:     ``PeerHost`` (the node's one py-libp2p host, its trio thread and the one
                    thread bridge: call/call_sync/run_sync_soon, services, stream handlers,
                    connect), ``HostConfig``, ``HostService``
- host.py:          ``new_secure_host`` (Noise + Yamux only, connection limits), ``TENSOR_PROTOCOL``
- identity.py:      ``load_or_create_identity``, the Ed25519 key file (mode 0600)
- checks.py:        the value checks the configs share (deadlines, ranges, IPs, peer ids)
- framing.py:       ``FrameHeader``, ``FrameKind``, the length-prefixed frame and its read loop
- transport.py:     ``Transport`` (send/recv/deliver_to/connect/stats of tensor frames)
- departures.py:    ``Departures``, the notifee that says when a peer's last connection closed
- inbound.py:       ``Inbound``, the receiving half: stream admission, budgets, reading and
                    decoding frames within what the receiver expects
- limits.py:        ``RateFloor``, ``ByteBudget``, ``Refusals``, ``InFlight``: what a peer may cost
- transport_types.py: ``TransportConfig``, ``TensorSpec``, ``Received``, ``PeerStats``,
                    ``PeerCounters``, ``SpecFor``, ``AdmitPeer``, ``Deliver``
- control_host.py:  ``ControlHost``, ``ControlConfig``, ``ControlStats``: gossipsub + probes
- gossip.py:        ``GossipMessage``, ``MessageChecks`` (size, rate, validate), ``GuardedPubsub``,
                    the gossip ``Inbox``, ``TokenBuckets``
- relay_addrs.py:   ``relayed_addr``, ``relay_of``: relayed addresses as text (no py-libp2p)
- relay_client.py:  ``RelayClient``: accept circuits, reserve on a relay, dial relayed addresses
- probes.py:        the bandwidth/RTT probe protocol: ``ProbeServer``, ``run_probe``,
                    ``ProbeResult``, ``PROBE_PROTOCOL``
- dialback.py:      the dial-back protocol (may peers dial us?): ``DialBackServer``, ``ask``,
                    ``DialBackAnswer``, ``DialBackConfig``, ``DIALBACK_PROTOCOL``
- reachability.py:  ``judge``: the verdict (public, mapped, private, announced) from answers
- member_relay.py:  ``MemberRelay``: py-libp2p's circuit relay v2 hop for members only,
                    ``MemberRelayConfig`` (limits sized for training traffic)

``ControlHost`` and ``Transport`` attach to a ``PeerHost`` they are given (a node daemon's
``host``) or, given none, make and own one.
"""
