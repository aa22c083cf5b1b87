"""The decode loop: one thread runs every generation's forward passes, the running sequences batched.

Each turn of the loop:
1. drops the choices whose client left;
2. admits the next waiting choice, in arrival order, when a slot is free (`parallel` sequences at most,
   prefilling or decoding) and it uses the adapters at the scales the running ones use (they live on the
   model's layers); other adapter settings wait until nothing runs, and are applied then;
3. runs one chunk of the admitted prompt (`PREFILL_CHUNK` tokens while others decode, so a long prompt
   delays their next token by one chunk, not by the whole prompt); after its last chunk the prompt's first
   token is sampled and its sequence joins the batch (with the choices of the same prompt waiting behind
   it: `n` choices share one prefill);
4. runs one forward over every decoding sequence, one token each, samples each row with its own settings
   (`remat.serve.sampling`), hands each choice its token, and drops the rows that ended.

The scheduler hears of every step: its batch size and its time (the training slowdown compares a batch's
time per token with training against without, at the same batch size).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Protocol

import torch

from remat.serve.batch import BatchCache, cache_bytes, prefill_cache
from remat.serve.decoding import Choice, Generation
from remat.serve.errors import ApiError
from remat.serve.sampling import pick

__all__ = ["Decoder", "Host"]

log = logging.getLogger("remat.serve")

PREFILL_CHUNK = 64  # prompt tokens per forward while other sequences decode (~3 decode steps of SmolLM2)
PREFILL_ALONE = 512  # prompt tokens per forward while nothing else decodes


class Host(Protocol):
    """What the loop needs of the served model (`remat.serve.engine.Engine`)."""

    parallel: int
    n_ctx: int
    model: Any

    def forward(self, input_ids: torch.Tensor, cache, **kw) -> Any: ...
    def apply_lora(self, key: Any) -> None: ...
    def stepped(self, rows: int, seconds: float) -> None: ...
    def record(self, c: Choice) -> None: ...
    def decode_begin(self) -> None: ...
    def decode_end(self) -> None: ...


class _Batch:
    """Sequences decoding together: their rows of one cache, and the token each feeds next."""

    def __init__(self, limit: int):
        self.cache = BatchCache(limit)
        self.rows: list[Choice] = []
        self.next: list[int] = []


class _Prefill:
    def __init__(self, choice: Choice, cache):
        self.choice, self.cache, self.done = choice, cache, 0


class Decoder:
    """The decode loop's thread and its queue. `submit` from any thread; the rest runs in the loop."""

    def __init__(self, engine: Host):
        self.e = engine
        self.cond = threading.Condition()
        self.queue: collections.deque[Choice] = collections.deque()
        self.batches: list[_Batch] = []
        self.prefill: _Prefill | None = None
        self.key: object = ()  # the adapters the model computes with now: none
        self._thread: threading.Thread | None = None
        self._closing = False

    # -- any thread -------------------------------------------------------------------------------------

    def submit(self, g: Generation) -> None:
        with self.cond:
            self.queue.extend(g.choices)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="remat-decode", daemon=True)
                self._thread.start()
            self.cond.notify()

    def close(self) -> None:
        """Stop the loop (what runs is dropped) and wait for its thread."""
        with self.cond:
            self._closing = True
            self.cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(30)

    @property
    def busy(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return sum(len(b.rows) for b in list(self.batches)) + (self.prefill is not None)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def kv_bytes(self) -> int:
        pf = self.prefill
        return sum(b.cache.nbytes() for b in list(self.batches)) + (cache_bytes(pf.cache) if pf else 0)

    # -- the loop ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not (self.queue or self.prefill or self.batches or self._closing):
                        self.cond.wait()
                    if self._closing:
                        return
                    for c in [c for c in self.queue if c.gen.cancel.is_set()]:
                        self.queue.remove(c)
                        c.drop()
                    start = self._admit()
                try:
                    self._turn(start)
                except Exception as e:  # noqa: BLE001 - a failed forward ends what it ran, not the loop
                    log.error("decoding failed: %s: %s", type(e).__name__, e)
                    self._fail_all(e)

    def _admit(self) -> Choice | None:
        """The next choice to prefill, when it may start now (holds the lock)."""
        if self.prefill is not None or not self.queue or self.busy >= self.e.parallel:
            return None
        head = self.queue[0]
        if self.busy and head.gen.key != self.key:
            return None
        return self.queue.popleft()

    def _turn(self, start: Choice | None) -> None:
        self._drop_cancelled()
        if start is not None:
            self._begin(start)
        if self.prefill is not None:
            self._prefill_chunk()
        for batch in list(self.batches):
            self._step(batch)

    def _begin(self, c: Choice) -> None:
        if c.gen.key != self.key:
            try:
                self.e.apply_lora(c.gen.key)
            except Exception as e:  # noqa: BLE001 - an adapter that does not load fails its request only
                self.key = None  # half applied: the next request applies its own in full
                self._fail(c.gen, e)
                return
            self.key = c.gen.key
        self._started(c)
        if c.budget <= 0:  # n_predict 0: nothing to generate (nothing is kept of a prompt between requests)
            self._finish(c, "limit")
            return
        self.prefill = _Prefill(c, prefill_cache(self.e.model))

    def _prefill_chunk(self) -> None:
        pf = self.prefill
        assert pf is not None
        prompt = pf.choice.prompt_ids
        size = PREFILL_CHUNK if self.batches else PREFILL_ALONE
        ids = prompt[pf.done:pf.done + size]
        out = self.e.forward(torch.tensor([ids]), pf.cache)
        pf.done += len(ids)
        if pf.done < len(prompt):
            return
        self.prefill = None
        group = [pf.choice] + self._siblings(pf.choice)
        logits = out.logits[:, -1].expand(len(group), -1)
        picked = pick(logits, [c.row for c in group])
        joining = [(c, t) for c, t, p in zip(group, picked.tokens, picked.probs) if not self._accept(c, t, p)]
        if not joining:
            return
        batch = next((b for b in self.batches if b.cache.accepts(pf.cache)), None)
        if batch is None:
            batch = _Batch(self.e.n_ctx)
            self.batches.append(batch)
        batch.cache.join(pf.cache, len(prompt), len(joining))
        batch.rows += [c for c, _ in joining]
        batch.next += [t for _, t in joining]

    def _siblings(self, c: Choice) -> list[Choice]:
        """The choices waiting right behind `c` with its prompt, for which slots are free: they share its prefill."""
        out: list[Choice] = []
        with self.cond:
            while (self.queue and self.queue[0].gen is c.gen and self.queue[0].prompt_ids == c.prompt_ids
                   and self.busy + len(out) + 1 < self.e.parallel):
                out.append(self.queue.popleft())
        for s in out:
            self._started(s)
            s.t_start = c.t_start
        return out

    def _step(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        out = self.e.forward(**batch.cache.inputs(batch.next), cache=batch.cache.cache)
        batch.cache.advance()
        picked = pick(out.logits[:, -1], [c.row for c in batch.rows])
        self.e.stepped(len(batch.rows), time.perf_counter() - t0)
        keep = [i for i, (c, t, p) in enumerate(zip(batch.rows, picked.tokens, picked.probs))
                if not self._accept(c, t, p)]
        batch.next = [picked.tokens[i] for i in keep]
        self._keep(batch, keep)

    def _keep(self, batch: _Batch, keep: list[int]) -> None:
        """Keep these rows of the batch (its `next` tokens are already theirs)."""
        if len(keep) == len(batch.rows):
            return
        batch.cache.keep(keep)
        batch.rows = [batch.rows[i] for i in keep]
        if not batch.rows:
            self.batches.remove(batch)

    # -- choices coming and going -----------------------------------------------------------------------

    def _started(self, c: Choice) -> None:
        c.started()
        self.e.decode_begin()

    def _accept(self, c: Choice, token: int, probs) -> bool:
        if c.accept(token, probs):
            self._ended(c)
            return True
        return False

    def _finish(self, c: Choice, stop_type: str) -> None:
        c.finish(stop_type)
        self._ended(c)

    def _ended(self, c: Choice) -> None:
        self.e.decode_end()
        self.e.record(c)

    def _drop_cancelled(self) -> None:
        pf = self.prefill
        if pf is not None and pf.choice.gen.cancel.is_set():
            self.prefill = None
            pf.choice.drop()
            self._ended(pf.choice)
        for batch in list(self.batches):
            gone = [c for c in batch.rows if c.gen.cancel.is_set()]
            for c in gone:
                c.drop()
                self._ended(c)
            if gone:
                keep = [i for i, c in enumerate(batch.rows) if not c.gen.cancel.is_set()]
                batch.next = [batch.next[i] for i in keep]
                self._keep(batch, keep)

    def _fail(self, g: Generation, e: BaseException) -> None:
        with self.cond:
            for c in [c for c in self.queue if c.gen is g]:
                self.queue.remove(c)
        g.fail(e if isinstance(e, ApiError) else RuntimeError(f"decoding failed: {type(e).__name__}: {e}"))

    def _fail_all(self, e: BaseException) -> None:
        """A forward failed: end everything that was running (the caches may be half updated)."""
        running = [c for b in self.batches for c in b.rows] + ([self.prefill.choice] if self.prefill else [])
        self.batches, self.prefill = [], None
        for _ in running:
            self.e.decode_end()
        for g in {id(c.gen): c.gen for c in running}.values():
            self._fail(g, e)
