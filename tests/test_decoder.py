"""The decode loop (`remat.serve.decoder`) in this process, on the tiny random presets: batched decoding against
one-at-a-time full forward passes, sequences joining and leaving between tokens, prompts prefilled in chunks
while others decode, `n` choices sharing a prefill, cancelling, the KV-cache bytes the training gate reads, and
the steps the scheduler hears of. (The HTTP side is `test_serve_params`; these look at the loop's order of
events, which a client cannot see.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from remat.serve.decoder import PREFILL_CHUNK
from remat.serve.decoding import Event, Params
from remat.serve.engine import Engine
from remat.serve.sampling import Sampling
from remat.serve.scheduler import Scheduler

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.usefixtures("one_thread")]

GREEDY = Sampling(temperature=0, logprobs=2)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen35"])
def engine(request):
    e = Engine(request.param, parallel=4, scheduler=Scheduler())
    e.load()
    yield e
    e.close()


def reference(e: Engine, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forward passes over the whole text so far (no cache), and each token's
    log-probability: log_softmax of the model's own logits."""
    out, logps = [], []
    with torch.inference_mode():
        for _ in range(n):
            logits = e.model(input_ids=torch.tensor([ids + out])).logits[0, -1].double()
            token = int(logits.argmax())
            if token in e.eos_ids:
                break
            out.append(token)
            logps.append(float(torch.log_softmax(logits, 0)[token]))
    return out, logps


def endless(e: Engine) -> Sampling:
    """Greedy with the end of text banned (ignore_eos's bias): the sequence runs to its n_predict."""
    return Sampling(temperature=0, logit_bias=tuple((t, float("-inf")) for t in sorted(e.eos_ids)))


def started(e: Engine, ids: list[int], params: Params, **kw):
    """A generation running in its own thread: (generation, thread)."""
    g = e.generate([ids], params, **kw)
    t = threading.Thread(target=g.run)
    t.start()
    return g, t


def wait_for(cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_batched_greedy_equals_one_at_a_time(engine):
    """Four sequences join a running batch one by one (prompts of 1 to 300 tokens) and leave at their own
    lengths: each one's tokens are the one-at-a-time greedy tokens, exactly. Its log-probabilities are compared
    within 1e-5: a batch's matrix products may round differently from one row's (the tokens may not)."""
    e = engine
    prompts = [[5], list(range(40, 47)), [7, 9] * 20, list(range(1, 256)) + list(range(45))]
    lengths = [12, 40, 25, 33]
    before = dict(e.stats)
    running = []
    for ids, n in zip(prompts, lengths):
        g, t = started(e, ids, Params(sampling=GREEDY, n_predict=n))
        running.append((g, t))
        wait_for(lambda g=g: g.choices[0].tokens or g.choices[0].done)  # the next joins a decoding batch
    for (g, t), ids, n in zip(running, prompts, lengths):
        t.join(60)
        c = g.choices[0]
        want, logps = reference(e, ids, n)
        assert c.tokens == want, (len(ids), c.tokens, want)
        assert [p.value for p in c.probs] == pytest.approx(logps, abs=1e-5)
    steps = e.stats["decode_steps"] - before["decode_steps"]
    rows = e.stats["decode_rows"] - before["decode_rows"]
    assert rows / steps > 2, (rows, steps)  # decoded together: one forward per step for the running rows


def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_tokens(engine):
    """While a 1,000-token prompt is prefilled, a decoding sequence gets a token per chunk; and the chunked
    prefill gives the same tokens as one whole forward pass."""
    e = engine
    a, ta = started(e, [1, 2, 3], Params(sampling=endless(e), n_predict=400))
    wait_for(lambda: len(a.choices[0].tokens) >= 5)
    long = [(7 * i) % 250 for i in range(1000)]
    b = e.generate([long], Params(sampling=GREEDY, n_predict=5))
    seen: dict[str, int] = {}

    def sink(ev: Event) -> None:  # the decode loop's thread: A's count as B's first token comes
        if ev.kind == "piece" or ev.kind == "done":
            seen.setdefault("b_first", len(a.choices[0].tokens))
        b._queue.put(ev)

    seen["b_submitted"] = len(a.choices[0].tokens)
    b.sink = sink
    tb = threading.Thread(target=b.run)
    tb.start()
    tb.join(120)
    a.cancel.set()
    ta.join(60)
    chunks = -(-len(long) // PREFILL_CHUNK)
    assert seen["b_first"] - seen["b_submitted"] >= chunks - 2, (seen, chunks)
    assert b.choices[0].tokens == reference(e, long, 5)[0]


def test_n_choices_share_a_prefill_and_their_seeds(engine):
    """`n` choices of one prompt: choice i draws from seed + i, as a request of one choice with that seed."""
    e = engine
    hot = Sampling(temperature=1.5, top_k=0, top_p=1.0, min_p=0)
    g = e.generate([[3, 4, 5]], Params(sampling=hot, n_predict=12, seed=41), n=3)
    g.run()
    outs = [c.tokens for c in g.choices]
    assert len({tuple(o) for o in outs}) == 3
    for i in range(3):
        one = e.generate([[3, 4, 5]], Params(sampling=hot, n_predict=12, seed=41 + i))
        one.run()
        assert one.choices[0].tokens == outs[i]
    assert g.usage() == {"prompt_tokens": 3, "completion_tokens": 36, "total_tokens": 39}


def test_cancel_frees_the_slot_and_kv_bytes_are_counted(engine):
    """Four slots taken: a fifth request waits; cancelling one admits it. The caches' bytes grow with the
    rows and go back to nothing; the most they can hold is every slot at the full context, per the config."""
    e = engine
    cfg = e.model.config
    layers = cfg.layer_types.count("full_attention") if getattr(cfg, "layer_types", None) else cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * layers * cfg.num_key_value_heads * head_dim * 4  # keys and values, float32
    assert e.kv_cache_reserve() == 4 * (e._kv_fixed + e.n_ctx * per_token) and e._kv_token == per_token
    assert e.kv_cache_bytes() == 0
    gens = [started(e, [i + 1], Params(sampling=endless(e), n_predict=1500)) for i in range(4)]
    wait_for(lambda: all(len(g.choices[0].tokens) >= 3 for g, _ in gens))
    held = e.kv_cache_bytes()
    assert 4 * 4 * per_token <= held <= e.kv_cache_reserve()
    fifth, t5 = started(e, [9], Params(sampling=GREEDY, n_predict=3))
    time.sleep(0.2)
    assert not fifth.choices[0].tokens and e.decoder.waiting == 1
    gens[0][0].cancel.set()
    t5.join(60)
    assert len(fifth.choices[0].tokens) == 3
    for g, t in gens:
        g.cancel.set()
        t.join(60)
    wait_for(lambda: e.decoder.busy == 0)
    assert e.kv_cache_bytes() == 0


def test_the_scheduler_hears_each_step_with_its_batch_size(engine):
    e = engine
    mark = e.scheduler.mark()
    gens = [started(e, [i + 2], Params(sampling=endless(e), n_predict=20)) for i in range(3)]
    for _, t in gens:
        t.join(60)
    steps = e.scheduler.mark().minus(mark).clean
    # every token but each sequence's first (its prompt's forward gives that one) came from a step
    assert sum(n * rows for rows, (n, _) in steps.items()) == 3 * 19
    assert max(steps) >= 2  # some steps ran a batch
    assert e.scheduler.view().busy_slots == 0
