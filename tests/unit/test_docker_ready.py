"""The file the background docker build leaves for the docker tests (tests/docker/prepare.py):
read only once whole, and anything but an image or a reason is a reason to skip."""

import json

from tests.docker.prepare import _write_ready, wait_ready


def test_an_image_is_read_back(tmp_path):
    path = tmp_path / "ready.json"
    _write_ready(path, {"image": "fusionllm-test:ci-1", "made": ["fusionllm-test:ci-1", "sha"]})
    assert wait_ready(path, 0)["made"] == ["fusionllm-test:ci-1", "sha"]
    assert not (tmp_path / "ready.json.partial").exists()


def test_the_build_says_why_it_failed(tmp_path):
    path = tmp_path / "ready.json"
    path.write_text('{"error": "docker/ci_engine.sh failed (exit 1)"}\n')
    assert wait_ready(path, 0) == {"error": "docker/ci_engine.sh failed (exit 1)"}


def test_no_file_in_time_is_a_reason(tmp_path):
    ready = wait_ready(tmp_path / "ready.json", 0.05, poll_s=0.01)
    assert "wrote no" in ready["error"]
    assert "ready.json" in ready["error"]


def test_a_file_that_names_no_image_is_a_reason(tmp_path):
    path = tmp_path / "ready.json"
    for text in ("not json", "[1]", json.dumps({"image": 3, "made": []}),
                 json.dumps({"image": "x"}), json.dumps({"error": 5})):  # fmt: skip
        path.write_text(text)
        assert set(wait_ready(path, 0)) == {"error"}, text
