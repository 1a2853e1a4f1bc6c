"""Serving generation from the swarm: what clients ask for (api.py) and how it is answered."""
