"""A researcher's corpus end to end: two `shoal join` processes train a Hugging Face model directory
(a GPT-2 on a parquet corpus, a Llama on a jsonl one), tokenized with the model's own tokenizer (a BPE
trained here), each preparing it into its own cache, report the held-out loss every second round, and
end on one model, the last round kept in a final checkpoint. Under a coordinator whose first round
waits for both: a peer that prepares a corpus is slow to start on a loaded machine, and on the clock
alone the second came in after the rounds the test reads (2026-12-01)."""

import json
import re

import pytest
import torch

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.data.tokenizer import HFTokenizer
from tests import corpora
from tests.integration.harness import kill, start, start_coordinator, wait_for

transformers = pytest.importorskip("transformers")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_two_peers_train_a_hugging_face_model_with_its_tokenizer(tmp_path, family):
    """gpt2: weights saved, a parquet corpus; llama: a directory with only its config (the run's seed
    makes the weights) and a jsonl corpus."""
    texts = corpora.documents(600)
    model = corpora.train_bpe(tmp_path / "model", texts, vocab_size=300)
    vocab = HFTokenizer(model).vocab_size
    eot = HFTokenizer(model).separator[0]
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=eot,
            eos_token_id=eot,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(model)
        corpus = corpora.write_parquet(tmp_path / "corpus.parquet", texts)
    else:
        transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, bos_token_id=eot,
            eos_token_id=eot,
        ).save_pretrained(model)  # fmt: skip
        corpus = corpora.write_jsonl(tmp_path / "corpus.jsonl", texts)
    common = ["--host", "127.0.0.1", "--run", "corpus", "--log-format", "json", "--round-seconds", "4"]
    common += ["--model", str(model), "--data", str(corpus), "--until-round", "5", "--validate-every", "2"]
    outs = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    coordinator, address = start_coordinator(tmp_path, 2, 4.0)
    common += ["--coordinator", address]
    peers = [coordinator]
    try:
        first = ["--data-cache", str(tmp_path / "cache1")]
        peers.append(start("join", *common, *first, stdout=outs[0].open("w"), stderr=_err(tmp_path, "first")))
        started = wait_for(outs[0], lambda e: e.get("event") == "started", 120)
        second = ["--data-cache", str(tmp_path / "cache2"), "--initial-peers", started["initial_peers"][0]]
        second += ["--checkpoint-dir", str(tmp_path / "checkpoints")]  # every 10 rounds: none before the end
        peers.append(
            start("join", *common, *second, stdout=outs[1].open("w"), stderr=_err(tmp_path, "second"))
        )
        for peer, name in zip(peers[1:], ("first", "second"), strict=True):
            assert peer.wait(timeout=150) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    finally:
        for peer in peers:
            kill(peer)
    summaries = [wait_for(out, lambda e: e.get("event") == "summary", 1) for out in outs]
    assert summaries[0]["param_hash"] == summaries[1]["param_hash"]
    assert all(s["validation_loss"] < s["initial_loss"] for s in summaries)
    events = [[json.loads(line) for line in out.read_text().splitlines()] for out in outs]
    assert any(e.get("event") == "round" and e["participants"] == 2 for e in events[1])  # together
    # the held-out loss every second round, on the same batches on both peers
    validations = [{e["round"]: e["loss"] for e in peer if e.get("event") == "validation"} for peer in events]
    assert validations[0].keys() == validations[1].keys() == {1, 3, 5}, validations
    # each prepared the corpus into its own cache, to the same shards
    manifests = [next((tmp_path / c).rglob("manifest.json")).read_text() for c in ("cache1", "cache2")]
    assert manifests[0] == manifests[1] and json.loads(manifests[0])["tokenizer"] == str(model)
    # a run that ends on --until-round keeps its last state: a checkpoint of round 5, the run agreed
    state = CheckpointStore(tmp_path / "checkpoints").load_latest()
    assert state is not None and state["round"] == 5


def _err(folder, name):
    return (folder / f"{name}.err").open("w")


@pytest.mark.timeout(180)
def test_two_peers_train_the_embedded_model_on_a_jsonl_corpus_and_refuse_other_data(tmp_path):
    """The embedded byte-level GPT on a jsonl corpus given straight to `shoal join` (prepared into the
    cache as bytes, documents separated): the two peers train together and end on one model; a third
    peer with another corpus is refused, naming the data."""
    corpus = corpora.write_jsonl(tmp_path / "corpus.jsonl", corpora.documents(300))
    common = ["--host", "127.0.0.1", "--run", "jsonl", "--log-format", "json", "--round-seconds", "3"]
    common += ["--data", str(corpus), "--until-round", "3", "--data-cache", str(tmp_path / "cache")]
    outs = [tmp_path / "first.jsonl", tmp_path / "second.jsonl"]
    coordinator, address = start_coordinator(tmp_path, 2, 3.0)
    peers = [coordinator]
    try:
        coordinated = ["--coordinator", address]  # not the refused one's: it never trains
        peers.append(
            start("join", *common, *coordinated, stdout=outs[0].open("w"), stderr=_err(tmp_path, "first"))
        )
        started = wait_for(outs[0], lambda e: e.get("event") == "started", 120)
        # its record is out once it trains: a joiner that saw only the refused one's would be refused
        wait_for(outs[0], lambda e: e.get("text", "").startswith("training "), 120)
        joiner = ["--initial-peers", started["initial_peers"][0]]
        # the one to refuse first: the run's rounds wait for the second, so the first is still there
        other = corpora.write_jsonl(tmp_path / "other.jsonl", corpora.documents(50))
        refused = start(
            "join", *common, *joiner, "--data", str(other), "--discover-seconds", "30",
            stdout=(tmp_path / "third.jsonl").open("w"), stderr=_err(tmp_path, "third"),
        )  # fmt: skip
        peers.append(
            start(
                "join",
                *common,
                *joiner,
                *coordinated,
                stdout=outs[1].open("w"),
                stderr=_err(tmp_path, "second"),
            )
        )
        peers.append(refused)
        for peer, name in zip(peers[1:3], ("first", "second"), strict=True):
            assert peer.wait(timeout=150) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
        assert refused.wait(timeout=60) != 0
    finally:
        for peer in peers:
            kill(peer)
    summaries = [wait_for(out, lambda e: e.get("event") == "summary", 1) for out in outs]
    assert summaries[0]["param_hash"] == summaries[1]["param_hash"]
    events = [json.loads(line) for line in outs[1].read_text().splitlines()]
    assert any(e.get("event") == "round" and e["participants"] == 2 for e in events)
    said = (tmp_path / "third.err").read_text()  # both corpora's digests named: theirs and its own
    assert "every peer of this run has another configuration" in said, said[-2000:]
    named = set(re.findall(r"another corpus \(digest ([0-9a-f]{12}) there, ([0-9a-f]{12}) here\)", said))
    assert len(named) == 1 and len(set(next(iter(named)))) == 2, said[-2000:]
