"""The files of deploy/ and the metrics they read.

- every YAML and JSON file parses; the Prometheus configs pass `promtool check config`, the alert
  rules `promtool check rules`, and promtool's rule unit tests (each alert firing on a synthetic series,
  silent on a healthy one) pass;
- every metric a dashboard query, an alert rule or a rule test names is one a peer or the coordinator
  exports;
- every shoal command in the Docker, compose, systemd and Kubernetes files parses with shoal's own
  parser and settings, as do the README's "Monitor a swarm" commands;
- the metrics follow Prometheus' naming conventions and keep peer ids off every series but build_info.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shoal.coordinator.metrics import CoordinatorMetrics
from shoal.peer.cli import build_parser
from shoal.peer.config import settings
from shoal.peer.job.metrics import REJECTION_REASONS, PeerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
METRIC = re.compile(r"\bshoal_[a-z0-9_]+")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


def _counters() -> dict:
    return {
        "sent": {"payload": 10, "dht": 3},
        "received": {"payload": 7},
        "rejected": {"digest_mismatch": 1},
        "strikes": 1,
        "banned": 0,
        "refused": 0,
        "resyncs": 0,
        "replays": 1,
        "replay_bytes": 300,
        "synced": True,
        "stragglers": 2,
        "late": 0,
        "coordinated_rounds": 4,
        "relayed": 1,
        "butterfly_rounds": 3,
        "pieces_recomputed": 1,
        "isolated": False,
        "rejoins": 0,
        "isolated_rounds": 0,
        "left_out": 0,
    }


def peer_exposition() -> str:
    metrics = PeerMetrics(info={"version": "0", "peer_id": "12D3KooWtest", "device": "cpu"}, dense_bytes=4000)
    metrics.track_exchange(_counters)
    metrics.track_device_memory(lambda: 123.0)
    metrics.track_checkpoints(lambda: 0.0, lambda: 0)
    phases = dict.fromkeys(("compute", "encode", "exchange", "decode", "apply"), 0.1)
    report = SimpleNamespace(round=3, loss=4.5, tokens=1024, samples=8, participants=2, phases=phases)
    metrics.observe_round(report, wall_s=1.0, payload_bytes=100, peers_seen=3, stragglers=1)
    return generate_latest(metrics.registry).decode()


def coordinator_exposition() -> str:
    return generate_latest(CoordinatorMetrics().registry).decode()


def exported_names() -> set[str]:
    names = set()
    for text in (peer_exposition(), coordinator_exposition()):
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
    return names


def deploy_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


# --- the files parse ---


def test_every_yaml_and_json_file_parses():
    yamls, jsons = deploy_files(".yml", ".yaml"), deploy_files(".json")
    assert len(yamls) >= 12 and len(jsons) >= 1
    for path in yamls:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, path
    for path in jsons:
        json.loads(path.read_text())


def test_kubernetes_manifests_have_what_the_issue_asks_for():
    kinds = {}
    for path in (DEPLOY / "kubernetes").glob("*.yaml"):
        for document in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= document.keys(), path
            kinds.setdefault(document["kind"], []).append(document)
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap"} <= kinds.keys()
    peers = next(s for s in kinds["StatefulSet"] if s["metadata"]["name"] == "shoal-peer")
    container = peers["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] in (1, "1")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/shoal" in mounts and peers["spec"]["volumeClaimTemplates"]
    coordinator = next(d for d in kinds["Deployment"] if "coordinator" in d["metadata"]["name"])
    assert coordinator["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] == 7733


@pytest.mark.parametrize("version", ["1.27", "latest"])
def test_kubernetes_manifests_pass_the_api_schemas_strictly(version):
    """kubernetes-validate checks each object against the OpenAPI schemas of that Kubernetes release,
    which it bundles (no cluster, no network): required fields, types, enums and, strictly, no unknown
    field. 1.27 is the oldest release the manifests support (gRPC probes); a typo'd field fails."""
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("kubernetes-validate is not installed (the dev extra has it)")
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    documents = [
        document
        for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
    ]
    assert len(documents) >= 8
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)
    peers = next(d for d in documents if d["metadata"]["name"] == "shoal-peer" and d["kind"] == "StatefulSet")
    container = peers["spec"]["template"]["spec"]["containers"][0]
    for broken in ({"imagePullPolicyy": "Always"}, {"ports": [{"containerPort": "31337"}]}):
        mutated = json.loads(json.dumps(peers))
        mutated["spec"]["template"]["spec"]["containers"][0] = {**container, **broken}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(mutated, version, strict=True)


def test_systemd_units_restart_and_keep_state():
    for name in ("shoal-peer.service", "shoal-coordinator.service"):
        text = (DEPLOY / "systemd" / name).read_text()
        assert "Restart=on-failure" in text and "StateDirectory=shoal" in text, name
        assert re.search(r"^ExecStart=\S+/shoal (join|coordinator) ", text, re.M), name


def test_compose_runs_bootstrap_coordinator_peers_prometheus_grafana():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yml").read_text())
    assert {"bootstrap", "coordinator", "peer", "prometheus", "grafana"} <= compose["services"].keys()
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile, re.M) and "cuda" in dockerfile
    # the files compose mounts exist
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / "docker" / source).exists(), source


def test_grafana_dashboard_is_well_formed():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "shoal.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)) and refs, panel["title"]
        assert all(target["datasource"]["uid"] == "${datasource}" for target in panel["targets"])
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for wanted in (
        "loss",
        "tokens/s",
        "phase",
        "bytes per round",
        "compression",
        "participants",
        "stragglers",
    ):
        assert wanted in titles, wanted
    assert any(panel["type"] == "table" for panel in dashboard["panels"])  # the per-peer table
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "shoal.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


# --- promtool ---


@pytest.mark.parametrize("config", sorted(p.name for p in (DEPLOY / "prometheus").glob("prometheus*.yml")))
def test_promtool_check_config(config):
    result = subprocess.run(
        [_promtool(), "check", "config", str(DEPLOY / "prometheus" / config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules_and_rule_unit_tests():
    promtool = _promtool()
    rules = DEPLOY / "prometheus" / "rules" / "shoal.yml"
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0 and "6 rules found" in checked.stdout, checked.stdout + checked.stderr
    tests = DEPLOY / "prometheus" / "tests" / "rules.test.yml"
    tested = subprocess.run(
        [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    # every alert has a firing case and a silent one
    cases = yaml.safe_load(tests.read_text())["tests"]
    alerts = {
        rule["alert"] for group in yaml.safe_load(rules.read_text())["groups"] for rule in group["rules"]
    }
    for alert in alerts:
        outcomes = [
            bool(t["exp_alerts"]) for c in cases for t in c["alert_rule_test"] if t["alertname"] == alert
        ]
        assert True in outcomes and False in outcomes, alert


def test_exported_metrics_pass_promtool_check_metrics():
    promtool = _promtool()
    for text in (peer_exposition(), coordinator_exposition()):
        result = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


# --- names ---


def test_deploy_files_reference_only_metrics_that_exist():
    exported = exported_names()
    referenced: dict[str, set[str]] = {}
    sources = [
        DEPLOY / "grafana" / "dashboards" / "shoal.json",
        DEPLOY / "prometheus" / "rules" / "shoal.yml",
        DEPLOY / "prometheus" / "tests" / "rules.test.yml",
        ROOT / "README.md",
    ]
    for path in sources:
        for name in METRIC.findall(path.read_text()):
            referenced.setdefault(name, set()).add(path.name)
    missing = {name: files for name, files in referenced.items() if name not in exported}
    assert not missing, missing
    # the dashboard reads every family the issue lists
    dashboard = (DEPLOY / "grafana" / "dashboards" / "shoal.json").read_text()
    for family in (
        "shoal_training_loss",
        "shoal_tokens_total",
        "shoal_round_phase_duration_seconds",
        "shoal_sent_bytes_total",
        "shoal_compression_ratio",
        "shoal_round_participants",
        "shoal_rounds_trained_together_total",
        "shoal_stragglers_total",
        "shoal_rejected_payloads_total",
        "shoal_coordinator_round",
        "shoal_coordinator_active_peers",
    ):
        assert family in dashboard, family


def test_metric_names_follow_prometheus_conventions():
    for text in (peer_exposition(), coordinator_exposition()):
        for family in text_string_to_metric_families(text):
            assert family.name.startswith("shoal_"), family.name
            assert not re.search(r"_(ms|milliseconds|kb|mb|bytes_total_)", family.name), family.name
            for sample in family.samples:
                if family.type == "counter" and not sample.name.endswith("_created"):
                    assert sample.name.endswith("_total"), sample.name
                if sample.name.endswith("_created"):
                    continue
                assert not {"peer", "peer_id"} & sample.labels.keys() or family.name == "shoal_build_info", (
                    sample
                )
    # the issue's families
    names = exported_names()
    for name in (
        "shoal_round",
        "shoal_training_loss",
        "shoal_tokens_total",
        "shoal_samples_total",
        "shoal_tokens_per_second",
        "shoal_round_phase_duration_seconds_bucket",
        "shoal_sent_bytes_total",
        "shoal_received_bytes_total",
        "shoal_compression_ratio",
        "shoal_peers_seen",
        "shoal_round_participants",
        "shoal_rounds_trained_together_total",
        "shoal_stragglers_total",
        "shoal_rejected_payloads_total",
        "shoal_strikes_total",
        "shoal_state_resyncs_total",
        "shoal_state_replays_total",
        "shoal_checkpoint_age_seconds",
        "shoal_checkpoint_write_failures_total",
        "shoal_device_memory_used_bytes",
        "shoal_build_info",
        "shoal_coordinator_round",
        "shoal_coordinator_participants",
        "shoal_coordinator_stragglers_total",
        "shoal_coordinator_evictions_total",
        "shoal_coordinator_round_duration_seconds_count",
        "shoal_coordinator_active_peers",
    ):
        assert name in names, name


def test_peer_metrics_values_follow_the_round():
    families = {f.name: f for f in text_string_to_metric_families(peer_exposition())}
    value = {
        f: families[f].samples[0].value
        for f in ("shoal_round", "shoal_training_loss", "shoal_compression_ratio")
    }
    assert value == {"shoal_round": 3, "shoal_training_loss": 4.5, "shoal_compression_ratio": 40.0}
    sent = {
        s.labels["kind"]: s.value for s in families["shoal_sent_bytes"].samples if s.name.endswith("_total")
    }
    assert sent == {"payload": 10, "state": 0, "replay": 0, "probe": 0, "dht": 3}
    rejected = {s.labels["reason"]: s.value for s in families["shoal_rejected_payloads"].samples}
    assert rejected["digest_mismatch"] == 1 and set(REJECTION_REASONS) <= rejected.keys()
    phases = {s.labels["phase"] for s in families["shoal_round_phase_duration_seconds"].samples}
    assert phases == {"compute", "encode", "exchange", "decode", "apply"}


def test_every_rejection_reason_in_the_code_is_exported_from_the_start():
    """Reasons are fixed strings of the code (low cardinality); each is a series at 0 until it
    happens, so that the dashboard and the alerts see a healthy peer's zeros."""
    reasons = set()
    for path in [*ROOT.glob("peer/*.py"), *ROOT.glob("compression/*.py"), *ROOT.glob("protocol/*.py")]:
        text = path.read_text()
        reasons.update(re.findall(r'MalformedPayloadError\(\s*"([a-z_]+)"', text))
        reasons.update(re.findall(r'rejected\["([a-z_]+)"\]', text))
    assert len(reasons) > 15
    assert reasons <= set(REJECTION_REASONS), reasons - set(REJECTION_REASONS)


# --- commands ---


def _check_command(where: str, argv: list[str]) -> str:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: shoal {' '.join(argv)} does not parse")
    if args.command == "join":
        flags = {k: v for k, v in vars(args).items() if k in settings.PARSERS}
        settings.resolve(flags, {}, None)  # raises SettingsError on a bad value
    return args.command


def _shell_commands(text: str) -> list[list[str]]:
    """`exec shoal ...` inside a shell string, up to the next `;` or the end."""
    return [shlex.split(m.group(1)) for m in re.finditer(r"exec shoal (.*?)(?:;|$)", text, re.S)]


def deploy_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for path in sorted((DEPLOY / "docker").glob("compose*.yml")):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            command = service.get("command")
            if command is None or not service.get("image", "shoal").startswith("shoal"):
                continue
            if service.get("entrypoint") == ["sh", "-c"]:
                commands += [
                    (f"{path.name}:{name}", c) for c in _shell_commands(command[0].replace("$$", "$"))
                ]
            else:
                commands.append((f"{path.name}:{name}", [str(part) for part in command]))
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["shoal"\]$', dockerfile, re.M)
    commands.append(("Dockerfile CMD", json.loads(re.search(r"^CMD (.*)$", dockerfile, re.M).group(1))))
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        for match in re.finditer(r"^ExecStart=\S+/shoal (.*)$", path.read_text(), re.M):
            commands.append((path.name, shlex.split(match.group(1))))
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document["kind"] in ("Deployment", "StatefulSet"):
                for container in document["spec"]["template"]["spec"]["containers"]:
                    commands.append((f"{path.name}:{document['metadata']['name']}", container["args"]))
    return commands


def test_every_deploy_command_parses_with_shoals_own_parser():
    commands = deploy_commands()
    ran = {_check_command(where, [str(a) for a in argv]) for where, argv in commands}
    assert {"join", "coordinator", "demo"} <= ran
    # peers serve metrics where the Prometheus configs look for them
    joins = [argv for _, argv in commands if argv[0] == "join"]
    assert joins and all("--metrics-port" in argv for argv in joins)


def test_readme_monitoring_commands_parse():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Monitor a swarm", 1)[1].split("\n## ", 1)[0]
    shoal_lines = [line for line in re.findall(r"^(shoal .*)$", section, re.M)]
    assert shoal_lines
    for line in shoal_lines:
        argv = shlex.split(line.split(" #")[0].replace(" &", ""))[1:]
        _check_command("README", argv)
    assert "deploy/prometheus/prometheus.yml" in section and "deploy/grafana" in section
