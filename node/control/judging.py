"""Which plan proposals of an epoch a node believes: the judgement ``adopt`` and the
convergence to the majority's plan both make, on one view of the swarm."""

import logging

from fusionllm.dht.records import PlanProposal, RecordError
from fusionllm.node.control.agreement import (
    Candidate,
    CheckedPlans,
    EpochView,
    NotAMemberError,
    check_proposal,
)
from fusionllm.node.control.audit import AuditLimits

logger = logging.getLogger(__name__)


def judge(
    view: EpochView, proposals: list[PlanProposal], *, followed: set[str], limits: AuditLimits
) -> tuple[list[Candidate], dict[str, Candidate], list[str]]:
    """(the proposals we believe, every digest we could follow if the majority did, why
    each refused one was: "not_members", "overclaimed" or "" for any other fault).

    A plan the swarm already follows (``followed``) is held to the figures no bandwidth
    view changes; any other plan to every figure (see audit.py)."""
    believed: list[Candidate] = []
    acceptable: dict[str, Candidate] = {}
    refused: list[str] = []
    checked: CheckedPlans = {}
    for proposal in proposals:
        try:
            candidate = check_proposal(proposal, view, checked=checked)
        except RecordError as exc:
            refused.append("not_members" if isinstance(exc, NotAMemberError) else "")
            logger.info("epoch %d: refused a proposal: %s", view.epoch, exc)
            continue
        consistent = candidate.consistent(limits)
        if consistent:
            acceptable.setdefault(candidate.digest, candidate)
        ok = (
            consistent
            if candidate.digest in followed
            else (consistent and candidate.believable(limits))
        )
        if not ok:
            refused.append("overclaimed")
            logger.info("epoch %d: refused a proposal from %s...: %s",
                        view.epoch, proposal.proposer[:16], candidate.audit)  # fmt: skip
            continue
        believed.append(candidate)
    return believed, acceptable, refused
