"""Stage checkpoints on disk: written atomically, read without running code, the last two kept.

One file per (step, node range): ``s{step:09d}-n{start}-{stop}.pt`` in a directory per run
lineage (``RunSpec.lineage``), so a node never mistakes another run's state for this one's and
the holdings can be listed from names alone. The file is ``torch.save`` of plain tensors,
numbers and strings, loaded with ``weights_only=True`` (no pickle code runs), and written by
``write_atomic``: a node killed while writing leaves the previous files whole. A content digest
over the parameter states is stored and checked on load (a copy received from a peer is checked
against the sender's digest before it is kept). A stage's own checkpoint also records the
data cursor (``DataCursor``: samples the run read before the step, and the corpus digest),
so a file says where in the data its state stands, and (fp16 runs) the loss scale of the step
(``ScaleState``, the same on every stage), which ``scale_of`` reads without loading the rest.
"""

import hashlib
import io
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.training.holdings import Holding

logger = get_logger(__name__)

FORMAT = 3  # 3 added "scale"; format 2 files (no scale) still load
_KEYS = frozenset(
    {"format", "step", "start", "stop", "plan", "digest", "state", "residuals", "rng", "data"}
)
KEEP_STEPS = 2  # files of the newest two checkpointed steps stay; older ones are removed
_NAME = re.compile(r"^s(\d{9})-n(\d+)-(\d+)\.pt$")


class CheckpointError(FusionError):
    """A checkpoint file (or a received copy) is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class DataCursor:
    position: int  # samples the run read before the checkpoint's step (Sampler.position)
    digest: str  # the corpus's (RunSpec.data_digest)

    def __post_init__(self) -> None:
        if not isinstance(self.position, int) or isinstance(self.position, bool):
            raise CheckpointError(f"data position must be an integer, got {self.position!r}")
        if self.position < 0 or not isinstance(self.digest, str) or len(self.digest) > 64:
            raise CheckpointError(f"bad data cursor ({self.position!r}, {self.digest!r})")


@dataclass
class StageState:
    """A stage's state before ``holding.step``: what a checkpoint holds."""

    holding: Holding
    state: dict[str, torch.Tensor]  # canonical name -> (3 * numel + 1,) float32 (export_state)
    plan: str = ""  # digest of the plan the stage ran
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)  # error feedback, by key
    rng: torch.Tensor | None = None  # torch's CPU generator state (uint8)
    data: DataCursor | None = None  # own checkpoints; a copy's position is its step's
    scale: ScaleState | None = None  # fp16's loss scale before ``holding.step``

    def digest(self) -> str:
        return state_digest(self.state)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of every parameter state, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def file_name(holding: Holding) -> str:
    return f"s{holding.step:09d}-n{holding.start}-{holding.stop}.pt"


class CheckpointStore:
    """The checkpoints of one run lineage in one directory."""

    def __init__(
        self,
        directory: Path,
        *,
        pause_before_rename_s: float = 0.0,
        data: tuple[int, str] | None = None,
    ) -> None:
        """``data``: (the run's global batch, its data digest or "" if unpinned): a file whose
        data cursor says another place in the data than its step's is refused on load."""
        self.directory = Path(directory)
        self.pause_before_rename_s = pause_before_rename_s
        self.data = data

    def holdings(self) -> list[Holding]:
        """What the directory holds, newest step first (by file name; loading checks more)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                step, start, stop = (int(g) for g in match.groups())
                if start < stop:
                    found.append(Holding(step, start, stop))
        return sorted(found, key=lambda h: (-h.step, h.start, h.stop))

    def save(self, stage: StageState) -> Path:
        """Write ``stage`` atomically, then remove files of steps older than the newest two."""
        buffer = io.BytesIO()
        torch.save(_to_file(stage), buffer)
        pause = self.pause_before_rename_s
        path = write_atomic(
            self.directory / file_name(stage.holding),
            buffer.getvalue(),
            before_rename=(lambda: time.sleep(pause)) if pause > 0 else None,
        )
        self.prune()
        return path

    def load(self, holding: Holding) -> StageState:
        path = self.directory / file_name(holding)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint {path}") from None
        except Exception as exc:  # torch raises many kinds on a damaged or foreign file
            raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
        try:
            stage = _from_file(data, path)
        except CheckpointError:
            raise
        except Exception as exc:  # a foreign value past its checks (rng = 7, format = [1, 1])
            raise CheckpointError(f"{path} is not a stage checkpoint: {exc}") from exc
        if stage.holding != holding:
            raise CheckpointError(f"{path} holds {stage.holding}, its name says {holding}")
        self._check_cursor(path, stage)
        return stage

    def scale_of(self, holding: Holding) -> ScaleState | None:
        """The loss scale a file holds, read without its parameters (mapped, not loaded);
        None for none (fp32/bf16 runs, format 2) or a file that cannot say (``load`` will
        refuse it)."""
        path = self.directory / file_name(holding)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return _scale(data.get("scale"), path) if isinstance(data, dict) else None
        except Exception as exc:  # a damaged or foreign file: no scale from it
            logger.debug("no loss scale from %s: %s", path, exc)
            return None

    def _check_cursor(self, path: Path, stage: StageState) -> None:
        if self.data is None or stage.data is None:
            return
        batch, digest = self.data
        at, expected = stage.data, stage.holding.step * batch
        if at.position != expected or (digest and at.digest != digest):
            raise CheckpointError(
                f"{path} stands at sample {at.position} of data {at.digest[:16]}; its step "
                f"is at sample {expected} of {digest[:16] or 'this run'}"
            )

    def prune(self) -> None:
        held = self.holdings()
        keep = sorted({h.step for h in held}, reverse=True)[:KEEP_STEPS]
        for holding in held:
            if holding.step not in keep:
                (self.directory / file_name(holding)).unlink(missing_ok=True)
        for stale in self.directory.glob(".*.tmp"):  # left by a crash between write and rename
            if time.time() - stale.stat().st_mtime > 60:
                stale.unlink(missing_ok=True)


def _to_file(stage: StageState) -> dict:
    h, d = stage.holding, stage.data
    return {
        "format": FORMAT,
        "step": h.step,
        "start": h.start,
        "stop": h.stop,
        "plan": stage.plan,
        "digest": stage.digest(),
        "state": {n: t.detach().to(torch.float32).contiguous() for n, t in stage.state.items()},
        "residuals": {k: t.detach().contiguous() for k, t in stage.residuals.items()},
        "rng": stage.rng if stage.rng is not None else torch.zeros(0, dtype=torch.uint8),
        "data": {} if stage.data is None else {"position": d.position, "digest": d.digest},
        "scale": torch.tensor(stage.scale or (), dtype=torch.float64),  # (2,) or (0,)
    }


def _from_file(data: object, path: Path) -> StageState:
    if not isinstance(data, dict) or (data.get("format"), set(data)) not in (
        (2, _KEYS),
        (FORMAT, _KEYS | {"scale"}),
    ):
        raise CheckpointError(f"{path} is not a format-{FORMAT} stage checkpoint")
    state, residuals = data["state"], data["residuals"]
    for table in (state, residuals):
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in table.items()
        ):
            raise CheckpointError(f"{path}: malformed tensor table")
    if not all(v.dtype == torch.float32 and v.dim() == 1 for v in state.values()):
        raise CheckpointError(f"{path}: parameter states must be flat float32")
    if not all(bool(torch.isfinite(v).all()) for v in state.values()):
        raise CheckpointError(f"{path}: non-finite parameter state")
    try:
        holding = Holding(int(data["step"]), int(data["start"]), int(data["stop"]))
    except (TypeError, ValueError, FusionError) as exc:
        raise CheckpointError(f"{path}: bad step or node range: {exc}") from exc
    cursor = data["data"]
    if not isinstance(cursor, dict) or set(cursor) not in (set(), {"position", "digest"}):
        raise CheckpointError(f"{path}: malformed data cursor")
    stage = StageState(
        holding,
        state,
        str(data["plan"]),
        residuals,
        data["rng"] if data["rng"].numel() else None,
        DataCursor(cursor["position"], cursor["digest"]) if cursor else None,
        _scale(data.get("scale"), path),
    )
    if stage.digest() != data["digest"]:
        raise CheckpointError(f"{path}: content does not match its digest")
    return stage


def _scale(value: object, path: Path) -> ScaleState | None:
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return None
    if not isinstance(value, torch.Tensor) or value.shape != (2,):
        raise CheckpointError(f"{path}: malformed loss scale")
    try:
        return ScaleState.checked(*value.tolist())
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
