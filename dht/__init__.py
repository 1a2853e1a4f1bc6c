"""Node records, keys, and announce/discover on hivemind's Kademlia DHT. Never imports torch.

hivemind and py-libp2p cannot share a Python process (both register a protobuf file
``crypto.proto`` with the same symbols), so hivemind lives only in the DHT worker process and
nothing a node imports pulls it in, except validator.py and worker.py (worker-side only).

- records.py:   ``NodeInfo``, ``DeviceInfo``, ``LinkReport``, ``NodeState``, ``PlanProposal``,
                ``RecordError``: strict, versioned wire schemas
- envelope.py:  ``seal`` / ``open_envelope``: Ed25519 signatures checked against the peer id
                itself (a peer can write only its own subkey)
- cipher.py:    ``RecordCipher``: a private swarm's DHT values sealed (AES-256-GCM), so a
                stranger reads nothing of them
- keys.py:      ``nodes_key``, ``plans_key``, ``check_swarm_name``
- client.py:    ``DhtClient``, ``DhtConfig``, ``DhtError``: the node's handle on its worker
                (bounded replies, restarts a dead worker)
- process.py:   ``WorkerProcess``: one worker process (in its own process group), its pipe
                and reply reader
- directory.py: ``SwarmDirectory``: announce / members / propose / proposals, re-verified
- worker.py:    the worker process (``python -m fusionllm.dht.worker``): hivemind's DHTNode on
                its own event loop, and hivemind's Go daemon (p2pd) as its one child
- serve.py:     the worker's end of the pipe: requests to the DHT node, capped replies
- validator.py: ``SwarmRecordValidator``, hivemind's record validator for one swarm
- wire.py:      length-prefixed, tagged msgpack on the node <-> worker pipe
"""
