"""The console script, run as a user would: a real process."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

_TIMEOUT_S = 120


def _fusionllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        check=False,
    )


def test_help_lists_the_commands():
    result = _fusionllm("--help")
    assert result.returncode == 0
    for command in ("version", "demo"):
        assert command in result.stdout


def test_no_command_prints_help_and_fails():
    result = _fusionllm()
    assert result.returncode == 2
    assert "COMMAND" in result.stdout


def test_version_json():
    result = _fusionllm("version", "--json")
    assert result.returncode == 0
    info = json.loads(result.stdout)
    assert info["fusionllm"].count(".") == 2
    assert info["torch"].startswith("2.")


def test_demo_reports_every_codec():
    result = _fusionllm("--log-level", "WARNING", "demo", "--numel", "20000", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    codecs = [entry["codec"] for entry in report["codecs"]]
    assert len(codecs) == 6
    by_codec = {entry["codec"]: entry for entry in report["codecs"]}
    assert by_codec["IdentityCodec()"]["relative_error"] == 0.0
    topk = [entry for name, entry in by_codec.items() if name.startswith("TopKCodec(ratio=0.01")]
    assert topk[0]["wire_bytes"] < 0.1 * topk[0]["dense_bytes"]


def test_bad_arguments_give_a_clear_error():
    result = _fusionllm("demo", "--numel", "0")
    assert result.returncode == 1
    assert "numel must be in" in result.stderr


@pytest.mark.parametrize("command", ["node", "status"])
def test_control_plane_commands_explain_themselves(command):
    result = _fusionllm(command, "--help")
    assert result.returncode == 0
    assert "--bootstrap" in result.stdout
    assert "--swarm" in result.stdout


def test_status_of_an_unreachable_swarm_is_a_clear_error():
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGMXzYEhzmzA1Y3ggimWP3jLABCPvyJ9pCk5aCAqcKsCh"
    # A short deadline: whether the bootstrap peer refused or the start ran out of time, the
    # error names the peer (a 60 s default took 20-40 s of retries to say so).
    result = _fusionllm("status", "--bootstrap", dead, "--timeout", "5")
    assert result.returncode == 1
    assert f"through its bootstrap peers ({dead})" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_node_refuses_a_bad_swarm_name_before_starting_anything(tmp_path):
    result = _fusionllm("node", "--swarm", "no spaces", "--key", str(tmp_path / "k.key"))
    assert result.returncode == 1
    assert "swarm name" in result.stderr
    assert not (tmp_path / "k.key").exists()


def test_swarm_refuses_a_folder_the_data_does_not_fit_before_starting_anything(tmp_path):
    from tests.support.hf_models import hf_llama

    hf_llama(vocab=96).save_pretrained(tmp_path / "llama")  # 64 positions
    work = tmp_path / "w"
    narrow = _fusionllm("swarm", "--model-dir", str(tmp_path / "llama"), "--work-dir", str(work))
    assert narrow.returncode == 1
    assert "has a vocabulary of 96; the data's token ids go up to 255" in narrow.stderr
    assert "Traceback" not in narrow.stderr
    hf_llama(vocab=256).save_pretrained(tmp_path / "bytes")
    long = _fusionllm("swarm", "--model-dir", str(tmp_path / "bytes"), "--seq-len", "65",
                      "--work-dir", str(work))  # fmt: skip
    assert long.returncode == 1
    assert "--seq-len 65 exceeds" in long.stderr
    assert "64 positions" in long.stderr
    assert not work.exists()  # no node was started


def test_status_serve_and_swarm_metrics_refuse_bad_addresses_before_starting_anything(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGMXzYEhzmzA1Y3ggimWP3jLABCPvyJ9pCk5aCAqcKsCh"
    bad = _fusionllm("status", "--serve", "127.0.0.1", "--bootstrap", dead)
    assert bad.returncode == 2
    assert "argument --serve: '127.0.0.1' is not HOST:PORT" in bad.stderr
    slow = _fusionllm("status", "--serve", "127.0.0.1:0", "--interval", "0.01", "--bootstrap", dead)
    assert slow.returncode == 1
    assert "interval_s must be in [0.2, 3600] s, got 0.01" in slow.stderr
    watching = _fusionllm("status", "--watch", "--interval", "0.01", "--bootstrap", dead)
    assert watching.returncode == 1
    assert "interval_s must be in [0.2, 3600] s, got 0.01" in watching.stderr
    both = _fusionllm("status", "--watch", "--serve", "127.0.0.1:0", "--bootstrap", dead)
    assert both.returncode == 2
    assert "argument --serve: not allowed with argument --watch" in both.stderr
    ports = _fusionllm("swarm", "--nodes", "3", "--metrics-port", "65534", "--work-dir",
                       str(tmp_path / "w"))  # fmt: skip
    assert ports.returncode == 1
    assert "--metrics-port 65534: ports BASE..BASE+2 must lie within 1..65535" in ports.stderr
    assert not (tmp_path / "w").exists()


def test_node_with_a_corrupt_identity_key_says_so(tmp_path):
    # The error once hid behind an AttributeError from leaving a swarm never joined.
    key = tmp_path / "id.key"
    key.write_bytes(b"not a key")
    key.chmod(0o600)
    result = _fusionllm("node", "--key", str(key), "--no-train")
    assert result.returncode == 1
    assert "is not a libp2p private key" in result.stderr
    assert "Traceback" not in result.stderr
