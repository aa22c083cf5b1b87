"""The scheduler with real threads: a decoder thread and a trainer thread share one Scheduler."""

from __future__ import annotations

import threading
import time

import pytest

from remat.base.settings import Cancelled
from remat.serve import scheduler
from remat.serve.scheduler import Scheduler

CHUNK = 0.01  # seconds of "training" per chunk


def chunk(s: Scheduler, cancelled=lambda: False) -> tuple[float, float]:
    s.before_chunk(cancelled)
    t0 = time.monotonic()
    time.sleep(CHUNK)
    t1 = time.monotonic()
    s.chunk_done(t1 - t0)
    return t0, t1


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def polls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The scheduler's waits (each a poll of `POLL_SECONDS`), recorded as they happen."""
    made: list[float] = []
    sleep = time.sleep
    monkeypatch.setattr(scheduler.time, "sleep", lambda seconds: made.append(seconds) or sleep(seconds))
    return made


def test_no_decoding_runs_chunks_at_once(monkeypatch):
    s = Scheduler(50_000)
    waits = polls(monkeypatch)
    for _ in range(10):
        s.before_chunk(lambda: False)
        s.chunk_done(0.0)
    assert waits == []  # no decoding: no chunk waited a single poll
    stats = s.stats()
    assert stats["chunks"] == 10
    assert stats["slowdown_ppm"] == 0 and stats["busy_seconds"] == 0


@pytest.mark.parametrize("ppm", [50_000, 200_000])
def test_overlap_stays_within_the_bound(ppm):
    s = Scheduler(ppm)
    chunk(s)  # learned while idle: the scheduler now expects ~10 ms chunks
    busy: list[tuple[float, float]] = []
    chunks: list[tuple[float, float]] = []
    done = threading.Event()

    def decoder():
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            s.decode_begin()
            t0 = time.monotonic()
            for _ in range(4):  # a 20 ms request, reported step by step
                time.sleep(0.005)
                s.step(1, 0.005)
            s.decode_end()
            busy.append((t0, time.monotonic()))
            time.sleep(0.001)  # a short gap between requests: not long enough for a chunk
        done.set()

    def trainer():
        try:
            while True:
                chunks.append(chunk(s, done.is_set))
        except Cancelled:
            pass

    threads = [threading.Thread(target=decoder), threading.Thread(target=trainer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    bound = ppm / 1e6
    busy_time = sum(e - b for b, e in busy)
    longest = max(e - b for b, e in chunks)
    measured = overlap(chunks, busy)
    # Admission keeps overlap within the budget; the last chunk may overrun its estimate.
    assert measured <= bound * busy_time + longest + 0.005, (measured, busy_time, longest)
    assert measured >= 0.25 * bound * busy_time  # and it does let training through while decoding
    stats = s.stats()
    assert stats["max_slowdown_ppm"] == ppm
    assert stats["overlap_seconds"] == pytest.approx(measured, abs=0.02)
    assert stats["waited_seconds"] > 0.5  # the trainer spent most of the second yielding


def test_cancel_while_waiting_raises_promptly(monkeypatch):
    """Waiting for decoding, the trainer looks at the cancellation before every poll: cancelled after its third
    poll, it raises before a fourth."""
    s = Scheduler(0)  # never overlaps decoding
    s.decode_begin()
    waits = polls(monkeypatch)
    with pytest.raises(Cancelled):
        s.before_chunk(lambda: len(waits) >= 3)
    assert waits == [scheduler.POLL_SECONDS] * 3
    with pytest.raises(Cancelled):  # cancelled before it starts: raised at once, even when idle
        Scheduler().before_chunk(lambda: True)


def test_windows_p50_p95_and_since():
    s = Scheduler()
    for i in range(1, 21):
        s.chunk_done(i / 100)  # 0.01 .. 0.20
    stats = s.stats()
    assert stats["chunks"] == 20
    assert stats["window_p50"] == pytest.approx(0.11)  # sorted[round(0.5 * 19)] = sorted[10]
    assert stats["window_p95"] == pytest.approx(0.19)  # sorted[round(0.95 * 19)] = sorted[18]
    mark = s.mark()
    s.chunk_done(1.0)
    s.chunk_done(3.0)
    since = s.stats(since=mark)
    assert (since["chunks"], since["window_p50"], since["window_p95"]) == (2, 1.0, 3.0)
    assert Scheduler().stats()["window_p50"] is None


def test_view_and_measured_slowdown_by_batch_size():
    s = Scheduler()
    assert s.view().busy_slots == 0 and s.view().idle_ms >= 0
    s.decode_begin()
    s.decode_begin()
    for _ in range(10):
        s.step(2, 0.1)  # a batch of two: 0.1 s a step with no training
    s.step(1, 0.05)  # a batch of one is faster a step, training or not
    view = s.view()
    assert (view.busy_slots, view.idle_ms, view.tokens_generated) == (2, 0.0, 21)
    assert s.stats()["slowdown_source"] == "overlap_fraction"
    s.decode_end()
    s.decode_end()
    s.decode_end()  # an unmatched end is ignored
    time.sleep(0.02)
    assert s.view().busy_slots == 0 and s.view().idle_ms >= 15
    mark = s.mark()
    s.before_chunk(lambda: False)  # idle: admitted at once; a chunk now runs
    for _ in range(4):
        s.step(2, 0.15)  # the same batch of two while it runs: 50% slower a step
    s.step(3, 1.0)  # a batch size never seen clean: left out (there is nothing to compare it with)
    s.chunk_done(0.01)
    stats = s.stats()
    # batches of two took 1.0 + 0.6 s for 14 steps (0.1 s a step clean: 1.4 s), of one 0.05 s as clean ones do
    assert stats["slowdown_source"] == "measured"
    assert stats["slowdown_ppm"] == pytest.approx((1.6 + 0.05) / (1.4 + 0.05) * 1e6 - 1e6, abs=1)
    assert s.view().tokens_generated == 21 + 8 + 3
    # since the mark there were no clean steps: the overlap fraction stands in
    assert s.stats(since=mark)["slowdown_source"] == "overlap_fraction"


def test_rejects_bad_bound():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            Scheduler(bad)
