"""Issue 29's serving, end to end: a GPT-2 folder written by transformers (random weights)
served by three ``fusionllm node --task serve`` processes (2 stages of one block each, the
third node a replica), read by clients that are not members.

One swarm for the module; the test that kills a replica runs last.
"""

import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from fusionllm.node.local_swarm import LocalSwarm, wait_for
from fusionllm.node.serve.api import SamplingParams
from fusionllm.node.serve.client import connect_swarm
from fusionllm.node.serve.local import LocalSource, generate
from tests.support.hf_models import VOCAB, hf_gpt2

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

SERVE = {
    "task": "serve",
    "min-stages": 2,
    "max-stages": 2,
    "micro-batches": 4,
    "seq-len": 16,
    "threads": 1,
    "session-idle": 30,
}
PROMPT = [5, 17, 80, 3, 44, 61, 9, 23, 70, 2, 35, 88]
NEW = 12


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = hf_gpt2(seed=4)
    model.save_pretrained(root / "gpt2")
    local = LocalSwarm(root, extra=SERVE | {"model-dir": str(root / "gpt2")})
    try:
        first = local.start("a")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        nodes = [first] + [local.start(n, bootstrap=first.dht_addr) for n in ("b", "c")]
        wait_for(lambda: _one_serving_plan(nodes), 240, "three nodes serving one plan")
        yield {"nodes": nodes, "folder": root / "gpt2", "hf": model, "local": local}
    except AssertionError:
        print(local.logs())
        raise
    finally:
        local.close()


def _one_serving_plan(nodes) -> bool:
    plans = [n.last("serve_plan") for n in nodes]
    if any(p is None or p["stage"] is None for p in plans):
        return False
    return len({p["digest"] for p in plans}) == 1 and {p["stage"] for p in plans} == {0, 1}


def _local(folder, params: SamplingParams) -> list[int]:
    return asyncio.run(generate(LocalSource.from_folder(folder), PROMPT, params))


def _hf_greedy(model) -> list[int]:
    """The one-process model as transformers runs it, without any cache."""
    idx = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW):
            idx = torch.cat([idx, model(idx).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0, len(PROMPT) :].tolist()


async def _swarm_generate(nodes, params: SamplingParams, clients: int = 1):
    source = await connect_swarm([nodes[0].dht_addr], model="gpt2", timeout=60.0)
    try:
        outs = await asyncio.gather(*(generate(source, PROMPT, params) for _ in range(clients)))
        return outs, source
    finally:
        await source.aclose()


def test_greedy_through_the_swarm_equals_local_and_the_one_process_model(swarm):
    params = SamplingParams(max_new_tokens=NEW)
    expected = _hf_greedy(swarm["hf"])
    assert len(set(expected)) > 1  # a model that repeats one token would prove little
    assert _local(swarm["folder"], params) == expected
    (got,), source = asyncio.run(_swarm_generate(swarm["nodes"], params))
    assert got == expected
    assert source.vocab_size == VOCAB
    assert source.recoveries == 0


def test_seeded_sampling_and_several_clients_at_once_equal_local(swarm):
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=11)
    outs, _ = asyncio.run(_swarm_generate(swarm["nodes"], params, clients=3))
    assert outs == [_local(swarm["folder"], params)] * 3


def test_generate_cli_prints_json(swarm):
    command = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
               "generate", "--bootstrap", swarm["nodes"][1].dht_addr, "--prompt-ids",
               ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "--json"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["output_ids"] == _hf_greedy(swarm["hf"])
    assert out["text"] is None  # vocabulary 96: ids, not bytes
    assert out["tokens_per_s"] > 0
    assert 0 < out["first_token_s"] < 60


def _word_tokenizer(folder) -> None:
    """A tokenizer.json of exactly the model's 96 ids (words w0..w94 and [UNK]), so that the
    gateway's text can be checked against the ids the swarm must produce."""
    words = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))


def _word(token: int) -> str:
    return f"w{token}" if token < VOCAB - 1 else "[UNK]"


def _sse_text(response) -> str:
    pieces = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    return "".join(pieces)


def test_the_gateway_answers_and_streams_a_chat_from_the_swarm(swarm, tmp_path):
    _word_tokenizer(tmp_path / "tok")
    command = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
               "gateway", "--bootstrap", swarm["nodes"][0].dht_addr, "--http", "127.0.0.1:0",
               "--model-dir", str(tmp_path / "tok"), "--timeout", "120"]  # fmt: skip
    gateway = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = gateway.stdout.readline()  # the URL, once the swarm is found and it listens
        assert "http://" in line, gateway.stderr.read()[-3000:] if gateway.poll() else line
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        with httpx.Client(base_url=url, timeout=120) as client:
            body = {"model": "gpt2", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
            done = client.post("/completions", json=body).json()
            expected = [_word(i) for i in _hf_greedy(swarm["hf"])]
            assert done["choices"][0]["text"].split() == expected
            chat = {"model": "gpt2", "max_tokens": NEW, "temperature": 0,
                    "messages": [{"role": "user", "content": "w5 w17 w80 w3"}]}  # fmt: skip
            whole = client.post("/chat/completions", json=chat).json()
            with client.stream("POST", "/chat/completions", json=chat | {"stream": True}) as r:
                assert r.status_code == 200
                streamed = _sse_text(r)
            assert streamed.split() == whole["choices"][0]["message"]["content"].split()
            assert streamed.strip()
    finally:
        gateway.terminate()
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
            gateway.wait(timeout=10)


def test_generate_cli_tokenizes_a_text_prompt_with_the_folders_tokenizer(swarm, tmp_path):
    _word_tokenizer(tmp_path / "tok")
    command = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
               "generate", "--bootstrap", swarm["nodes"][0].dht_addr, "--model-dir",
               str(tmp_path / "tok"), "--prompt", " ".join(f"w{i}" for i in PROMPT),
               "--max-new-tokens", str(NEW), "--json"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["output_ids"] == _hf_greedy(swarm["hf"])  # the text became PROMPT's ids
    assert out["text"].split() == [_word(i) for i in out["output_ids"]]


def test_a_session_survives_the_loss_of_a_stage_replica(swarm, caplog):
    nodes = swarm["nodes"]
    by_peer = {n.peer_id: n for n in nodes}
    stages = [n.last("serve_plan")["stage"] for n in nodes]
    doubled = next(s for s in (0, 1) if stages.count(s) == 2)  # the third node's stage
    params = SamplingParams(max_new_tokens=NEW)
    expected = _hf_greedy(swarm["hf"])

    async def run() -> tuple[list[int], int]:
        source = await connect_swarm([nodes[0].dht_addr], model=None, timeout=90.0)
        out: list[int] = []
        stream = source.stream(PROMPT, params)
        try:
            async for token in stream:
                out.append(token)
                if len(out) == 4:  # mid-session: the replica this session uses dies
                    victim = by_peer[source.peers_in_use[doubled]]
                    await asyncio.to_thread(victim.kill)
        finally:
            await stream.aclose()
            await source.aclose()
        return out, source.recoveries

    with caplog.at_level(logging.WARNING, logger="fusionllm.node.serve.client"):
        got, recoveries = asyncio.run(run())
    assert got == expected
    assert recoveries >= 1
    assert any("replaying" in r.getMessage() for r in caplog.records)
