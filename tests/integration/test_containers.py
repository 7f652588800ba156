"""The image and the compose stack, built and run for real: podman with runc, on a Debian base made from
Debian's own packages (mmdebstrap), with no network during the build or the demo.

- the image (deploy/docker/Dockerfile) builds offline from a wheel folder, runs as uid 10001, and trains
  `shoal demo --peers 2 --rounds 4` inside to one hash;
- bad input inside it exits non-zero with the message: a missing token file (the coordinator's, a
  peer's), an unreachable coordinator, a read-only volume;
- the compose stack (deploy/docker/compose.yml under podman-compose: a coordinator, a bootstrap peer,
  2 peers, Prometheus built from Debian's package) comes up, Prometheus reports every target up and
  every dashboard query returns data, the health checks pass, it goes down within the peers' grace
  time, and the bootstrap's named volume carries its checkpoint into the next `up`.

.ci/run prepares what needs the network: the base image (`SHOAL_TEST_BASE`, cached by podman between
runs on one machine), the wheel folder (`SHOAL_TEST_WHEELS`) and the Prometheus image
(`SHOAL_TEST_PROMETHEUS_IMAGE`). Without them the tests skip, and under CI they fail. The image is
built once for the file (README's `--dist loadfile` keeps it on one worker).
"""

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import free_port
from tests.integration.test_monitoring import _get, _query, _wait_for, dashboard_queries

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "protocol", "compression", "coordinator", "peer")
DOCKER = ROOT / "deploy" / "docker"
# podman's defaults here fail: crun cannot set rlimits, and the default nofile exceeds the host's limit
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""

pytestmark = pytest.mark.timeout(600)


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what} (.ci/run prepares it)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def podman(tmp_path_factory) -> Iterator[dict]:
    """The environment podman and podman-compose run with; skips without them or .ci/run's images."""
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            _missing(f"{tool} is not installed")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = dict(os.environ, CONTAINERS_CONF=str(conf))
    for variable in ("SHOAL_TEST_BASE", "SHOAL_TEST_WHEELS", "SHOAL_TEST_PROMETHEUS_IMAGE"):
        if not os.environ.get(variable):
            _missing(f"{variable} is not set")
    for image in (os.environ["SHOAL_TEST_BASE"], os.environ["SHOAL_TEST_PROMETHEUS_IMAGE"]):
        if _run(["podman", "image", "exists", image], env, check=False).returncode != 0:
            _missing(f"no image {image}")
    yield env


def _run(command: list[str], env: dict, *, check: bool = True, timeout: float = 300, **kwargs):
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command[:3])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def image(podman, tmp_path_factory) -> Iterator[str]:
    """The shoal image, built from this checkout on the Debian base, offline (--network none);
    SHOAL_TEST_IMAGE names one already built so, to skip the build while working on these tests."""
    if os.environ.get("SHOAL_TEST_IMAGE"):
        yield os.environ["SHOAL_TEST_IMAGE"]
        return
    context = tmp_path_factory.mktemp("context")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, context / name)
    (context / "deploy" / "docker").mkdir(parents=True)
    for name in ("Dockerfile", "Dockerfile.dockerignore", "install.sh"):
        shutil.copy2(DOCKER / name, context / "deploy" / "docker" / name)
    shutil.copytree(os.environ["SHOAL_TEST_WHEELS"], context / "deploy" / "docker" / "wheels")
    tag = f"localhost/shoal-test:{uuid.uuid4().hex[:12]}"
    command = ["podman", "build", "--format", "docker", "--network", "none"]
    command += ["--ignorefile", "deploy/docker/Dockerfile.dockerignore", "-f", "deploy/docker/Dockerfile"]
    command += ["--build-arg", f"BASE={os.environ['SHOAL_TEST_BASE']}", "-t", tag, "."]
    _run(command, podman, cwd=context, timeout=500)
    try:
        yield tag
    finally:
        _run(["podman", "rmi", "-f", tag], podman, check=False)


def test_the_image_trains_a_demo_offline_as_a_non_root_user(podman, image):
    inspected = json.loads(_run(["podman", "image", "inspect", image], podman).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["shoal"]
    health = inspected.get("Healthcheck") or config.get("Healthcheck")  # podman's place, Docker's
    assert health["Test"] == ["CMD", "shoal", "health"]
    command = ["podman", "run", "--rm", "--network", "none", image]
    summary = json.loads(_run([*command, "demo", "--peers", "2", "--rounds", "4", "--json"], podman).stdout)
    assert summary["param_hash_agree"] is True
    assert summary["rounds"] == 4 and summary["final_loss"] < summary["initial_loss"]
    assert _run([*command, "health"], podman, check=False).returncode == 1  # nothing serves metrics


def test_bad_input_in_the_image_exits_non_zero_with_the_message(podman, image):
    run = ["podman", "run", "--rm", "--network", "none"]
    missing = _run([*run, image, "coordinator", "--token-file", "/nowhere/tokens"], podman, check=False)
    assert missing.returncode == 2
    assert "cannot read the token file /nowhere/tokens" in missing.stderr
    peer = [image, "join", "--coordinator", "127.0.0.1:9", "--coordinator-token-file", "/nowhere/token"]
    missing = _run([*run, *peer], podman, check=False)
    assert missing.returncode == 2
    assert "--coordinator-token-file: cannot read /nowhere/token" in missing.stderr

    started = time.monotonic()
    join = [image, "join", "--coordinator", "127.0.0.1:9", "--coordinator-wait", "5", "--round-seconds", "2"]
    unreachable = _run(run + join, podman, check=False, timeout=120)
    assert unreachable.returncode == 2, unreachable.stderr[-2000:]
    assert "the coordinator 127.0.0.1:9 has not answered" in unreachable.stderr
    assert time.monotonic() - started < 90  # told, not trained around forever

    volume = f"shoal-test-ro-{uuid.uuid4().hex[:8]}"
    _run(["podman", "volume", "create", volume], podman)
    try:
        mount = ["-v", f"{volume}:/var/lib/shoal:ro", image, "join", "--checkpoint-dir", "/var/lib/shoal/c"]
        read_only = _run(run + mount, podman, check=False)
    finally:
        _run(["podman", "volume", "rm", "-f", volume], podman, check=False)
    assert read_only.returncode == 2
    assert "--checkpoint-dir: cannot write in /var/lib/shoal/c (Read-only file system)" in read_only.stderr


class Stack:
    """deploy/docker/compose.yml under podman-compose, as project `name`, without Grafana (Docker Hub's)."""

    SERVICES = ("coordinator", "bootstrap", "peer", "prometheus")

    def __init__(self, env: dict, name: str, image: str, port: int):
        self.name, self.port = name, port
        self.env = dict(env, SHOAL_IMAGE=image, SHOAL_PEERS="2", SHOAL_ROUND_SECONDS="3")
        self.env.update(SHOAL_PROMETHEUS_IMAGE=os.environ["SHOAL_TEST_PROMETHEUS_IMAGE"])
        self.env.update(SHOAL_PROMETHEUS_PORT=str(port))
        self.base = f"http://127.0.0.1:{port}"

    def compose(self, *arguments: str, timeout: float = 240) -> subprocess.CompletedProcess:
        command = ["podman-compose", "-p", self.name, "-f", str(DOCKER / "compose.yml"), *arguments]
        return _run(command, self.env, timeout=timeout)

    def up(self) -> None:
        self.compose("up", "-d", "--no-build", *self.SERVICES)

    def containers(self) -> list[str]:
        label = f"label=io.podman.compose.project={self.name}"
        listed = _run(["podman", "ps", "-a", "--filter", label, "--format", "{{.Names}}"], self.env)
        return listed.stdout.split()

    def exit_code(self, container: str) -> int:
        inspected = _run(["podman", "inspect", container, "--format", "{{.State.ExitCode}}"], self.env)
        return int(inspected.stdout)

    def logs(self, container: str) -> str:
        done = _run(["podman", "logs", container], self.env, check=False)
        return done.stdout + done.stderr

    def volume_path(self, volume: str) -> Path:
        inspected = _run(["podman", "volume", "inspect", f"{self.name}_{volume}"], self.env)
        return Path(json.loads(inspected.stdout)[0]["Mountpoint"])

    def remove(self) -> None:
        for container in self.containers():
            _run(["podman", "rm", "-f", "-t", "0", container], self.env, check=False)
        for volume in ("coordinator-state", "bootstrap-state", "shared", "prometheus-data"):
            _run(["podman", "volume", "rm", "-f", f"{self.name}_{volume}"], self.env, check=False)


def test_the_compose_stack_is_monitored_goes_down_cleanly_and_keeps_its_checkpoints(podman, image):
    stack = Stack(podman, f"shoaltest{uuid.uuid4().hex[:8]}", image, free_port())
    try:
        stack.up()
        _check_monitored(stack)
        for container in stack.containers():  # the images' health checks, run as the runtime would
            health = _run(["podman", "healthcheck", "run", container], stack.env, check=False)
            assert health.returncode == 0, (container, health.stdout, health.stderr)

        started, stopped_at = time.monotonic(), time.time()
        stack.compose("stop", timeout=120)
        assert time.monotonic() - started < 60  # each peer left at its round's end, none was killed
        exits = {name: stack.exit_code(name) for name in stack.containers()}
        assert len(exits) == 5 and set(exits.values()) == {0}, exits
        stack.compose("down", timeout=120)
        assert stack.containers() == []
        checkpoints = list((stack.volume_path("bootstrap-state") / "checkpoints").glob("*"))
        newest = max((path.stat().st_mtime for path in checkpoints), default=0.0)
        assert newest >= stopped_at, "the bootstrap's stop wrote no checkpoint in its volume"

        stack.up()  # new containers, the same named volumes

        def resumed():
            said = stack.logs(f"{stack.name}_bootstrap_1")
            return "resumed from the checkpoint of round" in said or said[-400:]

        _wait_for(resumed, 120, "the bootstrap resuming from its volume's checkpoint", interval_s=0.2)
        stack.compose("down", "-v", timeout=120)
        assert stack.containers() == []
    finally:
        stack.remove()


def _check_monitored(stack: Stack) -> None:
    """Prometheus scrapes the coordinator, the bootstrap and both peers, and every dashboard query
    returns data; the swarm trains coordinated."""

    def all_targets_up():
        answer = json.loads(_get(f"{stack.base}/api/v1/targets"))
        health = [(t["labels"]["role"], t["health"]) for t in answer["data"]["activeTargets"]]
        up = sorted(role for role, state in health if state == "up")
        return up == ["coordinator", "peer", "peer", "peer"] or f"targets: {health}"

    _wait_for(all_targets_up, 240, "Prometheus reporting every target of the stack up", interval_s=0.2)

    queries = dashboard_queries()

    def every_query_answers():
        empty = [expr for expr in queries if not _query(stack.base, expr)]
        return not empty or f"no series for {empty}"

    # the checkpoint age needs the bootstrap's first checkpoint (round 10, 3 s rounds)
    _wait_for(every_query_answers, 180, "every dashboard query returning a series", interval_s=0.5)

    def members_in_sync():  # a joiner syncs first; one excluded as a straggler under load comes back
        active = _query(stack.base, 'shoal_coordinator_active_peers{role="coordinator"}')
        synced = _query(stack.base, "shoal_state_in_sync")
        counted = bool(active) and active[0]["value"][1] == "3"
        return (
            counted and [s["value"][1] for s in synced] == ["1"] * 3
        ) or f"active {active}, synced {synced}"

    _wait_for(members_in_sync, 90, "the coordinator counting the 3 peers, all in sync", interval_s=0.2)
