"""Training batches: stdlib bytes and token files, windows named by the sampler."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.data import BatchConfig, DataError, TokenDataset, stdlib_source_files

CONFIG = BatchConfig(batch_size=3, seq_len=8, seed=5, micro_batches=4)


@pytest.fixture(scope="module")
def stdlib() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=64 << 10)


def test_stdlib_text_is_the_sorted_source_bytes(stdlib) -> None:
    files = stdlib_source_files()
    assert files, "the stdlib has Python sources"
    assert not any("site-packages" in p.parts for p in files)
    assert len(stdlib) == 64 << 10
    expected = b"".join(p.read_bytes() for p in files[:40])[: 64 << 10]
    assert stdlib.tokens.tobytes() == expected
    assert stdlib.vocab_size == 256
    assert str(Path(sysconfig.get_paths()["stdlib"])) in stdlib.source


def test_stdlib_with_no_sources_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not python")
    with pytest.raises(DataError, match="no Python source files"):
        TokenDataset.from_stdlib(root=tmp_path)


def test_batches_are_the_sampled_windows_shifted(stdlib) -> None:
    idx, targets = stdlib.batch(CONFIG, step=2, micro_batch=1)
    assert idx.shape == targets.shape == (3, 8)
    assert idx.dtype == targets.dtype == torch.int64
    torch.testing.assert_close(idx[:, 1:], targets[:, :-1])
    text = stdlib.tokens
    for window, row, target in zip(
        stdlib.samples(CONFIG, 2, 1), idx.tolist(), targets.tolist(), strict=True
    ):
        assert row + target[-1:] == text[window * 8 : window * 8 + 9].tolist()


def test_batches_depend_only_on_seed_step_and_micro_batch(stdlib) -> None:
    again = TokenDataset.from_stdlib(max_bytes=64 << 10)
    for step, mb in [(0, 0), (7, 3)]:
        a = stdlib.batch(CONFIG, step, mb)
        b = again.batch(CONFIG, step, mb)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    first = stdlib.batch(CONFIG, 0, 0)[0]
    assert not torch.equal(first, stdlib.batch(CONFIG, 1, 0)[0])
    assert not torch.equal(first, stdlib.batch(CONFIG, 0, 1)[0])
    other_seed = BatchConfig(batch_size=3, seq_len=8, seed=6, micro_batches=4)
    assert not torch.equal(first, stdlib.batch(other_seed, 0, 0)[0])


def test_eval_batches_come_from_the_held_out_tail(stdlib) -> None:
    sampler = stdlib.sampler(CONFIG)
    idx, targets = stdlib.eval_batch(CONFIG, 0)
    assert idx.shape == targets.shape == (3, 8)
    start = sampler.train_windows * 8
    assert idx[0].tolist() == stdlib.tokens[start : start + 8].tolist()
    trained = {w for step in range(50) for mb in range(4) for w in stdlib.samples(CONFIG, step, mb)}
    assert max(trained) < sampler.train_windows


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype) -> None:
    ids = np.arange(1000, dtype=dtype) % 500
    path = tmp_path / "train.bin"
    ids.tofile(path)
    data = TokenDataset.from_file(path, dtype=dtype, vocab_size=500)
    assert len(data) == 1000
    idx, targets = data.batch(CONFIG, 0, 0)
    assert int(idx.max()) < 500
    assert torch.equal((idx[:, 0] + 1) % 500, targets[:, 0])
    assert TokenDataset.from_file(path, dtype=dtype).vocab_size == 500  # largest id + 1


def test_token_file_errors(tmp_path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="multiple of 2"):
        TokenDataset.from_file(odd)
    with pytest.raises(DataError, match="cannot read"):
        TokenDataset.from_file(tmp_path / "missing.bin")
    with pytest.raises(DataError, match="dtype"):
        TokenDataset.from_file(odd, dtype="int8")
    big = tmp_path / "big.bin"
    np.full(100, 300, dtype=np.uint16).tofile(big)
    with pytest.raises(DataError, match="token id 300 >= vocab_size 256"):
        TokenDataset.from_file(big, vocab_size=256)
    short = tmp_path / "short.bin"
    np.zeros(20, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError, match="fewer than one step's 12 sequences"):
        TokenDataset.from_file(short).batch(CONFIG, 0, 0)


def test_batch_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        BatchConfig(batch_size=0, seq_len=8)
    with pytest.raises(ConfigError, match="seq_len"):
        BatchConfig(batch_size=1, seq_len=0)
    with pytest.raises(ConfigError, match="micro_batches"):
        BatchConfig(batch_size=1, seq_len=1, micro_batches=0)
    with pytest.raises(ConfigError, match="seed"):
        BatchConfig(batch_size=1, seq_len=1, seed=-1)


def test_a_node_refuses_data_that_is_not_the_runs(tmp_path) -> None:
    """The run names its data by digest; a node whose file changed since it started (or was
    swapped) refuses to build its workload rather than train on other tokens."""
    from fusionllm.common.run_spec import RunSpec
    from fusionllm.node.swarm_training import build_workload

    path = tmp_path / "tokens.bin"
    (np.arange(5000) % 256).astype("<u2").tofile(path)
    pinned = TokenDataset.from_file(path)
    run = RunSpec(seq_len=16, data_digest=pinned.digest, vocab_size=256)
    graph, dataset = build_workload(run, path)
    assert dataset.digest == pinned.digest
    assert graph.node_ids
    (np.arange(5000) % 255).astype("<u2").tofile(path)
    with pytest.raises(DataError, match="changed since this node started"):
        build_workload(run, path)
