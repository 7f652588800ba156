"""Swarm peers as threads of the test's own process (as torchft runs its replicas): each is built as
`shoal join` builds one (tests.integration.swarm_peer.build) and trains on the one copy of the corpus
they share, with nothing to start but their DHTs. For tests that need no `kill -9` or SIGSTOP.

hivemind forks a process for each DHT: every DHT is started before any peer's thread (an exchange's
event loop, a trainer) exists, so that no fork copies a thread's half-held lock.
"""

import json
import threading
import time

import torch

from shoal.peer.config.spec import PeerSpec
from shoal.peer.data import stdlib_corpus
from shoal.peer.job.assembly import Workload, start_peer
from shoal.peer.models.loading import load_model
from shoal.peer.swarm.records import RoundSchedule
from tests.integration import faults as faults_module
from tests.integration import swarm_peer
from tests.integration.faults import Fault

STARTUP_S = 2.0  # and a second a peer, from the last DHT to round 0: every exchange and trainer built


def run_in_process(
    peers: int,
    rounds: int,
    round_seconds: float,
    timeout_s: float,
    *,
    faults: dict[int, str] | None = None,
    own: dict[int, dict] | None = None,
    strike_limit: int = 3,
    **flags,
) -> list[dict]:
    """`peers` peers with the spec of swarm_peer (and `flags`, by `shoal join` flag name) train rounds
    0 .. rounds - 1 on one clock, each in a thread of its own; returns their reports
    (swarm_peer.report_of), in order. `faults`: a peer's fault, KIND@ROUND (tests.integration.faults;
    not those that end its process); `own`: a peer's own flags. Raises what a peer raised, or
    TimeoutError."""
    faults, own = faults or {}, own or {}
    if any(faults_module.gone([Fault.parse(fault)]) for fault in faults.values()):
        raise ValueError("a fault that ends the process needs a process peer (test_swarm.run_swarm)")
    corpus = stdlib_corpus(max_bytes=2 << 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = PeerSpec.of(
        **(swarm_peer.SETTINGS | {"host": "127.0.0.1", "round_seconds": round_seconds} | flags)
    )
    specs, started = [spec], []
    try:
        started.append(start_peer(spec))  # the DHTs first: hivemind forks for each
        address = str(started[0].dht.get_visible_maddrs()[0])
        specs[0] = spec.changed(**own.get(0, {}))
        for i in range(1, peers):
            specs.append(spec.changed(initial_peers=(address,), **own.get(i, {})))
            started.append(start_peer(specs[-1]))
        schedule = RoundSchedule(start_time=time.time() + STARTUP_S + peers, round_seconds=round_seconds)
        for i, (peer, peer_spec) in enumerate(zip(started, specs, strict=True)):
            workload = Workload(torch.device("cpu"), load_model("tiny"), corpus)
            fault = [Fault.parse(faults[i])] if i in faults else []
            swarm_peer.build(peer, peer_spec, schedule, workload, fault, strike_limit)
        reports: list[dict | BaseException | None] = [None] * peers

        def run(i: int) -> None:
            try:
                reports[i] = swarm_peer.train(started[i], schedule, rounds - 1)
            except BaseException as error:  # handed to the test's thread
                reports[i] = error

        workers = [threading.Thread(target=run, args=(i,), name=f"peer{i}") for i in range(peers)]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if any(worker.is_alive() for worker in workers):
            raise TimeoutError(f"peers still training after {timeout_s} s")
        for report in reports:
            if isinstance(report, BaseException):
                raise report
        return json.loads(json.dumps(reports))  # as a process peer's report file reads
    finally:
        for peer in reversed(started):
            peer.close()
        torch.set_num_threads(threads)
