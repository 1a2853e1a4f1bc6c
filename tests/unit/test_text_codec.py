"""TextCodec: tokenizer.json or bytes, incremental decoding, eos ids, chat formats, refusals."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.node.serve import text as text_module
from fusionllm.node.serve.chat import ChatMessage
from fusionllm.node.serve.text import MAX_HELD_IDS, TextCodec, TextCodecError
from tests.support.bpe import train_sentencepiece_bpe
from tests.support.text_models import TEXTS, VOCAB, write_tokenizer

SAMPLES = ["plain ascii", "Grüße, naïve café", "日本語 🚀☃", "tabs\tand\nnewlines", TEXTS[1]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": 0}))
    return TextCodec.from_model_folder(folder)


def _stream(codec: TextCodec, ids: list[int]) -> list[str]:
    decoder = codec.stream_decoder()
    return [decoder.push(i) for i in ids] + [decoder.finish()]


@settings(max_examples=40)
@given(st.text(max_size=60))
def test_bytes_round_trip_and_stream_without_half_characters(text):
    codec = TextCodec.byte_level()
    ids = codec.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert codec.decode(ids) == text
    deltas = _stream(codec, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # a valid text never shows half a character


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_tokenizer_round_trip_and_stream_deltas_join_to_the_text(bpe, text):
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode())  # merges happened: a real BPE
    assert bpe.decode(ids) == text
    deltas = _stream(bpe, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_multibyte_character_comes_out_whole_when_its_last_byte_arrives():
    decoder = TextCodec.byte_level().stream_decoder()
    assert [decoder.push(b) for b in "日".encode()] == ["", "", "日"]
    assert decoder.finish() == ""


@given(st.lists(st.integers(0, VOCAB - 1), max_size=40))
def test_any_ids_stream_to_what_decode_gives(bpe, ids):
    assert "".join(_stream(bpe, ids)) == bpe.decode(ids)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentencepiece")
    train_sentencepiece_bpe(TEXTS, 200).save(str(folder / "tokenizer.json"))
    return TextCodec.from_model_folder(folder)


def test_a_sentencepiece_stream_keeps_the_spaces_a_token_decoded_alone_loses(sentencepiece):
    text = "Grüße aus Köln 🚀 x"
    ids = sentencepiece.encode(text)
    naive = "".join(sentencepiece.decode([i]) for i in ids)
    assert naive == text.replace(" ", "")  # each token decoded alone loses its space
    deltas = _stream(sentencepiece, ids)
    assert "".join(deltas) == sentencepiece.decode(ids) == text
    assert any(d.startswith(" ") for d in deltas)


@given(st.lists(st.integers(0, 199), max_size=30))
def test_any_sentencepiece_ids_stream_to_what_decode_gives(sentencepiece, ids):
    assert "".join(_stream(sentencepiece, ids)) == sentencepiece.decode(ids)


@given(st.lists(st.integers(0, 300), max_size=40))
def test_any_bytes_stream_to_what_decode_gives(ids):
    codec = TextCodec.byte_level(vocab_size=301)  # ids over 255 decode to nothing
    assert "".join(_stream(codec, ids)) == codec.decode(ids)


def test_invalid_bytes_are_not_held_without_end():
    decoder = TextCodec.byte_level().stream_decoder()
    out = [decoder.push(0xFF) for _ in range(MAX_HELD_IDS)]
    assert out[:-1] == [""] * (MAX_HELD_IDS - 1)
    assert out[-1] == "\ufffd" * MAX_HELD_IDS


def test_eos_ids_from_config_generation_config_and_tokenizer_config(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert TextCodec.from_model_folder(tmp_path).eos_ids == (0, 5, 7)


def test_a_byte_model_folder_without_tokenizer_reads_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "eos_token_id": 10}))
    codec = TextCodec.from_model_folder(tmp_path)
    assert (codec.name, codec.eos_ids, codec.encode("é")) == ("bytes", (10,), [0xC3, 0xA9])


def test_role_tags_chat_format():
    codec = TextCodec.byte_level()
    prompt = codec.chat.render(
        [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    )
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert codec.chat.stop_strings == ("\n<|",)


def test_chatml_only_when_the_template_uses_it_and_the_tokenizer_has_its_markers(tmp_path):
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    )
    write_tokenizer(tmp_path, chat_template=chatml)
    assert TextCodec.from_model_folder(tmp_path).chat.name == "role-tags"  # no such tokens

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec.from_model_folder(tmp_path)
    end = tokenizer.token_to_id("<|im_end|>")
    assert (codec.chat.name, codec.chat.stop_ids) == ("chatml", (end,))
    assert end in codec.eos_ids
    rendered = codec.chat.render([ChatMessage(role="user", content="Hi")])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.decode(codec.encode(rendered)) == "user\nHi\nassistant\n"  # markers are special


def test_refusals(tmp_path, monkeypatch):
    with pytest.raises(TextCodecError, match="not a directory"):
        TextCodec.from_model_folder(tmp_path / "missing")
    with pytest.raises(TextCodecError, match=r"neither tokenizer\.json nor config\.json"):
        TextCodec.from_model_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(TextCodecError, match=r"vocabulary \(100\) does not cover"):
        TextCodec.from_model_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "eos_token_id": 256}))
    with pytest.raises(TextCodecError, match="eos_token_id 256 is not an id < 256"):
        TextCodec.from_model_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": True}))
    with pytest.raises(TextCodecError, match="vocab_size must be a positive int"):
        TextCodec.from_model_folder(tmp_path)


def test_tokenizer_refusals(tmp_path, monkeypatch):
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB - 1}))
    with pytest.raises(TextCodecError, match=f"has {VOCAB} tokens but config.json a vocabulary"):
        TextCodec.from_model_folder(tmp_path)
    (tmp_path / "config.json").unlink()
    monkeypatch.setattr(text_module, "MAX_TOKENIZER_BYTES", 1000)
    with pytest.raises(TextCodecError, match="more than 1000 is refused"):
        TextCodec.from_model_folder(tmp_path)
    monkeypatch.undo()
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "nothing"}}')
    with pytest.raises(TextCodecError, match="not a tokenizer the tokenizers package reads"):
        TextCodec.from_model_folder(tmp_path)
