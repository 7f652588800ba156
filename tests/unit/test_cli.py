"""The `shoal` entry point as a user runs it: installed console script, help, errors, JSON output."""

import json
import subprocess
import sys

import pytest

from shoal.compression import benchmark
from shoal.peer import cli


def run_shoal(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from shoal.peer.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def test_help_lists_only_commands_that_exist():
    result = run_shoal("--help")
    assert result.returncode == 0
    for command in ("bench", "join", "bootstrap", "demo", "status", "check", "keygen", "coordinator"):
        assert f" {command} " in result.stdout


def test_coordinator_command_runs_without_torch():
    """The coordinator must run on a small box: `shoal coordinator` imports no torch (nor hivemind)."""
    code = (
        "import sys; from shoal.peer import cli; cli.build_parser().parse_args(['coordinator']); "
        "import shoal.coordinator.server; "
        "print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_bad_flag_value_exits_2_naming_the_flag():
    result = run_shoal("bench", "codec", "--repeat", "0")
    assert result.returncode == 2
    assert "--repeat" in result.stderr


def test_bench_codec_json_has_the_documented_schema(monkeypatch, capsys):
    monkeypatch.setattr(benchmark, "SHAPES", ((128, 192), (96,)))
    monkeypatch.setattr(benchmark, "ZSTD_SHAPE", (128, 192))
    assert cli.main(["bench", "codec", "--json", "--repeat", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert {tuple(r["shape"]) for r in rows} == {(128, 192), (96,)}
    assert {r["codec"] for r in rows} == {
        "demo_reference",
        "demo_compact",
        "dense_int8",
        "dense_int4",
        "diloco_sparse",
    }
    for row in rows:
        assert set(row) == {
            "codec",
            "shape",
            "topk",
            "value_bits",
            "bytes",
            "ratio_vs_fp32",
            "encode_mb_s",
            "decode_mb_s",
            "baseline_encode_mb_s",
            "baseline_decode_mb_s",
        }
        assert row["bytes"] > 0 and row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
        has_baseline = row["codec"].startswith("demo")  # the DCT ones
        assert (row["baseline_encode_mb_s"] is not None) == has_baseline
        assert (row["topk"] is not None) == (has_baseline or row["codec"] == "diloco_sparse")
        assert row["value_bits"] == {"demo_reference": 32, "demo_compact": 1, "dense_int8": 8}.get(
            row["codec"], row["value_bits"]
        )


@pytest.mark.parametrize("shape", [(128, 192), (96,), (50, 64)])
def test_reference_style_baseline_computes_the_same_transform(shape):
    import torch

    from shoal.compression import DCTTopKCodec

    x = torch.randn(shape)
    reference = benchmark.ReferenceStyleDCT(shape, 64, 8, x.device)
    indices, values = reference.encode(x)
    expected = DCTTopKCodec(topk=8).select(x)
    got = values.abs().reshape(-1, 8).sort(dim=1).values
    torch.testing.assert_close(got, expected.values.abs().sort(dim=1).values)
    torch.testing.assert_close(reference.decode(indices, values), DCTTopKCodec(topk=8).reconstruct(expected))


def test_bench_converge_json_reports_every_method(monkeypatch, capsys):
    from shoal.peer.bench import converge

    tiny = converge.ConvergeConfig(model="tiny", steps=6, batch_size=2, inner_steps=3, eval_batches=1)
    monkeypatch.setattr(converge, "QUICK", tiny)
    assert cli.main(["bench", "converge", "--json", "--quick"]) == 0
    rows = {r["method"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(rows) == set(converge.METHODS)
    for row in rows.values():
        assert set(row) == {"method", "final_val_loss", "bytes_sent_per_worker", "wall_s", "curve"}
        assert row["curve"] == []  # curves: --scale only
        assert 0 < row["final_val_loss"] < 10 and row["bytes_sent_per_worker"] > 0
    assert rows["demo_compact"]["bytes_sent_per_worker"] * 100 < rows["adamw_dp"]["bytes_sent_per_worker"]


def test_bench_converge_runs_the_methods_asked_for_and_refuses_unknown_ones(monkeypatch, capsys):
    from shoal.peer.bench import converge

    tiny = converge.ConvergeConfig(model="tiny", steps=4, batch_size=2, inner_steps=2, eval_batches=1)
    monkeypatch.setattr(converge, "QUICK", tiny)
    asked = ["bench", "converge", "--json", "--quick", "--methods", "demo_compact,demo_compact_lookahead"]
    assert cli.main(asked) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["method"] for r in rows] == ["demo_compact", "demo_compact_lookahead"]
    assert rows[0]["bytes_sent_per_worker"] == rows[1]["bytes_sent_per_worker"]  # same payloads, later
    assert cli.main(["bench", "converge", "--methods", "demo_fast"]) == 2
    assert "unknown demo_fast" in capsys.readouterr().err


def test_bench_converge_passes_demo_error_feedback_and_refuses_one_outside_0_1(monkeypatch, capsys):
    from shoal.peer.bench import converge

    tiny = converge.ConvergeConfig(model="tiny", steps=4, batch_size=2, inner_steps=2, eval_batches=1)
    monkeypatch.setattr(converge, "QUICK", tiny)
    asked = ["bench", "converge", "--json", "--quick", "--methods", "demo_reference"]
    losses = []
    for alpha in ("1", "0.2"):
        assert cli.main([*asked, "--demo-error-feedback", alpha]) == 0
        losses.append(json.loads(capsys.readouterr().out)["results"][0]["final_val_loss"])
    assert losses[0] != losses[1]  # the momentum keeps 80% of what it sent: other coefficients next
    for bad in ("1.5", "-0.1", "nan"):
        assert cli.main([*asked, "--demo-error-feedback", bad]) == 2
        assert "--demo-error-feedback must be in [0, 1]" in capsys.readouterr().err
