"""``fusionllm status``: what a swarm looks like from its DHT, without joining it.

Starts a client-mode DHT worker (it stores nothing for others and has a throwaway identity,
and it writes no node record: the swarm never counts it a member, so no plan can seat it),
reads the swarm's node records and the plan most of them follow, and describes peers, devices,
measured links, fences, stages and the backup pool.
"""

import collections
import re
import time
from collections.abc import Callable
from typing import Any

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import SwarmKey
from fusionllm.dag.plan_wire import plan_from_json
from fusionllm.dht.client import DhtClient, DhtConfig, DhtError
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.records import NodeInfo
from fusionllm.node.control.quiet import MAX_STRIDE
from fusionllm.node.control.seating import accusations, excluded
from fusionllm.node.p2p.relay_addrs import relay_of

logger = get_logger(__name__)


def _no_signing(data: bytes) -> bytes:
    raise FusionError("the status reader never writes to the DHT")


_ATTEMPTS = 4
_RETRY_PAUSE_S = 2.0  # a busy bootstrap node answers a moment later
_RETRIED = re.compile(r"connect to bootstrap peers|none of the initial_peers responded")
_TIMED_OUT = re.compile(r"did not start: .*Timeout")  # the worker's start ran out of time


def gather(
    bootstrap: list[str],
    swarm: str,
    *,
    timeout_s: float = 60.0,
    swarm_key: SwarmKey | None = None,
) -> dict[str, Any]:
    """Read the swarm (a private one with its ``swarm_key``); a DHT that cannot reach a
    bootstrap peer (a busy node) is retried while a try still fits before the deadline."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, _ATTEMPTS + 1):
        began = time.monotonic()
        try:
            status = _gather_once(
                bootstrap, swarm, timeout_s=max(deadline - began, 1.0), swarm_key=swarm_key
            )
            status["timing"]["attempts"] = attempt
            return status
        except DhtError as exc:
            # Only a bootstrap peer that did not answer (busy) is worth another try: a malformed
            # address failed the same way four times (45 s on the testbed) before.
            if not _RETRIED.search(str(exc)):
                if _TIMED_OUT.search(str(exc)):
                    raise _unreached(exc, bootstrap, timeout_s) from exc
                raise
            # A try that cannot end before the deadline would only turn this error into a
            # timeout that no longer names the peers (an unreachable swarm took 20 s to say so).
            took = time.monotonic() - began
            if attempt == _ATTEMPTS or deadline - time.monotonic() < took + _RETRY_PAUSE_S:
                raise _unreached(exc, bootstrap, timeout_s) from exc
            logger.info("could not read the swarm (attempt %d): %s; retrying", attempt, exc)
            time.sleep(_RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def _unreached(exc: DhtError, bootstrap: list[str], timeout_s: float) -> DhtError:
    """``exc`` as the user meets it: which bootstrap peers did not let the client in."""
    return DhtError(
        f"could not reach the swarm through its bootstrap peers ({', '.join(bootstrap)}) "
        f"within {timeout_s:g} s: {exc}"
    )


def _gather_once(
    bootstrap: list[str], swarm: str, *, timeout_s: float, swarm_key: SwarmKey | None
) -> dict[str, Any]:
    began = time.monotonic()
    client = status_client(bootstrap, swarm, timeout_s=timeout_s, swarm_key=swarm_key)
    started = time.monotonic()
    try:
        status = read_swarm(client, swarm, swarm_key=swarm_key)
    finally:
        client.close()
    # where a slow call's seconds went: the DHT daemon's start (and its bootstrap), the reads
    status["timing"]["start_s"] = round(started - began, 3)
    return status


def watch(
    bootstrap: list[str],
    swarm: str,
    emit: Callable[[dict[str, Any]], None],
    *,
    interval_s: float,
    timeout_s: float = 60.0,
    stop: Callable[[], bool] = lambda: False,
    swarm_key: SwarmKey | None = None,
) -> None:
    """Read the swarm every ``interval_s`` with one client, handing each reading to ``emit``,
    until ``stop()``. For a reading at a moment that matters (mid-run): a status call starts
    its own DHT daemon first (10-70 s under load on the testbed), and a short run had ended
    and taken its bootstrap node with it before a one-off call could read anything."""
    began = time.monotonic()
    client = status_client(bootstrap, swarm, timeout_s=timeout_s, swarm_key=swarm_key)
    start_s = round(time.monotonic() - began, 3)
    try:
        while not stop():
            read_at = time.monotonic()
            try:
                status = read_swarm(client, swarm, swarm_key=swarm_key)
            except DhtError as exc:  # one failed read; the next may work
                logger.warning("could not read the swarm: %s", exc)
            else:
                status["timing"]["start_s"] = start_s
                emit(status)
            time.sleep(max(0.0, interval_s - (time.monotonic() - read_at)))
    finally:
        client.close()


def status_client(
    bootstrap: list[str], swarm: str, *, timeout_s: float, swarm_key: SwarmKey | None = None
) -> DhtClient:
    """A started client-mode DHT client for ``read_swarm`` (the caller closes it). A private
    swarm's records are sealed: without its key the client's own validator refuses them."""
    config = DhtConfig(
        swarm=swarm,
        initial_peers=tuple(bootstrap),
        client_mode=True,
        start_timeout_s=timeout_s,
        record_tag_key=swarm_key.records.key_hex if swarm_key is not None else "",
    )
    return DhtClient(config).start()


def read_swarm(
    client: DhtClient, swarm: str, *, swarm_key: SwarmKey | None = None
) -> dict[str, Any]:
    """One read of the swarm's records and its most followed plan, described."""
    started = time.monotonic()
    directory = SwarmDirectory(
        client, swarm=swarm, peer_id="status", sign=_no_signing, auth=swarm_key
    )
    members = directory.members(include_leaving=True)
    now = time.time()
    votes = collections.Counter(m.adopted for m in members.values() if m.adopted)
    plan = None
    followed = followed_plan(votes)
    for epoch in acting_epochs(followed[1]) if followed else ():
        found = [p for p in directory.proposals(epoch) if p.digest == followed[0]]
        if found:
            plan = plan_from_json(found[0].plan)
            break
    status = describe(swarm, members, plan, votes, now=now, skipped=directory.skipped)
    status["timing"] = {"read_s": round(time.monotonic() - started, 3)}
    return status


def followed_plan(votes: collections.Counter) -> tuple[str, list[int]] | None:
    """The digest most members follow, and the epochs they adopted it at, newest first.

    Members adopt the same plan at different epochs (an epoch apart off loopback), so counting
    (epoch, digest) pairs split one plan's followers and often showed a newer plan that one
    node had adopted and nobody trained. Ties go to the plan adopted last."""
    by_digest: dict[str, list[int]] = {}
    for (epoch, digest), n in votes.items():
        by_digest.setdefault(digest, []).extend([epoch] * n)
    if not by_digest:
        return None
    digest = max(by_digest, key=lambda d: (len(by_digest[d]), max(by_digest[d]), d))
    return digest, sorted(set(by_digest[digest]), reverse=True)


def acting_epochs(adopted: list[int]) -> list[int]:
    """Where the proposals of plans adopted at these epochs are stored, newest first: a quiet
    node keeps following (and stamping) its plan every epoch but stores it again only in the
    epochs it acts in, the multiples of its stride (quiet.py), so each adopted epoch's last
    multiple of every stride is looked at too."""
    found: set[int] = set()
    for epoch in adopted:
        stride = 1
        while stride <= MAX_STRIDE:
            found.add(epoch - epoch % stride)
            stride *= 2
    return sorted(found, reverse=True)


def describe(swarm, members: dict[str, NodeInfo], plan, votes, *, now, skipped) -> dict[str, Any]:
    serving = {p for s in plan.stages for p in s.peers} if plan else set()
    result: dict[str, Any] = {
        "swarm": swarm,
        "peers": [
            {
                "peer_id": m.peer_id,
                "state": str(m.state),
                "stage": m.stage,
                "replica": m.training.replica if m.training else None,
                "step": m.training.step if m.training else None,
                "loss": m.training.loss if m.training else None,
                "eval": list(m.training.evaluation)
                if m.training and m.training.evaluation
                else None,
                "device": m.device.name,
                "kind": m.device.kind,
                "gflops": round(m.device.flops / 1e9, 2),
                "memory_gib": round(m.device.memory_bytes / 2**30, 2),
                "uplink_mb_s": round(m.uplink / 1e6, 2),
                "downlink_mb_s": round(m.downlink / 1e6, 2),
                "software": m.software,
                "observer": m.observer,
                "pace": m.pace,  # measured compute / what its device predicts (pace.py)
                "stretch": m.stretch,  # planned at: the swarm's own work / model (stretch.py)
                "reach": m.reach or "unknown",  # may peers dial it? (p2p/reachability.py)
                "record_age_s": round(max(0.0, now - m.time), 1),
                "addrs": list(m.addrs),
                # members whose relays it holds a slot on (peers dial it through them)
                "relays": [r for a in m.addrs if (r := relay_of(a))],
            }
            for m in sorted(members.values(), key=lambda m: m.peer_id)
        ],
        "links": [
            {
                "src": m.peer_id,
                "dst": link.peer,
                "mb_s": round(link.bandwidth / 1e6, 3),
                "rtt_ms": round(link.rtt * 1e3, 3),
                "age_s": round(link.age + max(0.0, now - m.time), 1),
                "relayed": link.relayed,  # measured through a relay, the path it takes
                "punched": link.punched,  # direct, on a lane punched through NATs
            }
            for m in sorted(members.values(), key=lambda m: m.peer_id)
            for link in m.links
        ],
        **_training(members),
        "suspected": _suspected(members, now),
        "plan": None,
        "plan_followers": {f"{e}:{d[:12]}": n for (e, d), n in votes.most_common()},
        "skipped_records": skipped,
    }
    if plan is not None:
        result["plan"] = _plan_summary(plan, members, serving)
    return result


def _plan_summary(plan, members: dict[str, NodeInfo], serving: set[str]) -> dict[str, Any]:
    """The agreed plan: digest, estimates, fences, stages, links and the backup pool."""
    return {
        "digest": plan.digest(),
        "estimated_step_time_s": plan.estimated_step_time,
        "bubble_fraction": plan.bubble_fraction,
        "fences": [list(f) for f in plan.fences],
        "stages": [
            {
                "index": s.index,
                "nodes": [s.start, s.stop],
                "first_node": s.node_ids[0],
                "last_node": s.node_ids[-1],
                "peers": list(s.peers),
                "memory_mib": [round(b / 2**20, 1) for b in s.memory_bytes],
            }
            for s in plan.stages
        ],
        "links": [
            {
                "after_stage": link.src_stage,
                "forward": f"{link.forward_codec} {link.forward_ratio:g}",
                "backward": f"{link.backward_codec} {link.backward_ratio:g}",
            }
            for link in plan.links
        ],
        "backup": sorted(
            p for p, m in members.items() if p not in serving and str(m.state) != "leaving"
        ),
    }


def _suspected(members: dict[str, NodeInfo], now: float) -> list[dict[str, Any]]:
    """Members some member waited for in vain (seating.py): who, why, by whom, for how long
    more, and whether that is enough to keep it out of plans now (records do not carry the
    swarm's --min-peers: a swarm that needs more members than the others seats it anyway)."""
    out = excluded(members, now=now)
    shown = []
    for peer, accused in sorted(accusations(members, now=now).items()):
        by = [{"peer_id": a.by, "reason": a.reason, "strikes": a.strikes,
               "left_s": round(a.until - now, 1)} for a in accused]  # fmt: skip
        shown.append({"peer_id": peer, "excluded": peer in out, "by": by})
    return shown


def _training(members: dict[str, NodeInfo]) -> dict[str, Any]:
    """The swarm's step (the furthest any node reports), that step's loss, and the newest
    validation (step, loss) any node reports."""
    progress = [m.training for m in members.values() if m.training is not None]
    if not progress:
        return {"step": None, "loss": None, "finished": False, "eval": None}
    newest = max(progress, key=lambda p: (p.step, p.loss is not None))
    evals = [p.evaluation for p in progress if p.evaluation is not None]
    return {
        "step": newest.step,
        "loss": newest.loss,
        "finished": any(p.finished for p in progress),
        "eval": list(max(evals)) if evals else None,
    }


def _suspect_lines(suspected: list[dict[str, Any]]) -> list[str]:
    lines = []
    for s in suspected:
        out = "kept out of plans" if s["excluded"] else "not enough to keep it out"
        lines.append(f"suspected {_short(s['peer_id'])} ({out}):")
        for a in s["by"]:
            lines.append(
                f"  by {_short(a['peer_id'])}: {a['reason']}, strike {a['strikes']}, "
                f"{a['left_s']:.0f} s left"
            )
    return lines


def _short(peer: str) -> str:
    return f"{peer[:6]}..{peer[-6:]}" if len(peer) > 14 else peer


def _peer_lines(peers: list[dict[str, Any]]) -> list[str]:
    """The members' table, then what is worth saying of some of them (pace, reach)."""
    lines = [
        f"  {'peer':<15} {'state':<8} {'stage':>5} {'device':<22} {'GFLOP/s':>8} "
        f"{'mem GiB':>8} {'up MB/s':>8} {'down MB/s':>9} {'age s':>6} {'reach':<9}"
    ]
    for p in peers:
        stage = "" if p["stage"] is None else str(p["stage"])
        state = "observer" if p.get("observer") else p["state"]
        lines.append(
            f"  {_short(p['peer_id']):<15} {state:<8} {stage:>5} {p['device'][:22]:<22} "
            f"{p['gflops']:>8.1f} {p['memory_gib']:>8.1f} {p['uplink_mb_s']:>8.1f} "
            f"{p['downlink_mb_s']:>9.1f} {p['record_age_s']:>6.1f} {p.get('reach', 'unknown'):<9}"
        )
    stretch = max((p.get("stretch", 0.0) for p in peers), default=0.0)
    if stretch > 1.0:
        lines.append(f"  steps take {stretch:.3g}x the cost model's time for the members' own "
                     "work (measured): planned so")  # fmt: skip
    for p in peers:
        if p.get("pace", 1.0) != 1.0:
            lines.append(f"  {_short(p['peer_id'])} computes {p['pace']:g}x slower than its "
                         "device: planned so")  # fmt: skip
    for p in peers:
        if p.get("reach") == "private":
            relays = ", ".join(_short(r) for r in p.get("relays", []))
            how = f"through the relays of {relays}" if relays else "only over connections it opens"
            lines.append(f"  {_short(p['peer_id'])}: no peer can dial it (NAT or firewall); it "
                         f"is reached {how}")  # fmt: skip
    return lines


def format_status(status: dict[str, Any]) -> str:
    lines = [f"swarm {status['swarm']}: {len(status['peers'])} peers"]
    if status.get("step") is not None:
        loss = "" if status["loss"] is None else f", loss {status['loss']:.4f}"
        done = " (finished)" if status.get("finished") else ""
        lines.append(f"training: step {status['step']}{loss}{done}")
    if status.get("eval") is not None:
        step, loss = status["eval"]
        lines.append(f"validation: loss {loss:.4f} at step {step} (held-out split)")
    lines.extend(_peer_lines(status["peers"]))
    lines.extend(_suspect_lines(status.get("suspected", [])))
    lines.append(f"measured links ({len(status['links'])}):")
    for link in status["links"]:
        lines.append(
            f"  {_short(link['src'])} -> {_short(link['dst'])}  {link['mb_s']:>9.2f} MB/s  "
            f"rtt {link['rtt_ms']:>7.2f} ms  age {link['age_s']:>5.1f} s" + _path(link)
        )
    plan = status["plan"]
    if plan is None:
        lines.append("plan: none agreed yet")
    else:
        lines.append(
            f"plan {plan['digest'][:12]}: est. step {plan['estimated_step_time_s']:.4g} s, "
            f"bubble {plan['bubble_fraction']:.0%}"
        )
        for i, fence in enumerate(plan["fences"]):
            lines.append(f"  fence {i}: {', '.join(_short(p) for p in fence)}")
        for s in plan["stages"]:
            lines.append(
                f"  stage {s['index']}: nodes {s['nodes'][0]}..{s['nodes'][1] - 1} "
                f"({s['first_node']} .. {s['last_node']}) on "
                f"{', '.join(_short(p) for p in s['peers'])}"
            )
        for link in plan["links"]:
            lines.append(
                f"  cut after stage {link['after_stage']}: forward {link['forward']}, "
                f"backward {link['backward']}"
            )
        backup = plan["backup"]
        lines.append(f"  backup: {', '.join(_short(p) for p in backup) if backup else 'none'}")
    if status["skipped_records"]:
        lines.append(f"skipped {status['skipped_records']} malformed records")
    return "\n".join(lines)


def _path(link: dict[str, Any]) -> str:
    """How the link's traffic goes, where it is not a plain dial: through a relay, or direct
    on a lane punched through both ends' NATs."""
    if link.get("relayed"):
        return "  relayed"
    return "  direct (punched)" if link.get("punched") else ""
