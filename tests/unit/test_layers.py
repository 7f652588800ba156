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
    """`shoal join` checks its settings and ports before torch loads (peer/config/preflight.py)."""
    code = "import sys, shoal.peer.config.settings, shoal.peer.config.preflight\n"
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
    code = "import sys, shoal.peer.train.trainer, shoal.peer.models.loading, shoal.peer.data\n"
    code += "import shoal.peer.checkpoint\n"
    code += "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('hivemind', 'grpc'))}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


# The peer job's packages, bottom to top (docs/ARCHITECTURE.md): each imports only what is below it (and
# the shared layers: the algorithms, the codecs, the wire format, the loose on-disk helpers). The swarm
# and the data come in where they are used: the trainer trains without a network.
LOOSE = ("shoal.peer.files", "shoal.peer.checkpoint")
SHARED = ("shoal.compression", "shoal.protocol", "shoal.peer.algorithms", *LOOSE)
ABOVE = ("shoal.peer.swarm", "shoal.peer.job", "hivemind", "grpc")
JOB_LAYERS = {
    "config": (*SHARED, "shoal.peer.config", "shoal.peer.swarm.names"),
    "models": (*SHARED, "shoal.peer.models"),
    "train": (*SHARED, "shoal.peer.models", "shoal.peer.data", "shoal.peer.train"),
    "job": (*SHARED, "shoal.peer.config", "shoal.peer.models", "shoal.peer.data", "shoal.peer.train", *ABOVE),
}


def test_the_peer_folder_holds_packages_and_at_most_three_loose_modules():
    loose = sorted(path.name for path in PEER.glob("*.py"))
    assert loose == ["__init__.py", "checkpoint.py", "files.py"]
    packages = {path.name for path in PEER.iterdir() if (path / "__init__.py").exists()}
    assert {"config", "models", "train", "job"} <= packages


def test_each_package_of_the_peer_job_imports_only_what_lies_below_it():
    offending = {}
    for package, allowed in JOB_LAYERS.items():
        for path in sorted((PEER / package).glob("*.py")):
            found = [name for name in shoal_imports(path) if not name.startswith(allowed)]
            if found:
                offending[f"{package}/{path.name}"] = found
    assert offending == {}


def module_imports(path: Path, root: Path) -> set[str]:
    """The shoal modules `path` imports when it loads: its top-level imports, outside TYPE_CHECKING."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shoal"):
            for alias in node.names:  # `from shoal.peer.job import window` names a module
                candidate = f"{node.module}.{alias.name}"
                module = candidate if module_path(candidate, root) else node.module
                found.add(module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("shoal")}
    return found


def module_path(name: str, root: Path) -> Path | None:
    parts = name.split(".")[1:]
    top = {"peer": "peer", "protocol": "protocol", "compression": "compression", "coordinator": "coordinator"}
    if not parts or parts[0] not in top:
        return None
    base = root / top[parts[0]] / Path(*parts[1:]) if parts[1:] else root / top[parts[0]]
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_peer_modules_import_one_another_without_a_cycle_or_a_dodging_import():
    """A cycle once ran trainer -> ranks -> models -> trainer, broken by an import inside a function; the
    peer's packages now load top-down, and none imports a shoal module inside a function."""
    root = PEER.parent
    modules = {}
    for path in sorted(PEER.rglob("*.py")):
        name = "shoal." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = {m for m in module_imports(path, root) if m.startswith("shoal.peer")}
    state: dict[str, str] = {}

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join((*trail, name))
        state[name] = "open"
        for imported in sorted(modules.get(name, ())):
            visit(imported, (*trail, name))
        state[name] = "done"

    for name in modules:
        visit(name, ())
    inner = []
    for package in JOB_LAYERS:
        for path in sorted((PEER / package).glob("*.py")):
            functions = [
                node
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
            for node in (found for function in functions for found in ast.walk(function)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shoal"):
                    inner.append(f"{package}/{path.name}:{node.lineno}")
    assert inner == []
