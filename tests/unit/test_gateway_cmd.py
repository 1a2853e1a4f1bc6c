"""``fusionllm gateway``'s options and the errors it gives before serving anything."""

import json
import socket

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.cli.gateway_cmd import codec_for
from fusionllm.node.cli.main import build_parser, main


def test_help_names_the_routes_sources_and_limits(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needed in ("/v1/chat/completions", "--bootstrap", "--local-model-dir", "--http HOST:PORT",
                   "--max-concurrent N", "429 (busy)"):  # fmt: skip
        assert needed in text


def test_a_source_is_required_and_only_one(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway"])
    assert (
        "one of the arguments --bootstrap --local-model-dir is required" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["gateway", "--bootstrap", "/ip4/1.2.3.4/tcp/1", "--local-model-dir", "d"]
        )
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_taken_port_is_an_error_before_the_swarm_is_asked(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(
            ["gateway", "--bootstrap", "/ip4/127.0.0.1/tcp/9", "--http", f"127.0.0.1:{port}"]
        )
    assert code == 1
    assert f"--http 127.0.0.1:{port}: cannot listen there" in capsys.readouterr().err


def test_limits_out_of_range_are_an_error(capsys):
    assert main(["gateway", "--bootstrap", "/ip4/127.0.0.1/tcp/9", "--max-concurrent", "0"]) == 1
    assert "max_concurrent must be an int >= 1" in capsys.readouterr().err


def test_text_is_bytes_only_for_byte_level_models(tmp_path):
    assert codec_for(None, 256).name == "bytes"
    with pytest.raises(ConfigError, match=r"\(50257\) is not byte-level \(256\): give --model-dir"):
        codec_for(None, 50257)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    assert codec_for(str(tmp_path), 300).vocab_size == 300
