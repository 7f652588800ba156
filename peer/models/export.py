"""`shoal export`: a run's last checkpoint as a Hugging Face model directory that
`AutoModelForCausalLM.from_pretrained` loads, with a provenance file beside the weights.

- A Hugging Face model is saved as itself (`save_pretrained`, safetensors), with the tokenizer files of
  its directory (or of the run's `--tokenizer`).
- The embedded GPT becomes a GPT-2 (`GPT2LMHeadModel`): its blocks are GPT-2's (pre-norm, causal
  attention, a 4x MLP, tied embeddings, layer norms of eps 1e-5), with three differences each mapped
  exactly: its linear layers have no bias (GPT-2's are written as zeros), GPT-2 keeps its weights
  transposed (Conv1D), and its GELU is the exact one (`activation_function="gelu"`). Its byte ids come
  with a byte-level tokenizer of 256 tokens and no merges: `tokenizer("text")` gives the bytes. A
  GPT-2 directory is what every tool of the ecosystem reads; a config and loader of shoal's own would
  be read by shoal alone.
- A `module:factory` model has no config to export: its weights go alone (`model.safetensors`).

`provenance.json`: the run, its round, the hash of the run configuration and the configuration itself,
the data digest and tokenizer, the tokens the swarm consumed and the peers whose payloads its ledger
credited (as the exporting peer's checkpoint has them).

The directory is written whole or not at all: into a temporary folder beside OUT, renamed at the end.
"""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.models.gpt import TinyGPT
from shoal.peer.models.loading import PRESETS, ModelError, load_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class ExportError(ValueError):
    """What cannot be exported, and what to do (the message names the flag)."""


def export(checkpoint_dir: str | Path, out: str | Path, *, model: str | None = None) -> dict:
    """Writes the newest checkpoint of `checkpoint_dir` to the new directory `out`; `model` replaces
    the model the checkpoint names (a Hugging Face directory moved since). Returns the provenance."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"OUT {out}: exists and is not an empty folder; choose a new one")
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise ExportError(f"--checkpoint-dir {folder}: no such folder")
    store = CheckpointStore(folder, warn=lambda _: None)
    state = store.load_latest()
    if state is None:
        raise ExportError(
            f"--checkpoint-dir {folder}: no checkpoint that loads (shoal join --checkpoint-dir)"
        )
    meta = state.get("meta") or {}
    name = model or meta.get("model")
    if not name:
        raise ExportError(f"--checkpoint-dir {folder}: the checkpoint does not say its model; give --model")
    try:
        loaded = load_model(name, seq_len=meta.get("seq_len"))
        loaded.module.load_state_dict(state["model"])
    except (ModelError, RuntimeError, KeyError) as error:
        raise ExportError(f"--model {name}: the checkpoint's weights do not fit it: {error}") from None
    provenance = _provenance(state, meta, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if isinstance(loaded.module, TinyGPT):
            gpt2(loaded.module).save_pretrained(staging, safe_serialization=True)
            byte_tokenizer().save(str(staging / "tokenizer.json"))
            (staging / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
            )
        elif hasattr(loaded.module, "save_pretrained"):
            # torch's stubs type a Module's attributes as Tensor | Module
            loaded.module.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
            _copy_tokenizer(Path(meta.get("tokenizer") or name), staging)
        else:
            weights = {k: v.detach().contiguous() for k, v in loaded.module.state_dict().items()}
            save_file(weights, str(staging / "model.safetensors"))
        (staging / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return provenance


def _provenance(state: dict, meta: dict, model: str) -> dict:
    config = meta.get("run_config") or {}
    canonical = json.dumps(config, sort_keys=True).encode()
    return {
        "run": meta.get("run"),
        "round": state["round"],
        "model": model if model not in PRESETS else f"{model} (shoal's embedded GPT, as GPT-2)",
        "run_config_sha256": hashlib.sha256(canonical).hexdigest() if config else None,
        "run_config": config,
        "data": config.get("data", meta.get("data")),
        "tokenizer": config.get("tokenizer", meta.get("tokenizer") or "bytes"),
        "tokens_consumed": state.get("tokens_consumed"),
        "credited_peers": state.get("credited_peers", []),
    }


def _copy_tokenizer(source: Path, staging: Path) -> None:
    folder = source if source.is_dir() else source.parent
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, staging / name)
    if source.is_file() and source.name.endswith(".json") and not (staging / "tokenizer.json").exists():
        shutil.copyfile(source, staging / "tokenizer.json")


def gpt2(model: TinyGPT):
    """The embedded GPT as a transformers GPT2LMHeadModel computing the same logits (module docstring)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.seq_len,
        n_embd=c.d_model,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(config)
    ours = {k: v.detach().float() for k, v in model.state_dict().items()}
    theirs = hf.state_dict()
    mapped = {
        "transformer.wte.weight": ours["token_embedding.weight"],
        "transformer.wpe.weight": ours["position_embedding.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": ours["norm.bias"],
    }
    for i in range(c.n_layer):
        block, h = f"blocks.{i}.", f"transformer.h.{i}."
        for norm, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            mapped[f"{h}{ln}.weight"] = ours[f"{block}{norm}.weight"]
            mapped[f"{h}{ln}.bias"] = ours[f"{block}{norm}.bias"]
        for linear, conv in (
            ("attention.qkv", "attn.c_attn"),
            ("attention.proj", "attn.c_proj"),
            ("mlp.0", "mlp.c_fc"),
            ("mlp.2", "mlp.c_proj"),
        ):
            weight = ours[f"{block}{linear}.weight"]
            mapped[f"{h}{conv}.weight"] = weight.t().contiguous()  # Conv1D: (in, out)
            mapped[f"{h}{conv}.bias"] = torch.zeros(weight.shape[0])
    mapped["lm_head.weight"] = mapped["transformer.wte.weight"]
    missing = [k for k in theirs if k not in mapped and not k.endswith(("attn.bias", "attn.masked_bias"))]
    if missing:
        raise ExportError(
            f"the GPT-2 of this transformers version has weights shoal does not map: {missing[:4]}"
        )
    hf.load_state_dict({**theirs, **mapped})
    return hf.eval()


def byte_tokenizer():
    """A byte-level tokenizer whose 256 ids are the bytes (no merges): the embedded GPT's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = _bytes_to_unicode()
    assert set(table.values()) == set(alphabet)
    vocab = {table[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
