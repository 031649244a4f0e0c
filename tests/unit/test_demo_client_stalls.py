"""Which of the external client's requests a stall of its own event loop made mismeasure: only a
delayed read of the first or the last token moves a request's TPOT (last − first)."""

from __future__ import annotations

from batchknee.demo.client import STALL_BACKLOG_S, STALL_S, ClientRecord, ExternalClient


def record(first_at: float, last_at: float) -> ClientRecord:
    return ClientRecord("ctx", "pod", first_at - 1.0, 256, 1.0, 0.02, None, False, first_at, last_at)


def test_a_stall_marks_the_requests_whose_first_or_last_read_it_delayed() -> None:
    client = ExternalClient(list, model="m", speedup=20.0)
    client.stalls = [(10.0, 10.3), (20.0, 20.05)]  # (wall from, wall until) the loop woke late
    first_late = record(10.3 + STALL_BACKLOG_S / 2, 11.0)  # read as the loop worked off the pile
    last_late = record(9.5, 10.3)
    through = record(9.8, 10.6)  # the stall fell between its first and last read: neither moved
    short = record(20.05, 20.6)  # a delay under STALL_S moves the figure either way; not marked
    clear = record(12.0, 12.4)
    client.records = [first_late, last_late, through, short, clear]
    client.mark_stalls()
    assert [r.stalled for r in client.records] == [True, True, False, False, False]
    assert first_late.stall_s == last_late.stall_s == 0.3
    assert short.stall_s == 0.05 < STALL_S and through.stall_s == clear.stall_s == 0.0
    no_tokens = ClientRecord("ctx", "pod", 10.0, 0, None, None, "refused", False)
    client.records = [no_tokens]
    client.mark_stalls()
    assert not no_tokens.stalled
