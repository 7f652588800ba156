"""What `shoal join` tells after each round, in the log and the metrics: of the data it trains on, the
held-out loss every --validate-every rounds (`tell_validation`) and the token ledger (`tell_ledger`: the
rounds it settled, the epoch, and with --audit-data on, the windows this peer trained); and a peer whose
payloads miss round after round (`tell_late`), one left alone (`tell_alone`) or cut off from the others
(`tell_isolation`)."""

from shoal.peer.config.spec import PeerSpec
from shoal.peer.data import validation_loss
from shoal.peer.data.ledger import Lane, TokenLedger
from shoal.peer.job.assembly import Workload
from shoal.peer.job.metrics import PeerMetrics
from shoal.peer.job.progress import Progress
from shoal.peer.swarm.directory import REJOIN_EVERY_S
from shoal.peer.swarm.isolation import ISOLATED_AFTER
from shoal.peer.swarm.records import RoundPlan, RoundStatus
from shoal.peer.swarm.relay import Reachability
from shoal.peer.train.trainer import RoundReport


def tell_ledger(
    progress: Progress,
    tokens: TokenLedger | None,
    senders: list[str],
    plan: RoundPlan,
    metrics: PeerMetrics | None,
    told: int,
) -> int:
    """The token ledger after a round: a `ledger` event for each round it settled after round `told`
    and each it settled again on an adopted ledger (whose claims it credited, by sender, and the
    digests of the round's class before and after: `Settled`), the epoch in the metrics, and with
    --audit-data on, what this peer's lane trained (a `trained` event, naming this peer by `senders`).
    Returns the last round settled."""
    lane = plan.lane
    if tokens is None:
        return told
    epoch, share, windows = tokens.progress()
    seq_len = tokens.seq_len
    settled_now = tokens.settled_after(told)
    # a round settled again on an adopted ledger is told once, as a replay, whether or not told before
    fresh = [settled for settled in settled_now if not settled.replayed]
    for settled in [*tokens.replays(), *fresh]:
        progress.event(
            "ledger",
            round=settled.round,
            credited={sender.hex(): n for sender, n in sorted(settled.credited.items())},
            duplicates=settled.duplicates,
            unledgered=settled.unledgered,
            epoch=epoch,
            epoch_progress=share,
            windows=tokens.windows,
            tokens_consumed=windows * seq_len,
            ledger_from=settled.before.hex(),
            ledger_to=settled.after.hex(),
            replayed=settled.replayed,
        )
    if metrics is not None:
        metrics.observe_ledger(epoch, share, windows * seq_len)
    if isinstance(lane, Lane) and lane.audit is not None:
        trained = [part for step in sorted(lane.audit) for part in lane.audit[step]]
        progress.event(
            "trained",
            round=lane.round,
            slot=lane.slot,
            slots=lane.slots,
            places=lane.windows,
            senders=senders,
            windows=[int(i) for ids, _ in trained for i in ids.tolist()],
            epochs=[int(e) for _, epochs in trained for e in epochs.tolist()],
        )
    return max([told] + [settled.round for settled in settled_now])


def tell_validation(
    settings: PeerSpec,
    progress: Progress,
    workload: Workload,
    batch_size: int,
    round_number: int,
    metrics: PeerMetrics | None,
) -> None:
    """Every --validate-every swarm rounds (the same rounds on every peer), the loss on the held-out
    batches, in the log and the metrics."""
    every = settings.data.validate_every
    if not every or (round_number + 1) % every:
        return
    loaded = workload.model
    loss = validation_loss(
        loaded.module, loaded.loss_fn, workload.streams.validation, loaded.seq_len, batch_size=batch_size
    )
    if loss is None:
        return
    progress.event("validation", round=round_number, loss=loss)
    if progress.log_format != "json":
        progress.message(f"Round {round_number}: validation loss {loss:.4f} (held-out batches)")
    if metrics is not None:
        metrics.validation_loss.set(loss)


LATE_TOLD = 3
RESYNCS_TOLD = 3
"""Rounds in a row a peer re-syncs before it is told why (`tell_resyncs`)."""
"""Rounds in a row a peer's payloads miss before it is told (one is bad luck: a busy machine)."""


def tell_late(
    progress: Progress, missed: int, late: tuple[int, int], report: RoundReport, round_s: float
) -> tuple[int, int]:
    """A peer whose payloads missed LATE_TOLD rounds in a row is told so, with why (its round's
    computation against the round's length) and what to change; and when it is on time again.
    `late`: (rounds missed before this one, of them in a row); returns the same after it."""
    before, streak = late
    streak = streak + 1 if missed > before else 0
    if streak == LATE_TOLD:
        progress.message(
            f"warning: this peer's payloads missed their round {streak} rounds in a row ({missed} in all): "
            f"round {report.round} computed for {report.compute_s:.1f} s and exchanged for "
            f"{report.exchange_s:.1f} s, in rounds of {round_s:g} s, so the others closed each round without "
            "it. Use a faster --device, a smaller --batch-size or --max-micro-batches, or a smaller "
            "--compute-fraction"
        )
        progress.event("late", late=True, round=report.round, missed=missed, compute_s=report.compute_s)
    elif late[1] >= LATE_TOLD and streak == 0:
        progress.message(f"this peer's payload made its round again (round {report.round})")
        progress.event("late", late=False, round=report.round, missed=missed)
    return missed, streak


def tell_resyncs(
    progress: Progress, status: RoundStatus, before: RoundStatus | None, streak: int, report: RoundReport
) -> int:
    """A peer whose state was replaced by the swarm's (a download, or a replay: an event each) RESYNCS_TOLD
    rounds in a row is told why, by the
    cause it can see: its payloads came late (the others moved on without it), or, on time, its device
    computes the shared step to other bits than the others' (shoal.peer.algorithms.canonical keeps
    those the same; a build of shoal or torch other than theirs may not). `before`: the status of the
    round before (None: none yet); returns the rounds in a row re-synced so far."""
    replayed = before is not None and status.replays > before.replays
    if replayed:  # caught up without a download (shoal.peer.swarm.replay)
        progress.event("replayed", round=report.round, replays=status.replays, bytes=status.replay_bytes)
    resynced = before is not None and status.resyncs > before.resyncs
    streak = streak + 1 if resynced or replayed else 0
    if streak == RESYNCS_TOLD:
        late = before is not None and status.late > before.late
        cause = (
            "its payloads came after the round's deadline, so the others moved on without them"
            if late
            else "this device computes the shared step to other bits than the others' devices (a shoal "
            "or torch version other than theirs?)"
        )
        progress.message(
            f"warning: this peer's state differed from the swarm's after each of the last {streak} rounds "
            f"and was replaced by theirs ({status.resync_bytes:,} state bytes pulled so far, "
            f"{status.replays} time(s) by replay): {cause}. "
            "Its payloads do not count while its state differs."
        )
        progress.event("resyncing", round=report.round, streak=streak, late=late, bytes=status.resync_bytes)
    return streak


def tell_alone(progress: Progress, alone: bool, report: RoundReport, peers_seen: int = 1) -> None:
    """A peer that trained with others and finds its round counted alone is told so, and when it has
    company again: alone when it sees no other peer (they left, or the node it joined through is gone);
    when it saw `peers_seen` - 1 others whose payloads did not count (late, of another state, not
    pulled in time), it says that instead, since they are there."""
    progress.event("alone", alone=alone, round=report.round, peers_seen=peers_seen)
    if alone and peers_seen > 1:
        progress.message(
            f"Round {report.round}: no other peer's payload counted, though this peer sees "
            f"{peers_seen - 1} other(s) of the run (their payloads came late, were of another state, "
            "or could not be pulled in time)"
        )
    elif alone:
        progress.message(
            f"Round {report.round}: this peer sees no other peer of the run (they left, or the node it "
            f"joined through is gone): it trains alone and dials its initial peers every {REJOIN_EVERY_S:g} s"
        )
    else:
        progress.message(f"Round {report.round}: this peer trains with {report.participants} peers again.")


def tell_isolation(progress: Progress, isolated: bool, round_number: int, reach: Reachability) -> None:
    """A peer that reaches none of the others (shoal.peer.swarm.isolation) is told so, and how to fix it."""
    progress.event("isolated", isolated=isolated, round=round_number)
    if not isolated:
        progress.message(f"Round {round_number}: this peer reaches the swarm again and takes part in it.")
        return
    progress.message(
        f"Round {round_number}: this peer pulled none of the other peers' updates in the last "
        f"{ISOLATED_AFTER} rounds, and none of them pulled its own: it can reach none of them "
        f"({reach.describe()}). It sits the rounds out, as its updates would only keep the others "
        f"waiting; it trains on and offers them again every {ISOLATED_AFTER} rounds. To take part, join "
        "through a `shoal bootstrap` node (it relays for peers behind NAT) or forward a port and pass "
        "--announce-maddrs; `shoal check` tells which case this peer is in."
    )
