"""Stage checkpoints on disk (``checkpoints.py``): what a save gives back on load, what the
directory says it holds, what pruning keeps, and every way a file is refused (damaged bytes,
a foreign structure, code hidden in a pickle, non-finite state). One test kills a real
process between writing a checkpoint and renaming it into place.
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.training.checkpoints import (
    KEEP_STEPS,
    CheckpointError,
    CheckpointStore,
    DataCursor,
    StageState,
    file_name,
    state_digest,
)
from fusionllm.node.training.holdings import Holding


def _stage(step: int, start: int = 0, stop: int = 4, *, fill: float | None = None) -> StageState:
    generator = torch.Generator().manual_seed(1000 * step + 10 * start + stop)
    state = {
        "h.0.w": torch.randn(3 * 6 + 1, generator=generator),
        "h.0.b": torch.randn(3 * 2 + 1, generator=generator),
    }
    if fill is not None:
        state = {n: torch.full_like(t, fill) for n, t in state.items()}
    return StageState(Holding(step, start, stop), state, plan=f"plan-{step}")


def _assert_same(loaded: StageState, saved: StageState) -> None:
    assert loaded.holding == saved.holding
    assert loaded.plan == saved.plan
    assert sorted(loaded.state) == sorted(saved.state)
    for name, tensor in saved.state.items():
        assert torch.equal(loaded.state[name], tensor), name
    assert sorted(loaded.residuals) == sorted(saved.residuals)
    for key, tensor in saved.residuals.items():
        assert loaded.residuals[key].dtype == tensor.dtype
        assert torch.equal(loaded.residuals[key], tensor), key
    if saved.rng is None:
        assert loaded.rng is None
    else:
        assert torch.equal(loaded.rng, saved.rng)


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ----- save and load --------------------------------------------------------------------------


def test_a_saved_stage_loads_back_whole(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "lineage")  # created on the first save
    saved = _stage(7, 2, 5)
    saved.residuals = {
        "grad:0": torch.randn(11),
        "act:1": torch.randn(4, dtype=torch.float64),
        "tied:2": torch.arange(6, dtype=torch.float16),
    }
    saved.rng = torch.get_rng_state()
    path = store.save(saved)
    assert path == tmp_path / "lineage" / "s000000007-n2-5.pt"
    assert path.name == file_name(saved.holding)
    loaded = store.load(Holding(7, 2, 5))
    _assert_same(loaded, saved)
    assert loaded.digest() == saved.digest() == state_digest(saved.state)
    # A new store over the same directory (a restarted node) reads the same.
    _assert_same(CheckpointStore(tmp_path / "lineage").load(Holding(7, 2, 5)), saved)


def test_a_stage_without_rng_or_residuals_loads_back_without_them(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    saved = _stage(3)
    store.save(saved)
    loaded = store.load(saved.holding)
    assert loaded.rng is None
    assert loaded.residuals == {}
    _assert_same(loaded, saved)


def test_the_digest_covers_names_and_values() -> None:
    state = _stage(1).state
    same = {n: t.clone() for n, t in reversed(state.items())}
    assert state_digest(same) == state_digest(state)  # order of the dict does not matter
    renamed = {("x" + n): t for n, t in state.items()}
    assert state_digest(renamed) != state_digest(state)
    changed = dict(state)
    changed["h.0.b"] = state["h.0.b"].clone()
    changed["h.0.b"][0] += 1.0
    assert state_digest(changed) != state_digest(state)


def test_a_missing_checkpoint_is_a_checkpoint_error(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        CheckpointStore(tmp_path).load(Holding(1, 0, 4))


# ----- holdings and pruning -------------------------------------------------------------------


def test_holdings_come_from_file_names_newest_step_first(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.holdings() == []
    assert CheckpointStore(tmp_path / "absent").holdings() == []
    for step, start, stop in [(5, 4, 8), (9, 4, 8), (5, 0, 4), (9, 0, 4)]:
        store.save(_stage(step, start, stop))
    # Names that are not checkpoints, or name an empty range, are not holdings.
    for name in ["notes.txt", "s5-n0-4.pt", "s000000011-n4-4.pt", "s000000011-n0-4.pt.bak"]:
        (tmp_path / name).write_bytes(b"")
    assert store.holdings() == [
        Holding(9, 0, 4),
        Holding(9, 4, 8),
        Holding(5, 0, 4),
        Holding(5, 4, 8),
    ]


def test_prune_keeps_the_files_of_the_two_newest_steps_only(tmp_path) -> None:
    assert KEEP_STEPS == 2
    store = CheckpointStore(tmp_path)
    for step in (2, 4):
        for start, stop in [(0, 4), (4, 8), (8, 12)]:
            store.save(_stage(step, start, stop))
    assert len(store.holdings()) == 6  # two steps: nothing pruned yet
    store.save(_stage(6, 4, 8))  # a third step: every file of step 2 goes
    assert _names(tmp_path) == [
        "s000000004-n0-4.pt",
        "s000000004-n4-8.pt",
        "s000000004-n8-12.pt",
        "s000000006-n4-8.pt",
    ]
    _assert_same(store.load(Holding(4, 8, 12)), _stage(4, 8, 12))  # the kept files are whole
    store.save(_stage(8, 0, 4))
    assert [h.step for h in store.holdings()] == [8, 6]


def test_prune_removes_temp_files_older_than_a_minute_and_leaves_fresh_ones(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    stale = tmp_path / ".s000000003-n0-4.pt.old.tmp"
    fresh = tmp_path / ".s000000005-n0-4.pt.new.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"half a checkpoint")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    store.save(_stage(1))
    assert not stale.exists()
    assert fresh.exists()  # it may be another writer's file, still being written
    assert store.holdings() == [Holding(1, 0, 4)]


# ----- refused files ----------------------------------------------------------------------------


def test_a_file_whose_bytes_were_changed_is_refused(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    holding = _stage(4).holding
    path = store.save(_stage(4, fill=1.5))
    whole = path.read_bytes()
    # Change one byte inside the stored values (found by their bytes).
    at = whole.find(torch.full((7,), 1.5).numpy().tobytes())
    assert at > 0
    damaged = bytearray(whole)
    damaged[at + 1] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"digest|cannot read"):
        store.load(holding)
    # Cut short (a disk that lost its tail).
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        store.load(holding)
    path.write_bytes(whole)
    assert store.load(holding).holding == holding  # the same bytes, restored, load again


def test_state_that_does_not_match_its_stored_digest_is_refused(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    saved = _stage(4)
    path = store.save(saved)
    data = torch.load(path, weights_only=True)
    data["state"]["h.0.w"] = data["state"]["h.0.w"] + 1.0  # a readable file, other values
    torch.save(data, path)
    with pytest.raises(CheckpointError, match="digest"):
        store.load(saved.holding)


def test_a_file_holding_another_holding_than_its_name_is_refused(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_stage(4, 0, 4))
    path.rename(tmp_path / file_name(Holding(4, 4, 8)))
    with pytest.raises(CheckpointError, match="its name says"):
        store.load(Holding(4, 4, 8))


def _rewrite(path: Path, **changes) -> None:
    data = torch.load(path, weights_only=True)
    data.update(changes)
    torch.save(data, path)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"format": 1}, "not a format-3"),
        ({"extra": 1}, "not a format-3"),
        ({"data": {"position": 3}}, "malformed data cursor"),
        ({"scale": torch.tensor([3.0, 0.0], dtype=torch.float64)}, "power of two"),
        ({"scale": torch.tensor([2.0**16, -2.0], dtype=torch.float64)}, "good steps"),
        ({"scale": torch.zeros(3, dtype=torch.float64)}, "malformed loss scale"),
        ({"data": {"position": -1, "digest": "ab"}}, "bad data cursor"),
        ({"state": {"h.0.w": [1.0, 2.0]}}, "malformed tensor table"),
        ({"residuals": {3: torch.zeros(2)}}, "malformed tensor table"),
        ({"state": {"h.0.w": torch.zeros(3, 3)}}, "flat float32"),
        ({"state": {"h.0.w": torch.zeros(9, dtype=torch.float64)}}, "flat float32"),
        ({"step": -3}, "bad step or node range"),
        ({"start": 4, "stop": 4}, "bad step or node range"),
        ({"stop": "four"}, "bad step or node range"),
        ({"step": torch.tensor([4, 5])}, "bad step or node range"),
        # Foreign values past the first checks: still a CheckpointError, not a crash.
        ({"rng": 7}, "not a stage checkpoint"),
        ({"format": torch.tensor([1, 1])}, "not a stage checkpoint"),
    ],
)
def test_a_file_with_a_foreign_structure_is_refused(tmp_path, changes, why) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_stage(4))
    _rewrite(path, **changes)
    with pytest.raises(CheckpointError, match=why):
        store.load(Holding(4, 0, 4))


def test_the_loss_scale_is_saved_with_the_step_and_read_alone(tmp_path) -> None:
    """fp16's loss scale (the same on every stage) travels with the state of its step;
    ``scale_of`` reads it from the file without loading the parameters (a READY says it)."""
    store = CheckpointStore(tmp_path)
    stage = _stage(4)
    stage.scale = ScaleState(2.0**19, 1234)
    store.save(stage)
    store.save(_stage(5))  # fp32/bf16: no scale
    assert store.load(Holding(4, 0, 4)).scale == ScaleState(2.0**19, 1234)
    assert store.scale_of(Holding(4, 0, 4)) == ScaleState(2.0**19, 1234)
    assert store.load(Holding(5, 0, 4)).scale is None
    assert store.scale_of(Holding(5, 0, 4)) is None
    assert store.scale_of(Holding(9, 0, 4)) is None  # no such file


def test_a_format_2_file_loads_without_a_loss_scale(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(_stage(4))
    data = torch.load(path, weights_only=True)
    del data["scale"]
    data["format"] = 2
    torch.save(data, path)
    assert store.load(Holding(4, 0, 4)).scale is None


def test_a_plain_list_saved_under_a_checkpoint_name_is_refused(tmp_path) -> None:
    torch.save([1, 2, 3], tmp_path / file_name(Holding(2, 0, 4)))
    with pytest.raises(CheckpointError, match="not a format-3"):
        CheckpointStore(tmp_path).load(Holding(2, 0, 4))


def _plant(path: str) -> str:
    Path(path).write_text("code ran")
    return "planted"


class _Payload:
    """Unpickling this calls ``_plant``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_plant, (str(self.marker),))


def test_a_pickled_object_in_a_checkpoint_is_refused_without_running_its_code(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "store")
    path = store.save(_stage(4))
    marker = tmp_path / "marker"
    _rewrite(path, plan=_Payload(marker))
    with pytest.raises(CheckpointError, match="cannot read"):
        store.load(Holding(4, 0, 4))
    assert not marker.exists()
    # The payload is live: a plain (unsafe) load runs it. This is what weights_only prevents.
    assert torch.load(path, weights_only=False)["plan"] == "planted"
    assert marker.read_text() == "code ran"


def test_non_finite_state_is_refused_on_load(tmp_path) -> None:
    store = CheckpointStore(tmp_path)
    for step, bad in [(1, float("nan")), (2, float("inf")), (3, -float("inf"))]:
        stage = _stage(step)
        stage.state["h.0.b"][3] = bad
        store.save(stage)
        with pytest.raises(CheckpointError, match="non-finite"):
            store.load(stage.holding)


# ----- a crash between write and rename -------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from fusionllm.node.training.checkpoints import CheckpointStore, StageState
    from fusionllm.node.training.holdings import Holding

    directory = Path(sys.argv[1])

    def stage(step):
        state = {"w": torch.full((13,), float(step)), "b": torch.arange(7.0) + step}
        return StageState(Holding(step, 0, 4), state, plan=f"plan-{step}")

    CheckpointStore(directory).save(stage(4))
    print("saved 4", flush=True)
    store = CheckpointStore(directory, pause_before_rename_s=30)
    print("writing", flush=True)
    store.save(stage(8))
    print("renamed", flush=True)
    """
)
_CRASH_WAIT_S = 20.0  # the child sleeps 30 s before its rename: the test must be done by then


def _lines_of(process: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return lines


def _next_line(lines: queue.Queue, deadline: float) -> str:
    try:
        return lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise AssertionError("the child said nothing in time") from None


def test_a_process_killed_between_write_and_rename_leaves_the_previous_checkpoint(
    tmp_path,
) -> None:
    directory = tmp_path / "lineage"
    process = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + _CRASH_WAIT_S
        lines = _lines_of(process)
        assert _next_line(lines, deadline) == "saved 4"
        assert _next_line(lines, deadline) == "writing"
        # Wait until the step-8 temp file is whole (it loads): the child now sleeps before
        # its rename, which is where it dies.
        temp = None
        while temp is None:
            assert time.monotonic() < deadline, "the step-8 temp file never became whole"
            assert process.poll() is None, "the child ended before its rename"
            for candidate in directory.glob(".s000000008-n0-4.pt.*.tmp"):
                try:
                    torch.load(candidate, weights_only=True)
                    temp = candidate
                except Exception:  # still being written
                    pass
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=5) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=5)
        process.stdout.close()

    store = CheckpointStore(directory)
    assert store.holdings() == [Holding(4, 0, 4)]
    loaded = store.load(Holding(4, 0, 4))
    assert loaded.plan == "plan-4"
    assert torch.equal(loaded.state["w"], torch.full((13,), 4.0))
    assert torch.equal(loaded.state["b"], torch.arange(7.0) + 4)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        store.load(Holding(8, 0, 4))
    # The temp file is left behind, and ignored: the next save neither lists nor removes it
    # (it is too fresh to be known stale), and the step after it is written as usual.
    assert temp.exists()
    store.save(StageState(Holding(12, 0, 4), {"w": torch.ones(13)}))
    assert temp.exists()
    assert store.holdings() == [Holding(12, 0, 4), Holding(4, 0, 4)]


def test_the_data_cursor_round_trips_and_a_resume_reads_on_from_it(tmp_path) -> None:
    """A stage checkpointed at step k records where the run stands in the data; a fresh
    process (a restarted node) that loads it reads on from there: the samples before and after
    are exactly one uninterrupted run's, none repeated within a pass, none skipped."""
    from fusionllm.node.pipeline.data import BatchConfig, TokenDataset

    config = BatchConfig(batch_size=2, seq_len=16, seed=3, micro_batches=4)
    data = TokenDataset.from_stdlib(max_bytes=32 << 10)

    def read(dataset: TokenDataset, steps: range) -> list[int]:
        return [w for s in steps for mb in range(4) for w in dataset.samples(config, s, mb)]

    straight = read(data, range(60))
    k = 23
    stage = _stage(k)
    stage.data = DataCursor(data.sampler(config).position(k), data.digest)
    CheckpointStore(tmp_path).save(stage)

    restarted = TokenDataset.from_stdlib(max_bytes=32 << 10)
    loaded = CheckpointStore(tmp_path).load(Holding(k, 0, 4))
    assert loaded.data == DataCursor(k * 8, restarted.digest)
    resume_at, rest = divmod(loaded.data.position, config.batch_size * config.micro_batches)
    assert (resume_at, rest) == (k, 0)
    assert read(data, range(k)) + read(restarted, range(resume_at, 60)) == straight
    assert len(set(straight)) == len(straight) == 480  # all within the first pass (2,027 windows)


def test_a_file_whose_data_cursor_is_not_its_steps_is_refused(tmp_path) -> None:
    digest = "ab" * 32
    stage = _stage(5)
    stage.data = DataCursor(5 * 8, digest)
    CheckpointStore(tmp_path).save(stage)
    assert CheckpointStore(tmp_path, data=(8, digest)).load(Holding(5, 0, 4)).data == stage.data
    assert CheckpointStore(tmp_path, data=(8, "")).load(Holding(5, 0, 4)).data == stage.data
    with pytest.raises(CheckpointError, match=r"stands at sample 40 .* is at sample 30"):
        CheckpointStore(tmp_path, data=(6, digest)).load(Holding(5, 0, 4))
    with pytest.raises(CheckpointError, match="of data abababababababab"):
        CheckpointStore(tmp_path, data=(8, "cd" * 32)).load(Holding(5, 0, 4))
    stage.data = None  # a copy a peer sent: its step is its place in the data
    CheckpointStore(tmp_path).save(stage)
    assert CheckpointStore(tmp_path, data=(6, digest)).load(Holding(5, 0, 4)).data is None
