"""Watching a node and a swarm from outside: Prometheus metrics and the status page.

- listen.py:    ``parse_listen`` (HOST:PORT of --metrics and --serve), ``listen_arg``
- metrics.py:   ``NodeMetrics``: one node's metrics in its own registry, fed by its events
- pulled.py:    ``PulledCollector``: what metrics read at scrape time (refusals, DHT rounds,
                checkpoint age, members), from ``Sources``
- sources.py:   ``node_sources``: the ``Sources`` of a running node's parts
- exporter.py:  ``MetricsServer``: the registry over HTTP (prometheus-client's server)
- feed.py:      ``StatusFeed``: one DHT read per interval, shared by every viewer, with the
                loss history
- page.py:      ``status_app``: the page and its JSON (starlette), ``serve_status`` (uvicorn)
- static/:      the page's HTML, JS and CSS (no CDN: the swarm may have no internet)
"""
