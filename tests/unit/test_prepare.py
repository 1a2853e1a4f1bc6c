"""fusionllm prepare: text and .jsonl into shards + manifest, read back as a corpus."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from fusionllm.data import prepare as prepare_module
from fusionllm.data.corpus import load_corpus, load_prepared
from fusionllm.data.manifest import MANIFEST, DataError, read_manifest
from fusionllm.data.prepare import PrepareConfig, prepare
from fusionllm.node.cli.main import main
from tests.support.bpe import train_bpe

TEXT = "def f(x):\n    return x + 1\n" * 40 + "último\n"
RECORDS = [{"text": "first document"}, {"text": "second, with ünïcode"}]


@pytest.fixture
def inputs(tmp_path):
    text = tmp_path / "code.py"
    text.write_text(TEXT, encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return text, jsonl


def _bpe(tmp_path, vocab: int = 400):
    tokenizer = train_bpe([TEXT, *(r["text"] for r in RECORDS)] * 5, vocab)
    path = tmp_path / "tok"
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    return tokenizer, path


def test_bytes_round_trip_through_shards(tmp_path, inputs) -> None:
    seen = []
    config = PrepareConfig(inputs=inputs, out=tmp_path / "out", shard_tokens=100, chunk_bytes=64)
    manifest = prepare(config, progress=seen.append)
    expected = (TEXT + "\n" + "".join(r["text"] + "\n" for r in RECORDS)).encode()
    assert sum(seen) == sum(p.stat().st_size for p in inputs)
    assert (manifest.dtype, manifest.vocab_size, manifest.tokenizer) == ("uint16", 256, "bytes")
    assert manifest.tokens == len(expected)
    assert [s.tokens for s in manifest.shards[:-1]] == [100] * (len(manifest.shards) - 1)
    corpus = load_prepared(tmp_path / "out")
    assert corpus.store.read(0, len(corpus)).astype(np.uint8).tobytes() == expected
    assert corpus.digest == manifest.digest == read_manifest(tmp_path / "out").digest
    # The same tokens as one flat file digest alike (load_corpus picks the loader by path).
    flat = tmp_path / "flat.bin"
    np.frombuffer(expected, dtype=np.uint8).astype("<u2").tofile(flat)
    assert load_corpus(flat).digest == manifest.digest


def test_a_tokenizer_json_gives_its_ids_and_end_of_text(tmp_path, inputs) -> None:
    tokenizer, path = _bpe(tmp_path)
    manifest = prepare(PrepareConfig(inputs=inputs, out=tmp_path / "out", tokenizer=path))
    eot = tokenizer.token_to_id("<|endoftext|>")
    expected = [*tokenizer.encode(TEXT).ids, eot]
    for record in RECORDS:
        expected += [*tokenizer.encode(record["text"]).ids, eot]
    corpus = load_prepared(tmp_path / "out")
    assert corpus.store.read(0, len(corpus)).tolist() == expected
    assert manifest.vocab_size == tokenizer.get_vocab_size() == corpus.vocab_size
    assert manifest.tokenizer.startswith("tokenizer.json sha256:")


def test_a_vocabulary_over_uint16_is_stored_as_uint32(tmp_path, inputs) -> None:
    words = {f"w{i}": i for i in range(70_000)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="w69999"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    doc = tmp_path / "doc.txt"
    doc.write_text("w1 w65536 w69998 nope\n")
    manifest = prepare(
        PrepareConfig(inputs=(doc,), out=tmp_path / "out", tokenizer=tmp_path / "big.json")
    )
    assert manifest.dtype == "uint32"
    corpus = load_prepared(tmp_path / "out")
    assert corpus.store.read(0, len(corpus)).tolist() == [1, 65536, 69998, 69999]


def test_text_is_streamed_a_chunk_at_a_time(tmp_path) -> None:
    big = tmp_path / "big.txt"
    big.write_text("a line of text\n" * 2000)
    pieces = list(prepare_module._documents(big, 256))
    assert max(len(text) for text, _, _ in pieces) <= 256 + len("a line of text\n")
    assert b"".join(text for text, _, _ in pieces) == big.read_bytes()
    assert sum(consumed for _, consumed, _ in pieces) == big.stat().st_size


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b"{not json\n", r"docs\.jsonl:2: not JSON"),
        (b'{"body": "x"}\n', r"docs\.jsonl:2: expected an object with a string 'text'"),
        (b'["text"]\n', r"docs\.jsonl:2: expected an object"),
    ],
)
def test_a_bad_record_stops_it_and_leaves_no_shard(tmp_path, bad_line, message) -> None:
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n' + bad_line + b'{"text": "after"}\n')
    first = tmp_path / "first.txt"
    first.write_text("x" * 500)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=message):
        prepare(PrepareConfig(inputs=(first, jsonl), out=out, shard_tokens=100))
    assert list(out.iterdir()) == []


def test_text_a_tokenizer_cannot_read_is_refused_cleanly(tmp_path, inputs) -> None:
    _, path = _bpe(tmp_path)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"fine\n\xff\xfe\x00 broken\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"blob\.txt: not UTF-8"):
        prepare(PrepareConfig(inputs=(inputs[0], binary), out=out, tokenizer=path, shard_tokens=8))
    assert list(out.iterdir()) == []
    # Byte-level takes any bytes.
    manifest = prepare(PrepareConfig(inputs=(binary,), out=out))
    assert manifest.tokens == binary.stat().st_size + 1


def test_inputs_and_out_are_checked_before_anything_is_written(tmp_path, inputs) -> None:
    with pytest.raises(DataError, match=r"missing\.txt is not a readable file"):
        prepare(PrepareConfig(inputs=(inputs[0], tmp_path / "missing.txt"), out=tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    with pytest.raises(DataError, match="is not a readable file"):
        prepare(PrepareConfig(inputs=(tmp_path,), out=tmp_path / "o"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep me")
    with pytest.raises(DataError, match="not an empty directory"):
        prepare(PrepareConfig(inputs=inputs, out=tmp_path / "used"))
    with pytest.raises(DataError, match=r"not a tokenizers tokenizer\.json"):
        prepare(PrepareConfig(inputs=inputs, out=tmp_path / "o", tokenizer=inputs[0]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="hold no text"):
        prepare(PrepareConfig(inputs=(empty,), out=tmp_path / "o"))


def test_a_tampered_directory_is_refused(tmp_path, inputs) -> None:
    out = tmp_path / "out"
    prepare(PrepareConfig(inputs=inputs, out=out, shard_tokens=100))
    with pytest.raises(DataError, match="holds uint16 tokens, not uint32"):
        load_corpus(out, dtype="uint32")
    shard = out / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="digest does not match"):
        load_prepared(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="its manifest says 100"):
        load_prepared(out)
    body = json.loads((out / MANIFEST).read_text())
    body["shards"][0]["file"] = "../escape.bin"
    (out / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(DataError, match="bad shard file name"):
        load_prepared(out)


def test_the_command_line(tmp_path, inputs, capsys) -> None:
    out = tmp_path / "out"
    assert main(["prepare", *map(str, inputs), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["digest"] == load_prepared(out).digest
    assert main(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o2")]) == 1
    assert "nope.txt is not a readable file" in capsys.readouterr().err
