"""``fusionllm node --planner/--dense``: the planning method reaches the swarm settings."""

import pytest

from fusionllm.node.cli.main import build_parser
from fusionllm.node.cli.node_cmd import _node_config


@pytest.mark.parametrize(
    ("argv", "planner", "compress"),
    [
        ([], "opfence", True),
        (["--dense"], "opfence", False),
        (["--planner", "balanced"], "balanced", True),
        (["--planner", "naive", "--dense"], "naive", False),
        (["--min-peers", "4"], "opfence", True),
    ],
)
def test_planner_and_dense_become_swarm_settings(tmp_path, argv, planner, compress):
    args = build_parser().parse_args(["node", "--key", str(tmp_path / "k"), *argv])
    settings = _node_config(args).settings
    assert (settings.planner, settings.compress) == (planner, compress)
    assert settings.plan_config().planner == planner
    assert settings.min_peers == settings.plan_config().min_peers == (4 if "4" in argv else 1)


def test_an_unknown_planner_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["node", "--planner", "fastest"])
    assert exc.value.code == 2
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
