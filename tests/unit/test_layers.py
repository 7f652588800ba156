"""The layers' import rule (docs/ARCHITECTURE.md): shoal.peer.algorithms imports no network and nothing
of the peer above it, so that an optimizer can be read, tested and reused without the swarm; the swarm
(shoal.peer.swarm) imports the algorithms but nothing of the peer job, command line or benchmarks."""

import ast
import subprocess
import sys
from pathlib import Path

PEER = Path(__file__).resolve().parents[2] / "peer"
ALGORITHMS = PEER / "algorithms"
ALLOWED = ("shoal.compression", "shoal.protocol", "shoal.peer.algorithms")
SWARM_ALLOWED = (*ALLOWED, "shoal.peer.swarm", "hivemind", "grpc")


def shoal_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] in ("shoal", "hivemind", "grpc")]


def test_the_algorithms_import_only_codecs_protocol_and_each_other():
    modules = sorted(ALGORITHMS.glob("*.py"))
    assert len(modules) >= 7
    offending = {
        path.name: [name for name in shoal_imports(path) if not name.startswith(ALLOWED)] for path in modules
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_importing_every_algorithm_loads_no_hivemind():
    names = [f"shoal.peer.algorithms.{path.stem}" for path in sorted(ALGORITHMS.glob("*.py"))]
    code = f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('hivemind', 'grpc'))}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    # and the package still exports the optimizers and exchanges where users find them
    from shoal.peer import DeMo, DiLoCo, LoopbackExchange, TorchDistributedExchange  # noqa: F401


def test_the_swarm_imports_nothing_of_the_peer_job_above_it():
    modules = sorted((PEER / "swarm").glob("*.py"))
    assert len(modules) >= 12
    offending = {
        path.name: [name for name in shoal_imports(path) if not name.startswith(SWARM_ALLOWED)]
        for path in modules
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_settings_load_neither_torch_nor_hivemind():
    """`shoal join` checks its settings and ports before torch loads (peer/preflight.py)."""
    code = "import sys, shoal.peer.settings, shoal.peer.preflight\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('hivemind', 'torch'))}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_coordinator_imports_nothing_of_the_peer_and_loads_no_torch():
    """`shoal coordinator` runs without torch: the rules it shares with the peers (the fan-in choice,
    the tally's size, the peer-id shape) live in shoal.protocol.rules, which both import."""
    coordinator = PEER.parent / "coordinator"
    found = {
        name
        for path in sorted(coordinator.glob("*.py"))
        for name in shoal_imports(path)
        if name.startswith("shoal.peer")
    }
    assert found == set()
    code = "import sys, shoal.coordinator.server, shoal.coordinator.cli\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('hivemind', 'torch'))}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_trainer_and_what_it_trains_load_no_network():
    """`Trainer` runs over any exchange: it, the models, the data and the checkpoints load neither
    hivemind nor grpc, so that a benchmark or a torch.distributed job can use them without the swarm."""
    code = "import sys, shoal.peer.trainer, shoal.peer.models, shoal.peer.data, shoal.peer.checkpoint\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('hivemind', 'grpc'))}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
