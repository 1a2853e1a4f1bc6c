"""The control plane: membership, measured links, leaderless plan agreement.

- daemon.py:          ``NodeDaemon``: heartbeat, plan epochs, the record it publishes
- node_config.py:     ``NodeConfig`` (one node's key, addresses, probing)
- links.py:           ``LinkMonitor``: probes to members, gossiped bandwidth reports
- swarm_settings.py:  ``SwarmSettings``: what every node of a swarm must share, and its digest
- bandwidth.py:       ``BandwidthBook``, ``BandwidthReport`` (the gossip message)
- agreement.py:       leaderless plan choice: ``check_proposal``, ``choose``, epochs
- epochs.py:          ``PlanAgreement``: one node's epochs (snapshot, propose, adopt, converge)
- audit.py:           a proposal's rules and figures against our own recomputation
- convergence.py:     nodes that adopted different plans follow the majority's
- suspicion.py:       ``SuspicionBook``: members our trainer waited for in vain, with backoff
- seating.py:         whom a plan may seat: no observer, no member enough others suspect
                      (unless the swarm needs it to reach --min-peers)
- probe.py:           this machine's FLOP/s, memory bandwidth and per-op overhead (cached)
- local_facts.py:     device and model costs from a short-lived child (facts_main.py), so the
                      node's own process imports no torch until it serves
- timings.py:         ``Timings``: how long the DHT rounds take (for the metrics)
- status.py:          ``gather`` / ``format_status`` behind ``fusionllm status``
"""
