"""Hugging Face folders in and out, against transformers itself (tiny random models, fp32).

In: folders transformers' save_pretrained wrote load with ``from_pretrained`` to the same
logits (1e-4). Out: folders ``save_pretrained`` wrote load in transformers with no missing or
unexpected keys, to the same logits. Every refusal names what is wrong.
"""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from fusionllm.dag import trace
from fusionllm.dag.models import (
    GPT2,
    Llama,
    LlamaConfig,
    RopeConfig,
    from_pretrained,
    gpt2,
    llama,
    save_pretrained,
)
from fusionllm.dag.models.hf_errors import (
    CheckpointFolderError,
    MissingFileError,
    TensorShapeError,
    TensorValueError,
    UnsupportedModelError,
)
from tests.support.hf_models import hf_gpt2, hf_llama, hf_logits, token_ids

ATOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _our_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(idx)


def _saved(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


# --- in ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_folder_gives_transformers_logits(tmp_path, tied) -> None:
    reference = hf_gpt2(tied=tied)
    model = from_pretrained(_saved(reference, tmp_path))
    assert isinstance(model, GPT2)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    idx = token_ids()
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference, idx), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    ("tied", "kv_heads", "bias", "rope"),
    [
        (False, 4, False, None),  # multi-head attention, default rope
        (True, 2, False, {"rope_type": "default", "rope_theta": 500000.0}),
        (False, 1, True, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        (True, 2, True, LLAMA3),
    ],
    ids=["untied-mha", "tied-gqa-theta", "untied-mqa-linear-bias", "tied-gqa-llama3-bias"],
)
def test_llama_folder_gives_transformers_logits(tmp_path, tied, kv_heads, bias, rope) -> None:
    reference = hf_llama(tied=tied, kv_heads=kv_heads, bias=bias, rope=rope)
    model = from_pretrained(_saved(reference, tmp_path))
    assert isinstance(model, Llama)
    assert model.config.num_key_value_heads == kv_heads
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    idx = token_ids()
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference, idx), atol=ATOL, rtol=0
    )


def test_sharded_folder_loads(tmp_path) -> None:
    reference = hf_llama(kv_heads=2, rope=LLAMA3)
    folder = _saved(reference, tmp_path, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("model-*.safetensors"))) >= 3
    idx = token_ids()
    model = from_pretrained(folder)
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference, idx), atol=ATOL, rtol=0
    )


def test_config_in_the_4x_form_reads_as_the_5x_form(tmp_path) -> None:
    """5.x writes ``rope_parameters``; 4.x wrote ``rope_theta`` and ``rope_scaling`` ("type")."""
    reference = hf_llama(kv_heads=2, rope=LLAMA3)
    folder = _saved(reference, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert "rope_theta" not in config
    assert "rope_scaling" not in config
    idx = token_ids()
    expected = hf_logits(reference, idx)
    five = _our_logits(from_pretrained(folder), idx)
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (folder / "config.json").write_text(json.dumps(config))
    four = _our_logits(from_pretrained(folder), idx)
    torch.testing.assert_close(five, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(four, expected, atol=ATOL, rtol=0)
    # The same numbers under another theta would not pass: the form was really read.
    config["rope_theta"] = 10000.0
    (folder / "config.json").write_text(json.dumps(config))
    assert not torch.allclose(_our_logits(from_pretrained(folder), idx), expected, atol=ATOL)


def test_older_files_load_hub_gpt2_names_and_buffers_included(tmp_path) -> None:
    """The hub's gpt2 has GPT2Model names (no ``transformer.``) and mask buffers; Llama files
    from transformers < 4.31 carry ``rotary_emb.inv_freq``: both load, the buffers ignored."""
    reference = hf_gpt2(tied=True)
    folder = _saved(reference, tmp_path / "gpt2")

    def as_hub(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        tensors["h.0.attn.bias"] = torch.tril(torch.ones(48, 48)).view(1, 1, 48, 48)
        tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)

    _edit_tensors(folder, as_hub)
    idx = token_ids()
    model = from_pretrained(folder)
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference, idx), atol=ATOL, rtol=0
    )
    reference = hf_llama(kv_heads=2)
    folder = _saved(reference, tmp_path / "llama")
    _edit_tensors(
        folder,
        lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}),
    )
    model = from_pretrained(folder)
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference, idx), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_folders_transformers_4_wrote_give_its_logits(name) -> None:
    """Committed folders from transformers 4.57.6 (see tests/data/transformers4/README.md)."""
    folder = Path(__file__).parents[1] / "data" / "transformers4" / name
    config = json.loads((folder / "config.json").read_text())
    assert config["transformers_version"].startswith("4.")
    expected = load_file(folder / "expected_logits.safetensors")
    logits = _our_logits(from_pretrained(folder), expected["idx"])
    torch.testing.assert_close(logits, expected["logits"], atol=ATOL, rtol=0)


def test_bf16_folder_loads_in_fp32(tmp_path) -> None:
    reference = hf_llama(kv_heads=2).to(torch.bfloat16)
    folder = _saved(reference, tmp_path)
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    model = from_pretrained(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    idx = token_ids()
    torch.testing.assert_close(
        _our_logits(model, idx), hf_logits(reference.float(), idx), atol=ATOL, rtol=0
    )


def test_a_loaded_model_traces_into_the_op_dag(tmp_path) -> None:
    model = from_pretrained(_saved(hf_llama(kv_heads=2, rope=LLAMA3), tmp_path)).eval()
    idx = token_ids(length=24)
    graph = trace(model, idx)
    assert graph.output_names == ("lm_head",)
    assert sum(1 for i in graph.node_ids if i.endswith("self_attn_rotary")) == 2  # per layer
    assert all(graph.node(i).forward_flops > 0 for i in graph.node_ids if "rotary" in i)
    with torch.no_grad():
        out = graph.stage_module(graph.node_ids)({"idx": idx})["lm_head"]
    torch.testing.assert_close(out, _our_logits(model, idx), atol=0, rtol=0)


# --- out -----------------------------------------------------------------------------------


def _round_trip(model: torch.nn.Module, folder: Path, expected_class: type) -> None:
    save_pretrained(model, folder)
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(loaded) is expected_class
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    idx = token_ids(length=32)
    torch.testing.assert_close(
        hf_logits(loaded.eval(), idx), _our_logits(model, idx), atol=ATOL, rtol=0
    )
    again = from_pretrained(folder)
    torch.testing.assert_close(_our_logits(again, idx), _our_logits(model, idx), atol=0, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_our_gpt2_loads_in_transformers(tmp_path, tied) -> None:
    torch.manual_seed(0)
    model = GPT2(replace(gpt2("tiny").config, vocab_size=96, tie_word_embeddings=tied))
    _round_trip(model, tmp_path, GPT2LMHeadModel)


def test_our_llama_loads_in_transformers(tmp_path) -> None:
    torch.manual_seed(0)
    _round_trip(llama("llama-tiny", vocab_size=96), tmp_path / "preset", LlamaForCausalLM)
    config = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        hidden_size=32,
        intermediate_size=40,
        vocab_size=96,
        max_position_embeddings=64,
        rope=RopeConfig(
            theta=5000.0, kind="llama3", factor=8.0, original_max_position_embeddings=16
        ),
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    model = Llama(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)  # biases and norms away from zeros and ones
    _round_trip(model, tmp_path / "llama3", LlamaForCausalLM)


# --- refusals (a folder is untrusted input) ------------------------------------------------


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    return _saved(hf_llama(kv_heads=2), tmp_path / "llama")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    _saved(hf_llama(kv_heads=2, rope=LLAMA3), root / "base")
    return root


_LLAMA_KEYS = {
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
    "rope_parameters", "rope_theta", "rope_scaling", "hidden_act",
}  # fmt: skip


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_files_are_named(tmp_path, llama_folder) -> None:
    with pytest.raises(MissingFileError, match="is not a directory"):
        from_pretrained(tmp_path / "nowhere")
    (llama_folder / "config.json").rename(tmp_path / "config.json")
    with pytest.raises(MissingFileError, match=r"config\.json does not exist"):
        from_pretrained(llama_folder)
    (tmp_path / "config.json").rename(llama_folder / "config.json")
    (llama_folder / "model.safetensors").rename(llama_folder / "pytorch_model.bin")
    with pytest.raises(MissingFileError, match=r"neither model\.safetensors nor .*pickled"):
        from_pretrained(llama_folder)


def test_unknown_architectures_and_settings_are_refused(llama_folder) -> None:
    _edit_config(llama_folder, model_type="bert", architectures=["BertModel"])
    with pytest.raises(UnsupportedModelError, match=r"model_type 'bert'.*supported: gpt2"):
        from_pretrained(llama_folder)
    _edit_config(llama_folder, model_type="llama", hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act = 'gelu' is not supported"):
        from_pretrained(llama_folder)
    _edit_config(llama_folder, hidden_act="silu", rope_parameters={"rope_type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn' is not supported"):
        from_pretrained(llama_folder)
    _edit_config(llama_folder, rope_parameters=None, num_hidden_layers=-2)
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers must be an integer"):
        from_pretrained(llama_folder)
    _edit_config(llama_folder, num_hidden_layers=10**6)
    with pytest.raises(TensorShapeError, match="asks for 1000000 layers"):
        from_pretrained(llama_folder)


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta"]),
                    st.one_of(st.text(max_size=8), st.floats(), st.integers()), max_size=3),
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(sorted(_LLAMA_KEYS)), _JSON_VALUES, max_size=3))
def test_any_config_value_loads_or_is_refused_with_a_typed_error(llama_dir, changes) -> None:
    """Whatever a hostile config.json holds: a model, or a CheckpointFolderError (never a
    TypeError, a torch error, a huge allocation or a hang)."""
    folder = llama_dir / "fuzz"
    if not folder.exists():
        shutil.copytree(llama_dir / "base", folder)
    config = json.loads((llama_dir / "base" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    try:
        model = from_pretrained(folder)
    except CheckpointFolderError as exc:
        assert str(exc)  # noqa: PT017 (the refusal says what is wrong)
    else:  # what loads runs
        with torch.no_grad():
            logits = model.eval()(token_ids(1, 8))
        assert logits.shape == (1, 8, model.config.vocab_size)


def test_config_that_is_not_a_json_object_is_refused(llama_folder) -> None:
    (llama_folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointFolderError, match="must hold a JSON object, not list"):
        from_pretrained(llama_folder)
    (llama_folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFolderError, match="is not valid JSON"):
        from_pretrained(llama_folder)


def test_tensors_that_do_not_fit_the_config_are_refused(llama_folder) -> None:
    _edit_config(llama_folder, intermediate_size=64)
    with pytest.raises(
        TensorShapeError, match=r"shape 6: .*gate_proj\.weight \[56, 32\] \(config: \[64, 32\]\)"
    ):
        from_pretrained(llama_folder)
    _edit_config(llama_folder, intermediate_size=56)
    _edit_tensors(llama_folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(TensorShapeError, match=r"missing 1: \['model\.norm\.weight'\]"):
        from_pretrained(llama_folder)
    _edit_tensors(llama_folder, lambda t: t.update({"model.norm.weight": torch.ones(32),
                                                    "model.extra": torch.ones(2)}))  # fmt: skip
    with pytest.raises(TensorShapeError, match=r"unexpected 1: \['model\.extra'\]"):
        from_pretrained(llama_folder)


def test_bad_values_are_refused(llama_folder) -> None:
    def poison(tensors):
        tensors["model.norm.weight"][3] = float("nan")

    _edit_tensors(llama_folder, poison)
    with pytest.raises(TensorValueError, match=r"model\.norm\.weight holds NaN or infinity"):
        from_pretrained(llama_folder)
    _edit_tensors(
        llama_folder, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)})
    )
    with pytest.raises(TensorValueError, match=r"model\.norm\.weight is I32"):
        from_pretrained(llama_folder)
    (llama_folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointFolderError, match="not a readable safetensors file"):
        from_pretrained(llama_folder)


def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path) -> None:
    folder = _saved(hf_gpt2(tied=True), tmp_path)
    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": torch.zeros(96, 32)}))
    with pytest.raises(TensorValueError, match=r"ties lm_head\.weight to transformer\.wte\.weight"):
        from_pretrained(folder)


def test_an_index_may_name_only_shards_inside_the_folder(tmp_path) -> None:
    folder = _saved(hf_llama(kv_heads=2), tmp_path / "m", max_shard_size="20KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointFolderError, match="must be a plain"):
        from_pretrained(folder)
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingFileError, match=r"model-00009-of-00009\.safetensors, a shard"):
        from_pretrained(folder)


def test_save_refuses_a_state_that_does_not_fit(tmp_path) -> None:
    from fusionllm.dag.models.pretrained import save_state

    model = llama("llama-tiny")
    state = model.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(TensorShapeError, match=r"missing \['model\.norm\.weight'\]"):
        save_state(model.config, state, tmp_path)
    state = model.state_dict() | {"model.norm.weight": torch.full((64,), float("inf"))}
    with pytest.raises(TensorValueError, match="refusing to export"):
        save_state(model.config, state, tmp_path)
    assert not list(tmp_path.iterdir())
