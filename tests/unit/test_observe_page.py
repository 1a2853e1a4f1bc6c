"""fusionllm status --serve: the feed (one read per interval), the loss curve, the app."""

import math
import re

import pytest
from starlette.testclient import TestClient

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.dht.process import DhtError
from fusionllm.node.observe.feed import FeedConfig, LossCurve, StatusFeed
from fusionllm.node.observe.page import listening_socket, static_dir, status_app


def _status(*peers: tuple[int | None, float | None], swarm: str = "s") -> dict:
    return {"swarm": swarm, "peers": [{"peer_id": f"p{i}", "step": step, "loss": loss}
                                      for i, (step, loss) in enumerate(peers)]}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"interval_s": 0.1}, "interval_s"), ({"interval_s": math.nan}, "interval_s"),
     ({"max_points": 1}, "max_points")],
)  # fmt: skip
def test_feed_config_refuses_out_of_range(fields, why):
    with pytest.raises(ConfigError, match=why):
        FeedConfig(**fields)


def test_loss_curve_keeps_sane_points_in_step_order_and_bounded():
    curve = LossCurve(max_points=3)
    curve.add(_status((5, 2.0), (4, 2.5), (None, None)))
    curve.add(_status((6, math.nan), (True, 1.0), (-1, 1.0), (1 << 50, 1.0), (7, "1.0")))
    assert curve.points() == [[4, 2.5], [5, 2.0]]
    curve.add(_status((7, 1.5), (8, 1.25)))
    assert curve.points() == [[5, 2.0], [7, 1.5], [8, 1.25]]  # the oldest went


def test_a_failed_read_keeps_the_last_good_one_and_says_why():
    reads = iter([_status((1, 3.0)), DhtError("no bootstrap peer answered")])

    def read() -> dict:
        item = next(reads)
        if isinstance(item, Exception):
            raise item
        return item

    feed = StatusFeed(read, FeedConfig(interval_s=1.0), clock=lambda: 100.0)
    feed.poll()
    feed.poll()
    latest = feed.latest()
    assert latest["status"] == _status((1, 3.0))
    assert latest["loss_curve"] == [[1, 3.0]]
    assert latest["read_at"] == 100.0
    assert latest["error"] == "DhtError: no bootstrap peer answered"
    assert latest["interval_s"] == 1.0


def test_an_unexpected_error_is_kept_too(caplog):
    def read() -> dict:
        raise KeyError("peers")

    feed = StatusFeed(read, FeedConfig())
    feed.poll()
    assert feed.latest()["error"] == "KeyError: 'peers'"
    assert "reading the swarm failed unexpectedly" in caplog.text


def test_viewers_read_the_feed_not_the_swarm():
    feed = StatusFeed(lambda: _status((3, 1.0), swarm="<b>x</b>"), FeedConfig())
    feed.poll()
    client = TestClient(status_app(feed))
    for _ in range(20):
        response = client.get("/api/status")
        assert response.status_code == 200
        assert response.json()["status"]["swarm"] == "<b>x</b>"  # data, for textContent
    assert feed.reads == 1
    page = client.get("/")
    assert page.status_code == 200
    assert '<script src="/static/status.js" defer></script>' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    script = client.get("/static/status.js")
    assert script.status_code == 200
    assert "default-src 'self'" in script.headers["content-security-policy"]
    assert client.post("/api/status").status_code == 405  # read-only
    assert client.get("/static/../page.py").status_code == 404


def test_the_page_never_parses_peer_strings_as_html():
    """The script sets text only; the page has no inline script or style the CSP would need."""
    script = (static_dir() / "status.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):  # fmt: skip
        assert sink not in script, sink
    html = (static_dir() / "index.html").read_text()
    assert not re.search(r"<script>|<style>|\son\w+=", html)
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_a_taken_port_is_a_clear_error():
    sock = listening_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(FusionError, match=f"--serve 127.0.0.1:{port}: cannot listen"):
            listening_socket("127.0.0.1", port)
    finally:
        sock.close()
