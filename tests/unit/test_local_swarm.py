"""LocalSwarm's files: a node's log and its events tell of the same process, also on a root
a former swarm used. The node is a stand-in (a ``prefix`` that prints one event and exits)."""

import json
import sys

from fusionllm.node.local_swarm import LocalSwarm, wait_for


def _run(root, run: int) -> None:
    swarm = LocalSwarm(root)
    event = json.dumps({"event": "ran", "run": run})
    say = f"import sys; print({event!r}); print('log', {run}, file=sys.stderr)"
    node = swarm.start("n0", prefix=[sys.executable, "-c", say])
    try:
        wait_for(lambda: not node.alive(), 20, "the stand-in node to exit", poll=0.05)
    finally:
        swarm.close()


def test_a_new_swarm_on_a_used_root_writes_each_node_s_log_and_events_afresh(tmp_path):
    for run in (1, 2):
        _run(tmp_path, run)
        events = (tmp_path / "n0.events.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in events] == [{"event": "ran", "run": run}]
        assert (tmp_path / "n0.log").read_text() == f"log {run}\n"
