"""A peer operators run as a service (issue 74): a stop's budget and its watchdog
(shoal.peer.train.stopping), the deployments' stop timeouts that rest on it, the lock on a checkpoint
folder, a refusal in flags."""

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shoal.peer.job.node import DRAIN_MAX_S, stop_budget
from shoal.peer.train.stopping import WATCHDOG_MARGIN_S, StopRequest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LONGEST_DOCUMENTED_ROUND_S = 45.0  # the deploy READMEs: raise the timeouts for longer rounds


def test_a_second_signal_spends_the_budget_at_once():
    stop = StopRequest(grace_s=30.0)
    assert not stop.is_set() and stop.remaining() is None and not stop.spent()
    stop.signalled()
    assert stop.is_set() and not stop.urgent and 29.0 < stop.remaining() <= 30.0 and not stop.spent()
    stop.signalled()
    assert stop.urgent and stop.remaining() == 0.0 and stop.spent()


def test_a_stop_without_a_budget_is_never_spent():
    stop = StopRequest()
    stop.set()
    stop.set()  # a second set is not a second signal
    assert stop.is_set() and not stop.urgent and not stop.spent() and stop.remaining() is None


def test_the_budget_covers_a_round_longer_than_the_drain():
    assert stop_budget(4.0) == DRAIN_MAX_S
    assert stop_budget(60.0) == 65.0


def test_the_watchdog_ends_a_stop_that_outlasts_its_budget(tmp_path):
    """A process whose main thread never returns (a wait on a helper that died): the watchdog runs
    its cleanup and exits 0 shortly past the budget; without a stop it does nothing."""
    marker = tmp_path / "cleaned"
    code = textwrap.dedent(f"""
        import threading, time
        from shoal.peer.train.stopping import StopRequest, Watchdog
        stop = StopRequest(grace_s=0.3)
        Watchdog(stop, before_exit=lambda: open({str(marker)!r}, "w").close(), margin_s=0.4)
        time.sleep(0.8)  # past the budget and margin: nothing happens without a stop
        print("not stopped: still running", flush=True)
        stop.set()
        threading.Event().wait()  # a main thread that never returns
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "still running" in result.stdout and "exiting now" in result.stderr
    assert marker.exists()
    assert time.monotonic() - started < 20


def _seconds(text: str) -> float:
    found = re.fullmatch(r"(\d+)(s?)", text.strip())
    assert found, text
    return float(found.group(1))


def test_every_deployment_lets_a_stop_run_to_its_end():
    """The longest stop a documented round allows, and the watchdog's margin, fit in each
    deployment's stop timeout; systemd signals the main process (mixed) or all (control-group)."""
    longest = stop_budget(LONGEST_DOCUMENTED_ROUND_S) + WATCHDOG_MARGIN_S
    unit = (DEPLOY / "systemd" / "shoal-peer.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.MULTILINE))
    assert settings["KillSignal"] == "SIGTERM"
    assert settings.get("KillMode", "control-group") in ("mixed", "control-group")
    assert _seconds(settings["TimeoutStopSec"]) > longest
    compose = (DEPLOY / "docker" / "compose.yml").read_text()
    graces = re.findall(r"stop_grace_period: (\w+)", compose)
    assert len(graces) >= 2 and all(_seconds(g) > longest for g in graces)
    assert "init: true" in compose  # a PID 1 that passes SIGTERM to the peer
    peers = (DEPLOY / "kubernetes" / "peers.yaml").read_text()
    (grace,) = re.findall(r"terminationGracePeriodSeconds: (\d+)", peers)
    assert _seconds(grace) > longest


def test_a_checkpoint_folder_held_by_a_live_peer_is_refused_and_freed_when_it_dies(tmp_path):
    """Two peers on one --checkpoint-dir: the second is refused, naming the first's pid; once the first
    is killed (no chance to clean up), the folder is free again."""
    from shoal.peer.config.preflight import lock_folder, unlock_folder
    from shoal.peer.config.settings import SettingsError

    code = textwrap.dedent(f"""
        import sys, threading
        from pathlib import Path
        from shoal.peer.config.preflight import lock_folder
        lock_folder(Path({str(tmp_path)!r}), "--checkpoint-dir")
        print("held", flush=True)
        threading.Event().wait()  # until killed
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            lock_folder(tmp_path, "--checkpoint-dir")
        except SettingsError as error:
            assert f"pid {holder.pid}" in str(error) and "--checkpoint-dir" in str(error)
        else:
            raise AssertionError("a folder held by a live peer was taken")
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "shoal.lock").exists()  # left behind by the killed peer: it claims nothing
    lock_folder(tmp_path, "--checkpoint-dir")
    try:
        assert (tmp_path / "shoal.lock").read_text().strip() == str(__import__("os").getpid())
    finally:
        unlock_folder(tmp_path)


def test_a_refusal_is_said_in_the_flags_a_volunteer_sets():
    from shoal.peer.job.node import in_flags

    reason = "compression_topk is 4 there, 32 here; lr is 1e-3 there, the default here; "
    reason += "grad_clip is 1.0 there, the default here"
    assert in_flags(reason) == (
        "--topk 4 in the run, 32 here; --lr 1e-3 in the run, its default here; "
        "--grad-clip 1.0 in the run, its default here"
    )
    data = f"data is {'a' * 64} there, {'b' * 64} here"
    assert (
        in_flags(data)
        == f"--data: the run trains on another corpus (digest {'a' * 12} there, {'b' * 12} here)"
    )
    assert in_flags("shoal 9.0.0 there, 0.1.0 here (major.minor must match)").startswith("shoal 9.0.0")


def _hf_folder(folder: Path, *, vocab: int, positions: int, tokens: int) -> Path:
    """A Hugging Face model folder as far as the early checks read it: config.json and tokenizer.json."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab, "n_positions": positions}))
    pieces = {f"t{i}": i for i in range(tokens - 1)}
    added = [{"id": tokens - 1, "content": "<|end|>", "special": True}]
    (folder / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "BPE", "vocab": pieces}, "added_tokens": added})
    )
    return folder


def test_bad_inputs_are_refused_before_the_model_loads(tmp_path):
    """`shoal join` refuses a missing --data, --model or --tokenizer, a --seq-len beyond the model's
    positions, and a tokenizer beyond the model's vocabulary, exit 2 naming the flag, in under 2 s
    (the checks import no torch); `shoal check --model` refuses the same tokenizer."""
    good = _hf_folder(tmp_path / "good", vocab=64, positions=32, tokens=64)
    wide = _hf_folder(tmp_path / "wide", vocab=64, positions=32, tokens=80)
    cases = {
        ("--data", str(tmp_path / "missing.jsonl")): "--data",
        ("--data", str(tmp_path / "*.parquet")): "the pattern matches no file",
        ("--model", str(tmp_path / "nope")): "--model",
        ("--model", str(good), "--seq-len", "33"): "--seq-len 33: --model",
        ("--seq-len", "70000"): "--seq-len 70000",
        ("--tokenizer", str(tmp_path / "none.json")): "--tokenizer",
        ("--model", str(wide)): "tokenizer.json holds token ids up to 79, but --model",
        ("--model", str(good), "--tokenizer", str(wide)): f"--tokenizer {wide} holds token ids up to 79",
    }
    for args, said in cases.items():
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "shoal.peer.cli", "join", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and said in result.stderr, (args, result.stderr[-2000:])
        assert time.monotonic() - started < 2.0, args
    checked = subprocess.run(
        [sys.executable, "-m", "shoal.peer.cli", "check", "--model", str(wide)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 2 and "holds token ids up to 79" in checked.stderr, checked.stderr[-2000:]


def test_the_early_checks_know_the_models_names():
    from shoal.peer.config import preflight
    from shoal.peer.models import loading as models

    assert preflight.EMBEDDED == models.PRESETS
    assert preflight.EMBEDDED_MAX_SEQ_LEN == models.EMBEDDED_MAX_SEQ_LEN
    assert preflight.FACTORY.pattern == models.FACTORY.pattern


def test_tokenizing_a_corpus_tells_its_progress_once(tmp_path, capsys):
    """A corpus tokenized on join says how far it got (every LOG_EVERY_S where stderr is a log, and
    its totals at the end); the next start reads the cache and says nothing."""
    import io

    from shoal.peer.data.prepare import ProgressLine
    from shoal.peer.data.sources import load_data

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(300)))
    load_data(str(corpus), cache=tmp_path / "cache")
    said = capsys.readouterr().err
    assert f"tokenized --data {corpus}: 300 documents" in said, said
    load_data(str(corpus), cache=tmp_path / "cache")
    assert "tokeniz" not in capsys.readouterr().err
    log = io.StringIO()
    line = ProgressLine("x", stream=log, every_s=0.0)
    line(2, 10)
    line(3, 20)
    line.close()
    told = log.getvalue().splitlines()
    assert told[0].startswith("tokenizing x: 2 documents, 10 tokens") and len(told) == 3
    assert told[-1].startswith("tokenized x: 5 documents, 30 tokens")


def test_credited_peers_are_named_by_the_peer_ids_peers_print():
    """provenance.json's `credited_peers` (a checkpoint's): by the peer id each printed, kept after
    it left; a sender no record named keeps its key."""
    from shoal.peer.data.ledger import TokenLedger

    ledger = TokenLedger(100, 4, seed=3, lag=1)
    ledger.totals.credited.update({b"\x01": 3, b"\x02": 1})
    ledger.name({b"\x01": "12D3KooWFirst"})
    ledger.name({})  # it left: the run's records no longer name it
    assert ledger.credited_peers() == ["02", "12D3KooWFirst"]
