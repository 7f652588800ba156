"""What `shoal join` tells, after each round, of the data it trains on: the held-out loss every
--validate-every rounds (`tell_validation`), and the token ledger (`tell_ledger`: the rounds it
settled, the epoch, and with --audit-data on, the windows this peer trained), in the log and the
metrics."""

from shoal.peer.assembly import Workload
from shoal.peer.data import validation_loss
from shoal.peer.progress import Progress


def tell_ledger(progress: Progress, exchange, plan, metrics, told: int) -> int:
    """The token ledger after a round: a `ledger` event for each round it settled after round `told`
    (whose claims it credited, by sender), the epoch in the metrics, and with --audit-data on, what
    this peer's lane trained (a `trained` event). Returns the last round settled."""
    tokens, lane = exchange.tokens, plan.lane
    if tokens is None:
        return told
    epoch, share, windows = tokens.progress()
    seq_len = tokens.seq_len
    settled_now = tokens.settled_after(told)
    for settled in settled_now:
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
        )
    if metrics is not None:
        metrics.observe_ledger(epoch, share, windows * seq_len)
    if lane is not None and lane.audit is not None:
        trained = [part for step in sorted(lane.audit) for part in lane.audit[step]]
        progress.event(
            "trained",
            round=lane.round,
            slot=lane.slot,
            slots=lane.slots,
            places=lane.windows,
            senders=[exchange.owner.hex(), exchange.peer_id.encode().hex()],
            windows=[int(i) for ids, _ in trained for i in ids.tolist()],
            epochs=[int(e) for _, epochs in trained for e in epochs.tolist()],
        )
    return max([told] + [settled.round for settled in settled_now])


def tell_validation(
    settings, progress, workload: Workload, batch_size: int, round_number: int, metrics
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
