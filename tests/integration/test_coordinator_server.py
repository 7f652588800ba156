"""The coordinator's gRPC server for real: `shoal coordinator` subprocesses on 127.0.0.1 (OS-chosen
ports) and one in-process `Coordinator`, driven by generated stubs. Each refusal is checked for its
exact status code and followed by a valid call, so that a refusal is known not to break the server:
tokens, malformed and oversized requests, out-of-order rounds, a round from join to result, health,
reflection, TLS, a restart on the same state file, the Prometheus metrics, and a peer's link heartbeating
at the pace the coordinator asks for."""

import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from shoal.coordinator.policy import Policy
from shoal.coordinator.server import MAX_REQUEST_BYTES, REFUSAL_DELAY_S, Coordinator
from shoal.peer.swarm.coordinator_link import CoordinatorLink
from shoal.protocol import coordinator_pb2 as pb
from shoal.protocol import coordinator_pb2_grpc
from tests.integration.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
A, B, C = (f"12D3KooW{c * 44}" for c in "ABC")
SWARM_TOKEN, A_TOKEN = "swarm-token-0123456789", "peer-a-token-0123456789"
DIGEST, STATE = bytes(range(32)), bytes(range(32, 64))
CALL_S = 5.0
Code = grpc.StatusCode


@contextlib.contextmanager
def launched(tmp_path: Path, *args: str, listen: str = "127.0.0.1:0", state: str = "c.db"):
    """A `shoal coordinator` process (stderr in STATE.err); yields (process, its first line of output)."""
    command = [sys.executable, "-m", "shoal.peer.cli", "coordinator", "--listen", listen]
    command += ["--state", str(tmp_path / state), "--log-format", "json", *args]
    with (tmp_path / f"{state}.err").open("a") as stderr:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
        )
        try:
            yield process, process.stdout.readline()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process.stdout.close()


@contextlib.contextmanager
def coordinator(tmp_path: Path, *args: str):
    """A `shoal coordinator` listening on 127.0.0.1:0; yields (process, address); killed on exit."""
    with launched(tmp_path, *args) as (process, line):
        assert line, f"the coordinator exited: {(tmp_path / 'c.db.err').read_text()[-2000:]}"
        event = json.loads(line)
        assert event["event"] == "listening"
        yield process, event["address"]


@contextlib.contextmanager
def channel(address: str, credentials: grpc.ChannelCredentials | None = None):
    """A client channel (TLS with `credentials`, checking the name "localhost")."""
    if credentials is None:
        opened = grpc.insecure_channel(address)
    else:
        opened = grpc.secure_channel(address, credentials, [("grpc.ssl_target_name_override", "localhost")])
    with opened:
        yield opened


def stub(opened: grpc.Channel) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(opened)


def auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def code(method, request, timeout: float = CALL_S, **kwargs) -> grpc.StatusCode:
    """The status code of one call (of the first message, for a stream)."""
    try:
        result = method(request, timeout=timeout, **kwargs)
        if hasattr(result, "__next__"):
            next(result)
            result.cancel()
    except grpc.RpcError as error:
        return error.code()
    return Code.OK


def report(peer_id: str, number: int, digest: bytes = DIGEST) -> pb.ReportRequest:
    return pb.ReportRequest(peer_id=peer_id, round=number, digest=digest, size=1000, samples=64)


def members(coordinator_stub, **kwargs) -> list[str]:
    status = coordinator_stub.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S, **kwargs)
    return [m.peer_id for m in status.members]


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.mark.timeout(30)
def test_tokens_and_unauthenticated_health(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"# the swarm's token, then peer A's own\n{SWARM_TOKEN}\n{A} {A_TOKEN}\n")
    with coordinator(tmp_path, "--token-file", str(tokens)) as (_, address), channel(address) as c:
        s, wrong = stub(c), auth("wrong-token-0123456789")
        assert code(s.Join, pb.JoinRequest(peer_id=A), metadata=wrong) == Code.UNAUTHENTICATED
        assert code(s.Join, pb.JoinRequest(peer_id=A)) == Code.UNAUTHENTICATED
        assert code(s.SwarmStatus, pb.SwarmStatusRequest()) == Code.UNAUTHENTICATED
        assert code(s.Rounds, pb.RoundsRequest(peer_id=A)) == Code.UNAUTHENTICATED
        assert code(s.Join, pb.JoinRequest(peer_id=B), metadata=auth(A_TOKEN)) == Code.PERMISSION_DENIED
        assert code(s.Rounds, pb.RoundsRequest(peer_id=B), metadata=auth(A_TOKEN)) == Code.PERMISSION_DENIED
        assert code(s.Join, pb.JoinRequest(peer_id=A), metadata=auth(A_TOKEN)) == Code.OK
        for peer_id in (B, C):  # the swarm token is valid for any peer
            assert code(s.Join, pb.JoinRequest(peer_id=peer_id), metadata=auth(SWARM_TOKEN)) == Code.OK
        assert members(s, metadata=auth(A_TOKEN)) == [A, B, C]  # a peer's token may ask about the swarm
        health = health_pb2_grpc.HealthStub(c)
        for service in ("", "shoal.v1.Coordinator"):  # no token: load balancers have none
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(30)
def test_malformed_and_oversized_requests(tmp_path):
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        s = stub(c)
        assert code(s.Heartbeat, pb.HeartbeatRequest(peer_id=A)) == Code.NOT_FOUND
        assert code(s.ReportReady, report(A, 0)) == Code.NOT_FOUND
        assert code(s.Leave, pb.LeaveRequest(peer_id=A)) == Code.NOT_FOUND
        for malformed in ("", "12D3KooW0OIl" + "A" * 40, "12D3KooW", "12D3KooW" + "A" * 200):
            assert code(s.Join, pb.JoinRequest(peer_id=malformed)) == Code.INVALID_ARGUMENT
        assert code(s.Rounds, pb.RoundsRequest(peer_id="not a peer id")) == Code.INVALID_ARGUMENT
        assert code(s.Join, pb.JoinRequest(peer_id=A, throughput=float("nan"))) == Code.INVALID_ARGUMENT
        huge = pb.JoinRequest(peer_id="A" * 100_000)
        assert huge.ByteSize() > MAX_REQUEST_BYTES
        assert code(s.Join, huge) == Code.RESOURCE_EXHAUSTED
        assert code(s.Join, pb.JoinRequest(peer_id=A)) == Code.OK
        assert code(s.ReportReady, report(A, 0, digest=DIGEST[:31])) == Code.INVALID_ARGUMENT
        assert code(s.ReportReady, pb.ReportRequest(peer_id=A, round=0, digest=DIGEST)) == (
            Code.INVALID_ARGUMENT  # size 0
        )
        assert code(s.Heartbeat, pb.HeartbeatRequest(peer_id=A, round=-2)) == Code.INVALID_ARGUMENT
        assert code(s.Heartbeat, pb.HeartbeatRequest(peer_id=A, round=-1)) == Code.OK
        assert s.ReportReady(report(A, 0), timeout=CALL_S).included
        assert members(s) == [A]


@pytest.mark.timeout(30)
def test_out_of_order_rounds(tmp_path):
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        s = stub(c)
        assert code(s.ReportReady, report(A, 0)) == Code.NOT_FOUND
        assert s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S).round == 0  # round 0 is announced
        assert code(s.ReportReady, report(A, 1)) == Code.OUT_OF_RANGE
        assert code(s.RoundResult, pb.RoundResultRequest(round=1)) == Code.OUT_OF_RANGE
        assert code(s.RoundResult, pb.RoundResultRequest(round=2**64 - 1)) == Code.OUT_OF_RANGE
        s.Join(pb.JoinRequest(peer_id=B), timeout=CALL_S)
        assert code(s.ReportReady, report(B, 0)) == Code.FAILED_PRECONDITION  # joined after it was announced
        assert s.ReportReady(report(A, 0), timeout=CALL_S).included  # the only expected peer: decided
        assert code(s.ReportReady, report(A, 0)) == Code.ALREADY_EXISTS
        s.Heartbeat(pb.HeartbeatRequest(peer_id=A, round=0), timeout=CALL_S)  # A finished 0: round 1
        assert code(s.ReportReady, report(A, 0, digest=STATE)) == Code.FAILED_PRECONDITION
        assert code(s.ReportReady, report(A, 2)) == Code.OUT_OF_RANGE
        assert s.ReportReady(report(A, 1), timeout=CALL_S).included
        assert code(s.ReportReady, report(B, 1, digest=DIGEST)) == Code.ALREADY_EXISTS  # A's payload
        assert code(s.RoundResult, pb.RoundResultRequest(round=1), timeout=0.5) == Code.DEADLINE_EXCEEDED
        assert s.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S).round == 1


@pytest.mark.timeout(30)
def test_a_round_from_join_to_result(tmp_path):
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        s = stub(c)
        joined = s.Join(pb.JoinRequest(peer_id=A, throughput=100.0, min_samples=64), timeout=CALL_S)
        assert joined.round == 0 and joined.heartbeat_timeout_s > 0
        rounds = s.Rounds(pb.RoundsRequest(peer_id=A), timeout=20)
        try:
            first = next(rounds)
            assert first.round == 0 and list(first.peers) == [A]
            assert first.now <= first.compute_deadline < first.exchange_deadline
            request = pb.ReportRequest(
                peer_id=A, round=0, digest=DIGEST, size=12345, samples=64, state=STATE, synced=True
            )
            waiting = s.RoundResult.future(pb.RoundResultRequest(round=0), timeout=CALL_S)
            assert s.ReportReady(request, timeout=CALL_S).included
            result = waiting.result()  # it waited for the round to be decided
            assert result.round == 0 and list(result.stragglers) == []
            expected = pb.Participant(
                peer_id=A, digest=DIGEST, size=12345, samples=64, state=STATE, synced=True
            )
            assert list(result.participants) == [expected]
            s.Heartbeat(pb.HeartbeatRequest(peer_id=A, round=0, exchange_s=0.5), timeout=CALL_S)
            second = next(rounds)  # pushed on the open stream
            assert second.round == 1 and list(second.peers) == [A]
            assert second.data_seed != first.data_seed
        finally:
            rounds.cancel()
        status = s.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S)
        assert status.round == 1 and [m.peer_id for m in status.members] == [A]
        assert status.members[0].round == 0 and status.members[0].throughput == 100.0
        s.Leave(pb.LeaveRequest(peer_id=A), timeout=CALL_S)
        assert members(s) == []


@pytest.mark.timeout(30)
def test_with_gather_the_result_lists_the_chosen_and_tallies_every_state(tmp_path):
    """`--gather 2` and 3 members that report: the result lists 2, the same for every caller, with the
    tally of all 3 states; `--gather -1` is refused."""
    with coordinator(tmp_path, "--gather", "2", "--min-peers", "3") as (_, address), channel(address) as c:
        s = stub(c)
        for peer in (A, B, C):
            s.Join(pb.JoinRequest(peer_id=peer), timeout=CALL_S)
        for i, peer in enumerate((A, B, C)):
            state = STATE if peer != C else DIGEST
            request = pb.ReportRequest(
                peer_id=peer, round=0, digest=bytes([i]) * 32, size=9, samples=8, state=state
            )
            assert s.ReportReady(request, timeout=CALL_S).included
        results = [s.RoundResult(pb.RoundResultRequest(round=0), timeout=CALL_S) for _ in range(2)]
    assert len(results[0].participants) == 2 and results[0].participants == results[1].participants
    assert results[0].reported == 3 and results[0].now <= results[1].now
    assert {(v.state, v.count) for v in results[0].votes} == {(STATE, 2), (DIGEST, 1)}
    with launched(tmp_path, "--gather", "-1", state="refused.db") as (process, _):
        assert process.wait(timeout=20) == 2
    assert "--gather" in (tmp_path / "refused.db.err").read_text()


@pytest.mark.timeout(30)
def test_overlap_announces_the_next_round_at_the_first_report(tmp_path):
    with coordinator(tmp_path, "--overlap", "--min-peers", "2") as (_, address), channel(address) as c:
        s = stub(c)
        s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S)
        s.Join(pb.JoinRequest(peer_id=B), timeout=CALL_S)
        assert s.ReportReady(report(A, 0), timeout=CALL_S).included
        # B is still computing round 0; a stream opened now shows both open rounds, oldest first
        rounds = s.Rounds(pb.RoundsRequest(peer_id=B), timeout=20)
        try:
            assert [next(rounds).round, next(rounds).round] == [0, 1]
        finally:
            rounds.cancel()
        assert code(s.RoundResult, pb.RoundResultRequest(round=0), timeout=0.5) == Code.DEADLINE_EXCEEDED
        assert s.ReportReady(report(A, 1, digest=STATE), timeout=CALL_S).included
        assert code(s.ReportReady, report(A, 2)) == Code.OUT_OF_RANGE  # two undecided rounds at most
        assert s.ReportReady(report(B, 0, digest=STATE), timeout=CALL_S).included
        result = s.RoundResult(pb.RoundResultRequest(round=0), timeout=CALL_S)
        assert [(p.peer_id, p.digest) for p in result.participants] == [(A, DIGEST), (B, STATE)]
        assert s.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S).round == 2  # round 1 had A's report


@pytest.mark.timeout(30)
def test_reflection_lists_the_services(tmp_path):
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        services = set(ProtoReflectionDescriptorDatabase(c).get_services())
        assert {"shoal.v1.Coordinator", "grpc.health.v1.Health"} <= services
        database = ProtoReflectionDescriptorDatabase(c)
        described = database.FindFileContainingSymbol("shoal.v1.Coordinator")
        assert "Join" in [m.name for m in described.service[0].method]


@pytest.mark.timeout(30)
def test_tls(tmp_path):
    cert, key = self_signed(tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    with coordinator(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key)) as (_, address):
        with channel(address, credentials) as c:
            assert stub(c).Join(pb.JoinRequest(peer_id=A), timeout=CALL_S).round == 0
        with channel(address) as c:
            assert code(stub(c).SwarmStatus, pb.SwarmStatusRequest()) == Code.UNAVAILABLE
        with channel(address, credentials) as c:
            assert members(stub(c)) == [A]


@pytest.mark.timeout(40)
def test_restart_keeps_members_and_round_numbers(tmp_path):
    with coordinator(tmp_path) as (process, address), channel(address) as c:
        s = stub(c)
        s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S)
        s.ReportReady(report(A, 0), timeout=CALL_S)
        s.Heartbeat(pb.HeartbeatRequest(peer_id=A, round=0), timeout=CALL_S)  # round 1 is announced
        before = s.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S).round
        assert before == 1
        rounds = s.Rounds(pb.RoundsRequest(peer_id=A), timeout=20)
        assert next(rounds).round == 1
        process.send_signal(signal.SIGTERM)  # a stream is open: it must not hold the shutdown up
        assert process.wait(timeout=15) == 0
        rounds.cancel()
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        s = stub(c)
        status = s.SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S)
        assert [m.peer_id for m in status.members] == [A] and status.round >= before
        assert s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S).round >= before
        result = s.RoundResult(pb.RoundResultRequest(round=0), timeout=CALL_S)
        assert [(p.peer_id, p.digest) for p in result.participants] == [(A, DIGEST)]


@pytest.mark.timeout(30)
def test_metrics(tmp_path):
    port = free_port()
    with coordinator(tmp_path, "--metrics-port", str(port)) as (_, address), channel(address) as c:
        s = stub(c)
        s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S)
        assert code(s.Heartbeat, pb.HeartbeatRequest(peer_id=B)) == Code.NOT_FOUND
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_S) as response:
            text = response.read().decode()
        assert "shoal_coordinator_active_peers 1.0" in text
        assert "shoal_coordinator_round 0.0" in text
        assert 'shoal_coordinator_refused_requests_total{code="not_found"} 1.0' in text


@pytest.mark.timeout(30)
def test_abuse_is_refused_slowly_and_counted_by_peer_and_address(tmp_path):
    """Heartbeats at 100x an honest peer's rate, a report padded past the request limit and a burst of
    swarm status reads: each refused with RESOURCE_EXHAUSTED after REFUSAL_DELAY_S and counted, while
    another peer's calls go through at once (the limits themselves: tests/unit/test_coordinator_limits.py)."""

    def codes(futures) -> list[grpc.StatusCode]:
        return [f.exception().code() if f.exception() is not None else Code.OK for f in futures]

    port = free_port()
    with coordinator(tmp_path, "--metrics-port", str(port)) as (_, address), channel(address) as c:
        s = stub(c)
        assert code(s.Join, pb.JoinRequest(peer_id=A)) == code(s.Join, pb.JoinRequest(peer_id=B)) == Code.OK
        started = time.monotonic()
        flood = [s.Heartbeat.future(pb.HeartbeatRequest(peer_id=A), timeout=CALL_S) for _ in range(100)]
        honest = time.monotonic()
        assert code(s.Heartbeat, pb.HeartbeatRequest(peer_id=B)) == Code.OK
        assert time.monotonic() - honest < REFUSAL_DELAY_S  # not behind the refusals
        flood = codes(flood)
        assert flood.count(Code.RESOURCE_EXHAUSTED) >= 80, flood
        assert time.monotonic() - started >= REFUSAL_DELAY_S
        padded = pb.ReportRequest(
            peer_id=B, round=0, digest=DIGEST, size=1000, samples=64, state=b"x" * 20_000
        )
        assert MAX_REQUEST_BYTES < padded.ByteSize() < 4 * MAX_REQUEST_BYTES
        assert code(s.ReportReady, padded) == Code.RESOURCE_EXHAUSTED
        reads = codes([s.SwarmStatus.future(pb.SwarmStatusRequest(), timeout=CALL_S) for _ in range(40)])
        assert Code.RESOURCE_EXHAUSTED in reads and reads[:10] == [Code.OK] * 10
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_S) as response:
            text = response.read().decode()
    counted = {
        line.partition(" ")[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(("shoal_coordinator_rate_limited", "shoal_coordinator_oversized"))
    }
    assert counted['shoal_coordinator_rate_limited_requests_total{by="peer",method="heartbeat"}'] >= 80
    assert counted['shoal_coordinator_rate_limited_requests_total{by="address",method="swarmstatus"}'] >= 1
    assert counted['shoal_coordinator_oversized_requests_total{method="report"}'] == 1


@pytest.mark.timeout(30)
def test_in_process_start_and_stop(tmp_path):
    """The `Coordinator` class itself, with a grpc.aio client: start() returns the port, stop() frees it
    even with a `Rounds` stream open."""

    async def scenario() -> None:
        server = Coordinator(listen="127.0.0.1:0", state_path=tmp_path / "c.db", policy=Policy())
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as c:
                s = stub(c)
                await s.Join(pb.JoinRequest(peer_id=A), timeout=CALL_S)
                rounds = s.Rounds(pb.RoundsRequest(peer_id=A), timeout=20)
                assert (await rounds.read()).peers == [A]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await s.Heartbeat(pb.HeartbeatRequest(peer_id=B), timeout=CALL_S)
                assert refused.value.code() == Code.NOT_FOUND
                await server.stop(grace_s=0.5)
                with pytest.raises(grpc.aio.AioRpcError) as gone:
                    await rounds.read()
                assert gone.value.code() in (Code.UNAVAILABLE, Code.CANCELLED)
        finally:
            await server.stop(grace_s=0)
        with socket.socket() as probe:  # the port is free again (closed connections may linger in TIME_WAIT)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))

    asyncio.run(asyncio.wait_for(scenario(), 20))


@pytest.mark.timeout(30)
def test_a_second_coordinator_on_the_same_port_does_not_start(tmp_path):
    with coordinator(tmp_path) as (_, address), channel(address) as c:
        stub(c).Join(pb.JoinRequest(peer_id=A), timeout=CALL_S)
        with launched(tmp_path, listen=address, state="second.db") as (second, line):
            assert line == "" and second.wait(timeout=10) == 1
        for _ in range(10):  # every client still reaches the one coordinator
            with channel(address) as fresh:
                assert members(stub(fresh)) == [A]


@pytest.mark.parametrize("trouble", ["port held by another socket", "invalid TLS files"])
@pytest.mark.timeout(30)
def test_a_port_it_cannot_serve_is_a_clean_error(tmp_path, trouble):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a PEM file\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        if trouble == "port held by another socket":
            listen, args = f"127.0.0.1:{held.getsockname()[1]}", []
        else:
            listen, args = "127.0.0.1:0", ["--tls-cert", str(garbage), "--tls-key", str(garbage)]
        with launched(tmp_path, *args, listen=listen) as (process, line):
            assert line == "" and process.wait(timeout=10) == 1
    errors = (tmp_path / "c.db.err").read_text()
    assert "shoal coordinator: error:" in errors and "Traceback" not in errors  # gRPC's own log lines aside


@pytest.mark.timeout(30)
def test_a_peer_link_heartbeats_within_the_timeout_its_join_reply_states(tmp_path):
    """`CoordinatorLink` (the peers' side) against the in-process server: it takes a third of the stated
    timeout as its heartbeat interval and, idle, stays a member over several timeouts."""

    async def scenario() -> None:
        policy = Policy(heartbeat_timeout_s=0.9)
        server = Coordinator(listen="127.0.0.1:0", state_path=tmp_path / "c.db", policy=policy)
        port = await server.start()
        link = CoordinatorLink(f"127.0.0.1:{port}", A)
        try:
            await link.start()
            assert await link.wait_connected(datetime.timedelta(seconds=5))
            assert link.heartbeat_interval == pytest.approx(0.3)
            await asyncio.sleep(4 * policy.heartbeat_timeout_s)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as c:
                status = await stub(c).SwarmStatus(pb.SwarmStatusRequest(), timeout=CALL_S)
            assert [m.peer_id for m in status.members] == [A] and link.member and link.connected
        finally:
            await link.stop()
            await server.stop(grace_s=0)

    asyncio.run(asyncio.wait_for(scenario(), 20))
