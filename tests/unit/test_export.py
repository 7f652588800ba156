"""`shoal export`: a checkpoint becomes a Hugging Face directory that transformers loads and generates
with, the embedded GPT as a GPT-2 computing the same logits, with its provenance; a missing or damaged
checkpoint leaves no folder behind."""

import json
import os

import pytest
import torch

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.models.loading import load_model

if os.environ.get("CI"):
    import transformers
else:
    transformers = pytest.importorskip("transformers")

from shoal.peer.cli import main
from shoal.peer.models.export import ExportError, byte_tokenizer, export, gpt2


def _checkpoint(folder, model: str, module: torch.nn.Module, seq_len: int) -> None:
    meta = {"model": model, "seq_len": seq_len, "run": "r", "run_config": {"model": model, "seed": "0"}}
    CheckpointStore(folder, meta=meta).save(
        7, {"model": module.state_dict(), "tokens_consumed": 4096, "credited_peers": ["ab", "cd"]}
    )


def test_the_embedded_gpt_is_a_gpt2_with_the_same_logits():
    loaded = load_model("tiny", seed=1)
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        ours = loaded.module(tokens)
        theirs = gpt2(loaded.module)(input_ids=tokens).logits
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)
    tokenizer = byte_tokenizer()
    assert tokenizer.encode("héllo\n").ids == list("héllo\n".encode())
    assert tokenizer.decode(list(b"caf\xc3\xa9")) == "café"


def test_an_exported_run_loads_and_generates(tmp_path):
    trained = load_model("tiny", seed=2)
    _checkpoint(tmp_path / "checkpoints", "tiny", trained.module, 64)
    assert main(["export", "--checkpoint-dir", str(tmp_path / "checkpoints"), str(tmp_path / "out")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    ids = tokenizer("def ", return_tensors="pt").input_ids
    assert ids.tolist() == [list(b"def ")]
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained.module(ids), atol=2e-5, rtol=1e-4)
    provenance = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert provenance["round"] == 7 and provenance["run"] == "r" and provenance["tokens_consumed"] == 4096
    assert provenance["credited_peers"] == ["ab", "cd"] and len(provenance["run_config_sha256"]) == 64
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_hugging_face_model_exports_as_itself_with_its_tokenizer(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    byte_tokenizer().save(str(tmp_path / "model" / "tokenizer.json"))
    loaded = load_model(str(tmp_path / "model"), seed=3)
    _checkpoint(tmp_path / "checkpoints", str(tmp_path / "model"), loaded.module, 64)
    export(tmp_path / "checkpoints", tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert torch.equal(next(model.parameters()), next(loaded.module.parameters()))
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_a_missing_or_damaged_checkpoint_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = main(["export", "--checkpoint-dir", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert code == 2 and "no checkpoint that loads" in capsys.readouterr().err
    _checkpoint(tmp_path / "checkpoints", "tiny", load_model("tiny").module, 64)
    path = tmp_path / "checkpoints" / "round-7.safetensors"
    path.write_bytes(path.read_bytes()[:200])  # torn
    with pytest.raises(ExportError, match="no checkpoint that loads"):
        export(tmp_path / "checkpoints", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "empty"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(ExportError, match="exists and is not an empty folder"):
        export(tmp_path / "checkpoints", tmp_path / "taken")
