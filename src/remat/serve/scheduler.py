"""The scheduler: training yields to decoding so that decoding is slowed by at most `max_slowdown_ppm`.

Training runs in chunks (one graph run each, with whatever the trainer does until the next chunk).
Before each chunk the trainer calls `before_chunk`, which reads the serving view and decides:

- no slot is decoding: the chunk runs at once; training then slows nobody. (One exception: when
  training is in debt, see below, it waits until decoding has paused for as long as a chunk takes, so
  a trainer cannot slip chunk after chunk into the short gaps between requests of a busy server.)
- a slot is decoding: the chunk competes with it for the device, so it runs only if the slowdown
  budget allows. Decoding slows only while a chunk runs during busy decoding ("overlap"); the budget
  is that overlap may be at most `max_slowdown_ppm / 1e6` of the decode-busy time:

      (overlap so far + expected chunk seconds) / decode-busy seconds so far <= max_slowdown_ppm / 1e6

  The expected chunk is the p50 of the job's recent chunks. Written as a credit (a token bucket), the
  rule is `credit >= expected`, where credit = bound x busy seconds - overlap seconds. Refinements:
  * the credit is capped at `bound x window_s` (10 s of decoding by default), so an hour of decoding
    with no training does not bank minutes of uninterrupted training for the next job;
  * a chunk of unknown length (a new job's first) or longer than the cap waits for a full bucket;
  * all overlap is charged, also that of a chunk started while idle that a new request ran into, so
    credit may go negative: that debt is paid back by decoding time before training overlaps again.
  Otherwise the trainer sleeps 5 ms and looks again (re-checking for cancellation each time).

Overlap is counted exactly: a chunk's overlap is the decode-busy time that passed while it ran, so a
chunk started while idle that a new request then runs into is charged too.

Measured slowdown (`stats()["slowdown_ppm"]`): the decode loop reports each step, one forward over the
batch of decoding sequences, with its batch size and wall time (`step(rows, seconds)`); a step that
overlapped a running chunk counts as "overlap", the rest as "clean", by batch size (a batch of four takes
longer per step than a batch of one, training or not). When some batch size has steps of both kinds, the
slowdown is how much longer all decoding took than it would have at the clean time per step of each batch
size (`slowdown_source: "measured"`; batch sizes with no clean steps are left out). Until then it is the
overlap fraction, overlap / busy time, which bounds the slowdown when a chunk at most stalls decoding for
its own length (`slowdown_source: "overlap_fraction"`).

Each chunk's wall time is also the window a new request may wait behind it; p50/p95 are reported.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from remat.base.settings import DEFAULT_SLOWDOWN_PPM, Cancelled, percentile

POLL_SECONDS = 0.005  # how often a waiting trainer looks again
RECENT_CHUNKS = 50  # chunks whose p50 is the expected length of the next one
KEPT_WINDOWS = 100_000  # chunk times kept for p50/p95


@dataclass
class ServingView:
    """What the scheduler reads before each training chunk."""

    busy_slots: int
    idle_ms: float  # ms since the last decode activity ended (0 while busy)
    tokens_generated: int


@dataclass
class Totals:
    """Running totals; `Scheduler.mark()` snapshots them so a job can report its own share."""

    chunks: int = 0
    waited: float = 0.0  # seconds the trainer slept in before_chunk
    busy: float = 0.0  # seconds with at least one slot decoding
    overlap: float = 0.0  # seconds a chunk ran while a slot was decoding
    # decode steps by batch size: [steps, seconds] that ran clear of training, and that overlapped a chunk
    clean: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    overlapped: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def copy(self) -> Totals:
        return dataclasses.replace(self, clean={k: list(v) for k, v in self.clean.items()},
                                   overlapped={k: list(v) for k, v in self.overlapped.items()})

    def minus(self, base: Totals) -> Totals:
        def steps(a: dict, b: dict) -> dict:
            return {k: [v[0] - b.get(k, [0, 0])[0], v[1] - b.get(k, [0, 0])[1]] for k, v in a.items()}
        return Totals(self.chunks - base.chunks, self.waited - base.waited, self.busy - base.busy,
                      self.overlap - base.overlap, steps(self.clean, base.clean),
                      steps(self.overlapped, base.overlapped))

    def slowdown(self) -> float | None:
        """How much longer decoding took than it would have at the clean time per step of each batch size
        (batch sizes never seen clean are left out); None until some batch size has steps of both kinds."""
        took = would_take = 0.0
        both = False
        for rows, (clean_n, clean_s) in self.clean.items():
            if clean_n <= 0 or clean_s <= 0:
                continue
            n, seconds = self.overlapped.get(rows, (0, 0.0))
            both = both or n > 0
            took += clean_s + seconds
            would_take += (clean_n + n) * clean_s / clean_n
        return max(0.0, took / would_take - 1) if both else None


class Scheduler:
    def __init__(self, max_slowdown_ppm: int = DEFAULT_SLOWDOWN_PPM, *, window_s: float = 10.0):
        if isinstance(max_slowdown_ppm, bool) or not isinstance(max_slowdown_ppm, int) or max_slowdown_ppm < 0:
            raise ValueError(f"max_slowdown_ppm must be a non-negative integer, got {max_slowdown_ppm!r}")
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.max_slowdown_ppm = max_slowdown_ppm
        self._bound = max_slowdown_ppm / 1e6
        self._cap = self._bound * window_s  # most credit that can be banked, in seconds of overlap
        self._lock = threading.Lock()
        self._t = Totals()
        self._slots = 0
        self._busy_since = 0.0  # when the current busy period began (valid while slots > 0)
        self._last_end = time.monotonic()
        self._tokens = 0
        self._credit = 0.0
        self._credit_busy = 0.0  # busy total when the credit was last brought up to date
        self._chunk_start: float | None = None  # a chunk is running since then
        self._chunk_busy = 0.0  # busy total when it started
        self._last_chunk_end = float("-inf")
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_CHUNKS)
        self._windows: collections.deque[float] = collections.deque(maxlen=KEPT_WINDOWS)

    # ---------------------------------------------------------------- the serving engine (any thread)

    def decode_begin(self) -> None:
        with self._lock:
            if self._slots == 0:
                self._busy_since = time.monotonic()
            self._slots += 1

    def decode_end(self) -> None:
        with self._lock:
            if self._slots == 0:  # an unmatched end: ignore rather than break the accounting
                return
            self._slots -= 1
            if self._slots == 0:
                now = time.monotonic()
                self._t.busy += now - self._busy_since
                self._last_end = now

    def step(self, rows: int, seconds: float) -> None:
        """A decode step of a batch of `rows` sequences (one token each) took `seconds`, ending now."""
        with self._lock:
            now = time.monotonic()
            self._tokens += rows
            overlapped = self._chunk_start is not None or self._last_chunk_end > now - seconds
            kind = self._t.overlapped if overlapped else self._t.clean
            total = kind.setdefault(rows, [0, 0.0])
            total[0] += 1
            total[1] += seconds

    def view(self) -> ServingView:
        with self._lock:
            idle = 0.0 if self._slots else (time.monotonic() - self._last_end) * 1000
            return ServingView(busy_slots=self._slots, idle_ms=idle, tokens_generated=self._tokens)

    # ---------------------------------------------------------------- the training job thread

    def new_job(self) -> None:
        """Forget the expected chunk length: a new job's chunks may be of any length."""
        with self._lock:
            self._recent.clear()

    def before_chunk(self, cancelled: Callable[[], bool]) -> None:
        """Return when the next chunk may run; raise Cancelled as soon as `cancelled()` says so."""
        start = time.monotonic()
        while True:
            if cancelled():
                raise Cancelled()
            with self._lock:
                now = time.monotonic()
                credit, need = self._credit_at(now), self._need()
                idle = 0.0 if self._slots else now - self._last_end
                if (self._slots == 0 and (credit >= 0 or idle >= need)) or (self._bound > 0 and credit >= need):
                    self._t.waited += now - start
                    self._chunk_start, self._chunk_busy = now, self._busy_at(now)
                    return
            time.sleep(POLL_SECONDS)

    def chunk_done(self, seconds: float) -> None:
        """The chunk admitted by the last `before_chunk` ended; it took `seconds` of wall time."""
        with self._lock:
            now = time.monotonic()
            if self._chunk_start is not None:
                overlap = self._busy_at(now) - self._chunk_busy
                self._credit = self._credit_at(now) - overlap
                self._t.overlap += overlap
            self._chunk_start, self._last_chunk_end = None, now
            self._t.chunks += 1
            self._recent.append(seconds)
            self._windows.append(seconds)

    # ---------------------------------------------------------------- reports

    def mark(self) -> Totals:
        """A snapshot of the totals; `stats(since=mark)` then covers only what happened after it."""
        with self._lock:
            return self._snapshot(time.monotonic())

    def stats(self, since: Totals | None = None) -> dict:
        with self._lock:
            now = self._snapshot(time.monotonic())
            windows = list(self._windows)
            slots = self._slots
        d = now.minus(since or Totals())
        windows = windows[len(windows) - min(d.chunks, len(windows)):]
        measured = d.slowdown()
        if measured is not None:
            slowdown, source = measured, "measured"
        else:
            slowdown, source = (d.overlap / d.busy if d.busy > 0 else 0.0), "overlap_fraction"
        return {
            "chunks": d.chunks,
            "window_p50": percentile(windows, 0.5) if windows else None,
            "window_p95": percentile(windows, 0.95) if windows else None,
            "waited_seconds": d.waited,
            "busy_seconds": d.busy,
            "overlap_seconds": d.overlap,
            "slowdown_ppm": round(slowdown * 1e6),
            "slowdown_source": source,
            "max_slowdown_ppm": self.max_slowdown_ppm,
            "busy_slots": slots,
        }

    # ---------------------------------------------------------------- internals (hold the lock)

    def _snapshot(self, now: float) -> Totals:
        snap = self._t.copy()
        snap.busy = self._busy_at(now)
        return snap

    def _busy_at(self, now: float) -> float:
        return self._t.busy + (now - self._busy_since if self._slots else 0.0)

    def _credit_at(self, now: float) -> float:
        busy = self._busy_at(now)
        self._credit = min(self._cap, self._credit + self._bound * (busy - self._credit_busy))
        self._credit_busy = busy
        return self._credit

    def _need(self) -> float:
        # a chunk of unknown length, or one longer than the cap, waits for a full bucket
        return min(percentile(list(self._recent), 0.5), self._cap) if self._recent else self._cap
