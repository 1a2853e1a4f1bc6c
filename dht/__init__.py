"""Node records, keys, and announce/discover on hivemind's Kademlia DHT. Never imports torch.

Not written yet: see the control-plane issue.
"""
