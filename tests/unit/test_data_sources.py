"""--data: token files read window by window, corpora prepared into shards (resumably, checked against
their manifest), the model's own tokenizer, and a clear refusal of every bad input, naming its file."""

import json
import os
import sys

import numpy as np
import pytest
import torch

from shoal.peer.config.spec import PeerSpec
from shoal.peer.data import DataError, Tokens, load_data
from shoal.peer.data.prepare import Progress, prepare
from shoal.peer.data.shards import LLMC_HEADER_INTS, LLMC_MAGIC, MANIFEST, open_prepared, open_token_files
from shoal.peer.data.text import text_source
from shoal.peer.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer
from shoal.peer.data.tokens import FileArray
from tests import corpora


@pytest.fixture(scope="module")
def texts():
    return corpora.documents(400)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, texts):
    return HFTokenizer(corpora.train_bpe(tmp_path_factory.mktemp("bpe"), texts))


def test_windows_read_from_files_equal_those_read_from_memory(tmp_path):
    ids = np.arange(10_000, dtype=np.int64) % 3000
    np.save(tmp_path / "a.npy", ids[:6000].astype("<u2"))
    np.save(tmp_path / "b.npy", ids[6000:].astype("<u4"))
    files = open_token_files(str(tmp_path))
    memory = Tokens([ids[:6000], ids[6000:]])
    both = Tokens([*files.train.arrays, *files.validation.arrays])
    assert all(isinstance(array, FileArray) for array in both.arrays)
    assert both.windows(100) == memory.windows(100) == 100
    picked = torch.tensor([0, 59, 60, 99, 17])  # both sides of the boundary between the files
    assert torch.equal(both.rows(picked, 100), memory.rows(picked, 100))
    assert torch.equal(memory.rows(torch.tensor([60]), 100)[0], torch.arange(6000, 6100) % 3000)
    assert both.digest() == memory.digest() and files.vocab_size == 3000
    with pytest.raises(IndexError):
        both.rows(torch.tensor([100]), 100)


def test_bin_files_in_the_nanogpt_and_llm_c_layouts(tmp_path):
    ids = np.arange(4000) % 900
    ids.astype("<u2").tofile(tmp_path / "raw.bin")
    assert open_token_files(str(tmp_path / "raw.bin")).vocab_size == 900
    for version, dtype in ((1, "<u2"), (2, "<u4")):
        header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
        header[:3] = (LLMC_MAGIC, version, ids.size)
        path = tmp_path / f"llmc{version}.bin"
        path.write_bytes(header.tobytes() + (ids + 70_000 * (version - 1)).astype(dtype).tobytes())
        streams = open_token_files(str(path))
        assert len(streams.train) + len(streams.validation) == ids.size
        assert streams.vocab_size == 900 + 70_000 * (version - 1)  # uint32 ids past 65,535
        path.write_bytes(path.read_bytes()[:-2])
        with pytest.raises(DataError, match="header says"):
            open_token_files(str(path))


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda p: p.write_bytes(b"\x01" * 4001), "not a whole number"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros((40, 40), dtype=np.int32)), "not 1-D"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros(4000, dtype=np.float32)), "not 1-D integer"),
        (lambda p: p.with_suffix(".npy").write_bytes(b"\x93NUMPY garbage"), "not an .npy file"),
        (lambda p: np.save(p.with_suffix(".npy"), np.zeros(10, dtype=np.uint16)), "too few"),
    ],
)
def test_a_bad_token_file_is_refused_naming_it(tmp_path, write, match):
    write(tmp_path / "tokens.bin")
    (path,) = tmp_path.iterdir()
    with pytest.raises(DataError, match=match) as error:
        open_token_files(str(path))
    assert str(path) in str(error.value)


def test_prepare_writes_checked_shards_and_the_same_digest_twice(tmp_path, texts, bpe):
    source = corpora.write_jsonl(tmp_path / "corpus.jsonl", texts)
    first = prepare(text_source(str(source)), tmp_path / "a", bpe, shard_tokens=5000)
    second = prepare(text_source(str(source)), tmp_path / "b", bpe, shard_tokens=5000)
    assert first.digest == second.digest and first.dtype == "uint16"
    assert sum(first.documents.values()) == len(texts) and first.documents["validation"] > 0
    assert len([s for s in first.shards if s.split == "train"]) > 2
    streams = open_prepared(tmp_path / "a")
    assert streams.digest == first.digest and streams.vocab_size <= bpe.vocab_size
    # every document ends with the end-of-text token, and only there
    train = np.concatenate([a.read(0, a.length) for a in streams.train.arrays])
    eot = bpe.separator[0]
    assert (train == eot).sum() == first.documents["train"] and train[-1] == eot
    # a shard changed after the manifest, and a folder without one, are refused
    shard = tmp_path / "a" / first.shards[0].name
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="does not match the manifest"):
        open_prepared(tmp_path / "a")
    os.remove(tmp_path / "b" / MANIFEST)
    with pytest.raises(DataError, match="not a shoal manifest"):
        open_prepared(tmp_path / "b")


def test_an_interrupted_prepare_resumes_to_the_same_corpus(tmp_path, texts, bpe):
    source = text_source(str(corpora.write_parquet(tmp_path / "corpus.parquet", texts)))
    whole = prepare(source, tmp_path / "whole", bpe, shard_tokens=3000)
    seen = []

    def interrupt(documents, _tokens):
        seen.append(documents)
        if (tmp_path / "cut" / "progress.json").exists() and len(seen) > 0:
            raise KeyboardInterrupt  # after its first shard: Ctrl-C

    with pytest.raises(KeyboardInterrupt):
        prepare(source, tmp_path / "cut", bpe, shard_tokens=3000, report=interrupt)
    assert not (tmp_path / "cut" / MANIFEST).exists()  # nothing that passes for complete
    done = Progress.load(
        tmp_path / "cut", json.loads((tmp_path / "cut" / "progress.json").read_text())["key"]
    )
    assert 0 < done.done < len(texts)
    resumed = prepare(source, tmp_path / "cut", bpe, shard_tokens=3000)
    assert resumed.digest == whole.digest
    assert not (tmp_path / "cut" / "progress.json").exists()


def test_a_vocabulary_past_65536_is_stored_as_uint32(tmp_path, texts):
    class Wide(ByteTokenizer):
        vocab_size = 70_000
        separator = (69_999,)
        digest = "wide"

    manifest = prepare(
        text_source(str(corpora.write_jsonl(tmp_path / "c.jsonl", texts))), tmp_path / "o", Wide()
    )
    assert manifest.dtype == "uint32"
    assert open_prepared(tmp_path / "o").vocab_size == 70_000


def test_load_data_prepares_a_text_corpus_once_and_pins_its_digest(tmp_path, texts, bpe):
    source = str(corpora.write_jsonl(tmp_path / "corpus.jsonl", texts))
    cache = tmp_path / "cache"
    streams = load_data(source, tokenizer=bpe, cache=cache)
    (folder,) = cache.iterdir()
    written = (folder / MANIFEST).stat().st_mtime_ns
    again = load_data(source, tokenizer=bpe, cache=cache)
    assert again.digest == streams.digest and (folder / MANIFEST).stat().st_mtime_ns == written
    config = PeerSpec().run_config(data=streams)
    assert config["data"] == streams.digest and bpe.digest[:12] in config["tokenizer"]
    assert "data" not in PeerSpec().run_config(
        data=load_data("stdlib")
    )  # runs on the default keep their hash
    as_bytes = load_data(source, cache=cache)  # the embedded model's bytes: another corpus
    assert as_bytes.digest != streams.digest and as_bytes.vocab_size <= 256
    with pytest.raises(DataError, match="prepared with tokenizer"):
        load_data(str(folder), tokenizer=ByteTokenizer())


def test_the_model_directory_s_own_tokenizer_is_the_default(tmp_path, texts):
    model = corpora.train_bpe(tmp_path / "model", texts)
    assert isinstance(load_tokenizer(None, str(model)), HFTokenizer)
    assert load_tokenizer(None, "tiny") is None  # the embedded model: bytes
    assert isinstance(load_tokenizer("bytes", str(model)), ByteTokenizer)


def test_token_ids_outside_the_model_s_vocabulary_name_the_tokenizer_and_the_model(tmp_path, texts, bpe):
    from shoal.peer.job.assembly import load_workload

    corpus = corpora.write_jsonl(tmp_path / "c.jsonl", texts)
    tokenizer = bpe.name
    spec = PeerSpec.of(data=str(corpus), tokenizer=tokenizer, data_cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="reads only 256 distinct tokens") as error:
        load_workload(spec)
    assert tokenizer in str(error.value) and "--model tiny" in str(error.value)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("bad.jsonl", '{"text": "fine"}\nnot json\n', "cannot be read as json"),
        ("field.jsonl", '{"body": "no text field"}\n', "has no text under 'text'"),
        ("number.jsonl", '{"text": 7}\n', "has no text under 'text'"),
        ("empty.jsonl", "", "empty dataset|cannot be read"),
        ("bad.parquet", "PAR1 this is no parquet", "cannot be read as parquet"),
    ],
)
def test_a_bad_dataset_file_is_refused_naming_it(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match) as error:
        load_data(str(path), cache=tmp_path / "cache")
    assert str(path) in str(error.value)
    assert not any((tmp_path / "cache").rglob(MANIFEST))  # never taken for a complete corpus


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("tool", b"\x7fELF\x02\x01\x01\x00\x00\x00binary", "a binary file"),
        ("latin.txt", b"caf\xe9", "not UTF-8"),
    ],
)
def test_a_file_that_is_not_text_in_a_text_folder_is_refused_naming_it(tmp_path, name, content, match):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "fine.txt").write_text("a fine document " * 200)
    (folder / name).write_bytes(content)
    with pytest.raises(DataError, match=match) as error:
        load_data(str(folder), cache=tmp_path / "cache")
    assert str(folder / name) in str(error.value)
    assert not any((tmp_path / "cache").rglob(MANIFEST))


def _mixed(folder):
    (folder / "m").mkdir()
    (folder / "m" / "a.jsonl").write_text("{}")
    (folder / "m" / "b.csv").write_text("text\nx")
    return folder / "m"


def _empty(folder):
    (folder / "empty").mkdir()
    return folder / "empty"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p / "missing.jsonl", "no such file"),
        (_empty, "an empty folder"),
        (lambda p: p / "nothing-*.parquet", "matches no file"),
        (_mixed, "several formats"),
    ],
)
def test_a_corpus_that_is_not_there_is_refused(tmp_path, make, match):
    with pytest.raises(DataError, match=match):
        load_data(str(make(tmp_path)), cache=tmp_path / "cache")


def test_a_tokenizer_that_does_not_load_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(TokenizerError, match="does not load"):
        load_tokenizer(str(tmp_path), "tiny")
    (tmp_path / "other").mkdir()
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path / "other"), "tiny")
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"), "tiny")


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4097, 65_537])
def test_the_window_order_is_a_seeded_permutation_never_listed(n):
    from shoal.peer.data.order import permuted

    order = permuted(np.arange(n), n, seed=11)
    assert sorted(order.tolist()) == list(range(n))  # a bijection of [0, n)
    assert np.array_equal(permuted(np.array([n - 1, 0]), n, seed=11), order[[n - 1, 0]])  # any position alone
    if n > 100:
        assert not np.array_equal(permuted(np.arange(n), n, seed=12), order)
        assert np.abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.1  # shuffled, not shifted
    huge = 80_000_000_000  # windows of a 10-trillion-token corpus: one position costs the same
    assert 0 <= permuted(np.array([huge - 1]), huge, seed=3)[0] < huge


def test_a_token_file_s_scan_is_kept_until_the_file_changes(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, (np.arange(5000) % 700).astype("<u2"))
    first = load_data(str(path), cache=tmp_path / "cache")
    (record,) = (tmp_path / "cache").glob("scan-*.json")
    assert json.loads(record.read_text()) == [699, first.digest]
    assert load_data(str(path), cache=tmp_path / "cache").digest == first.digest
    np.save(path, (np.arange(5000) % 900).astype("<u2"))  # another file: scanned again
    assert load_data(str(path), cache=tmp_path / "cache").vocab_size == 900


def test_two_processes_preparing_into_one_folder_take_turns(tmp_path, texts, bpe):
    import threading

    source = text_source(str(corpora.write_jsonl(tmp_path / "c.jsonl", texts)))
    made, errors = [], []

    def run():
        try:
            made.append(prepare(source, tmp_path / "shared", bpe, shard_tokens=4000).digest)
        except Exception as error:  # pragma: no cover - the failure the test looks for
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(made) == 2 and made[0] == made[1]
    assert open_prepared(tmp_path / "shared").digest == made[0]


def test_without_the_hf_extra_dataset_files_and_tokenizers_name_it(tmp_path, monkeypatch, texts):
    source = corpora.write_jsonl(tmp_path / "c.jsonl", texts[:5])
    tokenizer = corpora.train_bpe(tmp_path / "bpe", texts)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ImportError
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"pip install 'shoal\[hf\]'"):
        load_data(str(source), cache=tmp_path / "cache")
    with pytest.raises(TokenizerError, match=r"pip install 'shoal\[hf\]'"):
        load_tokenizer(str(tokenizer), "tiny")


def test_one_text_file_is_a_corpus_whichever_split_its_hash_names(tmp_path):
    for name in ("a", "b", "c", "d"):  # one document each: about 1 in 20 hash to validation
        path = tmp_path / f"{name}.txt"
        path.write_text(f"{name}: " + "a line of text, not short\n" * 400)
        streams = load_data(str(path), cache=tmp_path / "cache")
        assert len(streams.train) > 0 and len(streams.validation) > 0


def test_a_model_directory_without_a_tokenizer_does_not_train_on_bytes_unasked(tmp_path, texts):
    from shoal.peer.job.assembly import load_workload

    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"  # config and weights, no tokenizer.json (a sentencepiece-only model)
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(model)
    corpus = corpora.write_jsonl(tmp_path / "c.jsonl", texts)
    spec = PeerSpec.of(model=str(model), data=str(corpus), data_cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"has no tokenizer\.json to tokenize"):
        load_workload(spec)


def test_a_resumed_prepare_whose_shards_changed_starts_over(tmp_path, texts, bpe):
    source = text_source(str(corpora.write_jsonl(tmp_path / "c.jsonl", texts)))
    whole = prepare(source, tmp_path / "whole", bpe, shard_tokens=3000)

    def interrupt(_documents, _tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(source, tmp_path / "cut", bpe, shard_tokens=3000, report=interrupt)
    shard = next((tmp_path / "cut").glob("train-*.npy"))
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x00")  # changed between the two runs
    assert prepare(source, tmp_path / "cut", bpe, shard_tokens=3000).digest == whole.digest
