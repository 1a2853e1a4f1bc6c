"""The control plane: membership, measured links, leaderless plan agreement.

- daemon.py:          ``NodeDaemon``: heartbeat, plan epochs, the record it publishes
- node_config.py:     ``NodeConfig`` (one node's key, addresses, probing), ``local_device``
- links.py:           ``LinkMonitor``: probes to members, gossiped bandwidth reports
- swarm_settings.py:  ``SwarmSettings``: what every node of a swarm must share, and its digest
- bandwidth.py:       ``BandwidthBook``, ``BandwidthReport`` (the gossip message)
- agreement.py:       leaderless plan choice: ``check_proposal``, ``choose``, epochs
- probe.py:           this machine's FLOP/s, memory bandwidth and per-op overhead (cached)
- status.py:          ``gather`` / ``format_status`` behind ``fusionllm status``
"""
