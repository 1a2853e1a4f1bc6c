"""Corpora: shards read as one sequence, digests from the tokens, the stdlib default."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.data.corpus import TokenStore, load_corpus, load_stdlib
from fusionllm.data.manifest import DataError


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    data=st.data(),
)
def test_shards_read_as_one_sequence(sizes, data) -> None:
    parts = [
        np.arange(sum(sizes[:i]), sum(sizes[: i + 1]), dtype=np.uint16) for i in range(len(sizes))
    ]
    whole = np.concatenate(parts)
    store = TokenStore(parts)
    start = data.draw(st.integers(0, len(whole)))
    stop = data.draw(st.integers(start, len(whole)))
    assert store.read(start, stop).tolist() == whole[start:stop].tolist()
    with pytest.raises(IndexError):
        store.read(0, len(whole) + 1)


def test_the_stdlib_digest_follows_the_bytes(tmp_path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = load_stdlib(root=tmp_path)
    assert load_stdlib(root=tmp_path).digest == first.digest
    (tmp_path / "b.py").write_text("y = 3\n")  # one byte differs: another Python's stdlib
    assert load_stdlib(root=tmp_path).digest != first.digest
    assert load_stdlib(root=tmp_path, max_bytes=6).digest != first.digest
    default = load_corpus(None)
    assert (default.vocab_size, default.dtype, len(default)) == (256, "uint8", 2 << 20)


def test_the_dtype_is_part_of_the_digest(tmp_path) -> None:
    ids = np.arange(300, dtype=np.uint32)
    ids.astype("<u2").tofile(tmp_path / "a16.bin")
    ids.astype("<u4").tofile(tmp_path / "a32.bin")
    narrow = load_corpus(tmp_path / "a16.bin")
    wide = load_corpus(tmp_path / "a32.bin", dtype="uint32")
    assert narrow.store.read(0, 300).tolist() == wide.store.read(0, 300).tolist()
    assert narrow.digest != wide.digest
    with pytest.raises(DataError, match="the stdlib text is bytes"):
        load_corpus(None, vocab_size=300)
