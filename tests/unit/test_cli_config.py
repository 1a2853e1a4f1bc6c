"""Options from flags, FUSIONLLM_* variables and a TOML file: precedence, names, refusals."""

from pathlib import Path

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.cli import config
from fusionllm.node.cli.main import build_parser


def _apply(argv, environ=None):
    parser = build_parser()
    return config.apply(parser, config.command_parser(parser, argv[0]), argv, environ or {})


def _write(tmp_path, text, name="node.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_flag_beats_the_environment_which_beats_the_file(tmp_path):
    path = _write(tmp_path, 'lane-port = 4001\ndht-port = 4002\nport = 4003\nswarm = "filed"\n')
    environ = {"FUSIONLLM_DHT_PORT": "5002", "FUSIONLLM_PORT": "5003"}
    args = _apply(["node", "--config", str(path), "--port", "6003"], environ)
    assert (args.lane_port, args.dht_port, args.port, args.swarm) == (4001, 5002, 6003, "filed")
    sources = args.config_sources
    assert sources["lane_port"] == f"file {path}"
    assert sources["dht_port"] == "env FUSIONLLM_DHT_PORT"
    assert sources["port"] == "flag"
    assert sources["host"] == "default"


def test_a_flag_equal_to_its_default_still_wins_over_the_file(tmp_path):
    path = _write(tmp_path, "steps = 50\n")
    args = _apply(["node", "--config", str(path), "--steps", "200"])
    assert args.steps == 200
    assert args.config_sources["steps"] == "flag"


def test_the_file_may_come_from_fusionllm_config(tmp_path):
    path = _write(tmp_path, 'planner = "naive"\nno-lanes = true\nbootstrap = ["/ip4/1.2.3.4"]\n')
    args = _apply(["node"], {"FUSIONLLM_CONFIG": str(path)})
    assert (args.planner, args.no_lanes, args.bootstrap) == ("naive", True, ["/ip4/1.2.3.4"])


def test_types_convert_like_flags(tmp_path):
    path = _write(tmp_path, "lr = 1\nheartbeat = 2.5\ndense = false\n")
    args = _apply(["node", "--config", str(path)], {"FUSIONLLM_DENSE": "yes"})
    assert args.lr == 1.0
    assert isinstance(args.lr, float)
    assert args.heartbeat == 2.5
    assert args.dense is True  # the environment's "yes" over the file's false


def test_environment_lists_split_on_spaces_and_a_flag_replaces_them():
    environ = {"FUSIONLLM_BOOTSTRAP": "/ip4/1.1.1.1/tcp/1 /ip4/2.2.2.2/tcp/2"}
    assert _apply(["node"], environ).bootstrap == ["/ip4/1.1.1.1/tcp/1", "/ip4/2.2.2.2/tcp/2"]
    args = _apply(["node", "--bootstrap", "/ip4/3.3.3.3/tcp/3"], environ)
    assert args.bootstrap == ["/ip4/3.3.3.3/tcp/3"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("lane_port = 1\n", r"node\.toml: unknown key 'lane_port' \(did you mean 'lane-port'\?\)"),
        ('port = "4000"\n', r"node\.toml: key 'port': expected an integer"),
        ("port = 4.5\n", r"key 'port': expected an integer, got 4.5"),
        ("port = true\n", r"key 'port': expected an integer, got bool"),
        ("swarm = 3\n", r"key 'swarm': expected a string, got int"),
        ('planner = "fastest"\n', r"key 'planner': 'fastest' is not one of opfence"),
        ('dense = "yes"\n', r"key 'dense': expected true or false, got str"),
        ('bootstrap = "/ip4/1.2.3.4"\n', r"key 'bootstrap': expected a non-empty list"),
        ("[node]\nport = 1\n", r"unknown key 'node'"),
        ("control-only = true\n", r"unknown key 'control-only'"),  # hidden options stay flags
        ("port = \n", r"node\.toml: not valid TOML"),
    ],
)
def test_the_file_refuses_what_a_flag_would(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=match):
        _apply(["node", "--config", str(path)])


def test_a_value_out_of_range_is_refused_by_the_node_as_from_a_flag(tmp_path):
    # Ranges are the config dataclasses' job (one check wherever a value comes from).
    from fusionllm.node.cli.node_cmd import _node_config

    path = _write(tmp_path, "probe-fanout = 1000\n")
    args = _apply(["node", "--config", str(path), "--key", str(tmp_path / "k")])
    with pytest.raises(ConfigError, match=r"probe_fanout must be in \[0, 64\], got 1000"):
        _node_config(args)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"FUSIONLLM_PORT": "http"}, r"FUSIONLLM_PORT='http': expected an integer"),
        ({"FUSIONLLM_PLANNER": "x"}, r"FUSIONLLM_PLANNER='x': 'x' is not one of"),
        ({"FUSIONLLM_DENSE": "maybe"}, r"FUSIONLLM_DENSE='maybe': expected true/false"),
        ({"FUSIONLLM_BOOTSTRAP": "  "}, r"FUSIONLLM_BOOTSTRAP='  ': expected one or more"),
        ({"FUSIONLLM_LANEPORT": "1"}, r"FUSIONLLM_LANEPORT: no such option \(did you mean "),
        (
            {"FUSIONLLM_ANNOUNCE_ADDR": "1.2.3.4 x.org"},
            r"ANNOUNCE_ADDR='1.2.3.4 x.org': expected a value: .* IP address, got 'x.org'",
        ),
    ],
)
def test_the_environment_refuses_bad_values_naming_the_variable(environ, match):
    with pytest.raises(ConfigError, match=match):
        _apply(["node"], environ)


def test_a_missing_or_huge_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing\.toml: No such file"):
        _apply(["node", "--config", str(tmp_path / "missing.toml")])
    huge = _write(tmp_path, "#" * (config._MAX_CONFIG_BYTES + 1), name="huge.toml")
    with pytest.raises(ConfigError, match=r"huge\.toml: over 1048576 bytes"):
        _apply(["node", "--config", str(huge)])


def test_other_variables_are_ignored_and_the_environment_is_read_per_call():
    assert _apply(["node"], {"HOME": "/x", "FUSIONLLMX": "1"}).port == 0
    assert _apply(["node"], {"FUSIONLLM_PORT": "7"}).port == 7
    assert _apply(["node"]).port == 0


def test_help_names_the_variables_and_the_precedence():
    text = config.command_parser(build_parser(), "node").format_help()
    assert "[$FUSIONLLM_LANE_PORT]" in text
    assert "Flags win over the environment, which wins over the file" in text.replace("\n", " ")


def test_the_log_lines_name_each_source(tmp_path):
    path = _write(tmp_path, 'swarm = "filed"\n')
    lines = config.describe(_apply(["node", "--config", str(path), "--port", "9"]))
    assert f"swarm = 'filed' (file {path})" in lines
    assert "port = 9 (flag)" in lines
    assert "host = '127.0.0.1' (default)" in lines


def test_the_readmes_example_file_is_a_valid_config(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("    # node.toml")
    block = readme[start:].split("\n\n")[0].splitlines()[1:]
    path = _write(tmp_path, "\n".join(line[4:] for line in block) + "\n")
    args = _apply(["node", "--config", str(path)])
    assert args.config_sources["announce_addr"] == f"file {path}"
    assert (args.lane_port, args.swarm_key, args.min_stages) == (4003, "~/.fusionllm/ours.swarm", 2)
    assert [a.host for a in args.announce_addr] == ["198.51.100.20"]


# ----- the same mechanism for `fusionllm swarm` and `fusionllm train` ---------------------


def test_swarm_and_train_read_files_and_variables_with_the_nodes_precedence(tmp_path):
    path = _write(tmp_path, "nodes = 3\nsteps = 40\nmin-stages = 3\n", name="swarm.toml")
    args = _apply(["swarm", "--config", str(path), "--steps", "7"], {"FUSIONLLM_NODES": "5"})
    assert (args.nodes, args.steps, args.min_stages) == (5, 7, 3)
    assert args.config_sources["nodes"] == "env FUSIONLLM_NODES"
    assert args.config_sources["min_stages"] == f"file {path}"
    path = _write(tmp_path, "stages = 3\nreplicas = [1, 2, 1]\ntopk-activations = true\n")
    args = _apply(["train"], {"FUSIONLLM_CONFIG": str(path), "FUSIONLLM_TOPK_RATIO": "0.1"})
    assert (args.stages, args.replicas, args.topk_activations) == (3, [1, 2, 1], True)
    assert args.topk_ratio == 0.1


@pytest.mark.parametrize(
    ("command", "text", "match"),
    [
        ("swarm", "lane-port = 4003\n", r"swarm\.toml: unknown key 'lane-port'"),
        ("swarm", "node = 3\n", r"swarm\.toml: unknown key 'node' \(did you mean 'nodes'\?\)"),
        ("swarm", 'nodes = "2"\n', r"swarm\.toml: key 'nodes': expected an integer"),
        ("train", "stages = 2\nbootstrap = []\n", r"swarm\.toml: unknown key 'bootstrap'"),
        ("train", "replicas = 2\n", r"swarm\.toml: key 'replicas': expected a non-empty list"),
    ],
)
def test_swarm_and_train_refuse_what_they_lack_naming_the_file_and_key(
    tmp_path, command, text, match
):
    path = _write(tmp_path, text, name="swarm.toml")
    with pytest.raises(ConfigError, match=match):
        _apply([command, "--config", str(path)])


def test_a_variable_of_another_command_is_left_to_it_and_a_typo_is_refused():
    # One shell runs node, swarm and train: FUSIONLLM_LANE_PORT is the node's, not an error.
    assert _apply(["swarm"], {"FUSIONLLM_LANE_PORT": "4003"}).nodes == 4
    assert not hasattr(_apply(["train"], {"FUSIONLLM_NODES": "2"}), "nodes")
    assert _apply(["node"], {"FUSIONLLM_NODES": "2", "FUSIONLLM_STAGES": "3"}).port == 0
    with pytest.raises(ConfigError, match=r"FUSIONLLM_NODE: no such option \(did you mean "):
        _apply(["swarm"], {"FUSIONLLM_NODE": "2"})
    with pytest.raises(ConfigError, match=r"FUSIONLLM_NODES='x': expected an integer"):
        _apply(["swarm"], {"FUSIONLLM_NODES": "x"})  # its own variable is still checked


@pytest.mark.parametrize("command", ["swarm", "train"])
def test_swarm_and_train_help_documents_the_file_and_the_variables(command):
    text = config.command_parser(build_parser(), command).format_help()
    assert "--config FILE" in text
    assert "[$FUSIONLLM_STEPS]" in text
    assert "Flags win over the environment, which wins over the file" in text.replace("\n", " ")
