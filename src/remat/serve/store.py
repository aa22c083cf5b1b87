"""The job store: training jobs, their events (the SSE stream, replayable by id) and the finished adapters, in
one SQLite file (`state.db` under the server's `--state-dir`).

One lock (`lock`, re-entrant) guards the connection; `changed` wakes whoever waits for a new event. Every
method takes the lock itself; a caller that needs several calls to be one step holds it around them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from remat.serve.errors import ApiError

FINISHED = ("succeeded", "failed", "cancelled")
INTERRUPTED = "interrupted"
JOB_ID = re.compile(r"job-[0-9a-f]{16}")
MAX_EVENT_ID = 2**63 - 1  # SQLite's largest integer

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT,
    status TEXT NOT NULL,
    reason TEXT,
    settings TEXT NOT NULL,
    data TEXT NOT NULL,
    plan TEXT NOT NULL,
    progress TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    created REAL NOT NULL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS adapters (
    id INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    scale REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    data TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (job_id, seq)
);
"""


def dumps(value: object) -> str:
    """JSON with NaN and infinities (a diverging loss) as null, so every client can parse it."""
    def safe(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: safe(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [safe(v) for v in x]
        return x
    return json.dumps(safe(value))


def dumps_list(values: list) -> str:
    """`dumps` of a list, one item at a time: the training data can be tens of MiB, and one `json.dumps`
    call over all of it would hold the GIL (and stall the server's event loop) until it is done."""
    return "[" + ",".join(dumps(v) for v in values) + "]"


class JobStore:
    def __init__(self, path: Path, max_scale: float):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # a new event, a queued job, closing
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")  # a step event per step: no fsync per commit
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        # scales outside the bounds (stored by an older server) overflow every sampled completion
        self.db.execute("UPDATE adapters SET scale = 0 WHERE NOT (abs(scale) <= ?)", (max_scale,))

    # ------------------------------------------------------------------------------------------ jobs

    def row(self, job_id: str) -> sqlite3.Row:
        """The job's row; 404 for an id that names no job."""
        row = None
        if isinstance(job_id, str) and JOB_ID.fullmatch(job_id):
            with self.lock:
                row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise ApiError(404, code="not_found", message=f"no training job {job_id!r}", type="not_found_error")
        return row

    def ids(self) -> list[str]:
        with self.lock:
            return [r["id"] for r in self.db.execute("SELECT id FROM jobs ORDER BY seq")]

    def insert(self, job_id: str, name: str | None, settings: dict, records: list, gate: dict,
               progress: dict) -> None:
        with self.lock:
            self.db.execute(
                "INSERT INTO jobs (id, name, status, settings, data, plan, progress, created) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?)",
                (job_id, name, dumps(settings), dumps_list(records), dumps(gate), dumps(progress), time.time()))

    def update(self, job_id: str, **columns: object) -> None:
        """Set columns of the job's row (dicts stored as JSON)."""
        values = [dumps(v) if isinstance(v, dict) else v for v in columns.values()]
        with self.lock:
            self.db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in columns)} WHERE id = ?",
                            (*values, job_id))

    def finish(self, job_id: str, status: str, reason: str | None, result: dict | None = None) -> None:
        """The job ended: its status, why, its result; and the event that says so."""
        with self.lock:
            self.db.execute("UPDATE jobs SET status = ?, reason = ?, finished = ?, result = COALESCE(?, result) "
                            "WHERE id = ?", (status, reason, time.time(), dumps(result) if result else None,
                                             job_id))
            data: dict[str, object] = {"reason": reason} if reason else {}
            if result:
                data |= {"steps": result.get("steps"), "losses": result.get("losses"), "output": result.get("output")}
            self.event(job_id, status, data)

    def delete(self, job_id: str) -> None:
        """The job's row and events (its adapter's row stays: the adapter outlives its job)."""
        with self.lock, self.transaction():
            self.db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
            self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def recover(self) -> list[str]:
        """Jobs a previous server left queued or running did not finish: mark them interrupted."""
        with self.lock:
            ids = [r["id"] for r in self.db.execute("SELECT id FROM jobs WHERE status IN ('queued', 'running') "
                                                    "ORDER BY seq").fetchall()]
            for job_id in ids:
                self.finish(job_id, "failed", INTERRUPTED)
        return ids

    # ------------------------------------------------------------------------------------------ events

    def event(self, job_id: str, event: str, data: dict) -> None:
        with self.lock:
            seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE job_id = ?",
                                  (job_id,)).fetchone()[0]
            self.db.execute("INSERT INTO events (job_id, seq, event, data, created) VALUES (?, ?, ?, ?, ?)",
                            (job_id, seq, event, dumps(data), time.time()))
            self.changed.notify_all()

    def events_since(self, job_id: str, after: int = 0) -> list[dict]:
        """The job's events with id > `after`, oldest first: {"id", "event", "data", "created"}."""
        after = max(-1, min(int(after), MAX_EVENT_ID))
        with self.lock:
            self.row(job_id)
            rows = self.db.execute("SELECT seq, event, data, created FROM events WHERE job_id = ? AND seq > ? "
                                   "ORDER BY seq", (job_id, after)).fetchall()
        return [{"id": r["seq"], "event": r["event"], "data": json.loads(r["data"]), "created": r["created"]}
                for r in rows]

    def wait_events(self, job_id: str, after: int = 0, timeout: float = 15.0) -> list[dict]:
        """Like events_since, but waits up to `timeout` seconds for one; returns [] at once when the job
        has finished and nothing newer is left (the stream can end)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                events = self.events_since(job_id, after)
                if events or self.row(job_id)["status"] in FINISHED:
                    return events
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self.changed.wait(left)

    # ------------------------------------------------------------------------------------------ adapters

    def adapter_of(self, job_id: str) -> dict | None:
        with self.lock:
            row = self.db.execute("SELECT id, name, path, scale FROM adapters WHERE job_id = ?", (job_id,)).fetchone()
        return dict(row) if row else None

    def add_adapter(self, job_id: str, name: str, path: str) -> None:
        with self.lock:
            next_id = self.db.execute("SELECT COALESCE(MAX(id), -1) + 1 FROM adapters").fetchone()[0]
            self.db.execute("INSERT INTO adapters (id, job_id, name, path, scale) VALUES (?, ?, ?, ?, 0)",
                            (next_id, job_id, name, path))

    def adapters(self) -> list[dict]:
        """Finished LoRA adapters in llama.cpp's /lora-adapters shape, plus name and job."""
        with self.lock:
            rows = self.db.execute("SELECT id, name, path, scale, job_id FROM adapters ORDER BY id").fetchall()
        return [dict(r) for r in rows]

    def set_scales(self, scales: dict[int, float]) -> None:
        """Each adapter's scale: those in `scales`, 0 for the others (as llama.cpp does); 400 for an unknown id."""
        with self.lock:
            known = {r["id"] for r in self.db.execute("SELECT id FROM adapters")}
            for adapter_id in scales:
                if adapter_id not in known:
                    raise ApiError(400, f"no adapter with id {adapter_id}", code="invalid_adapter_id",
                                   extra={"param": "id"})
            new = dict.fromkeys(known, 0.0) | scales
            with self.transaction():
                self.db.executemany("UPDATE adapters SET scale = ? WHERE id = ?", [(v, k) for k, v in new.items()])

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction (the connection is in autocommit mode otherwise)."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self.db.close()
