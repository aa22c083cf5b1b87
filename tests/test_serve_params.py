"""The generation requests' fields over real HTTP (tiny-llama, `--parallel 4`), each implemented one against an
oracle that is not the server: the same model in this process, its logits adjusted by hand (penalties, logit
bias) or turned into log-probabilities by hand (log_softmax); batched answers against one-at-a-time full
forward passes. Fields remat does not implement: accepted at their neutral value, refused naming the field at
any other."""

from __future__ import annotations

import concurrent.futures
import json
import math

import pytest
import torch

from serve_process import MODEL, Server

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.usefixtures("one_thread")]
EOS = 258  # tiny-llama's <|im_end|>


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("params") / "state", "--parallel", "4").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lm():
    from remat.models.load import load_model

    loaded = load_model(MODEL)
    loaded.model.eval()
    return loaded


def logits_of(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(input_ids=torch.tensor([ids])).logits[0, -1].double()


def by_hand(lm, ids: list[int], n: int, adjust=lambda logits, ids: logits) -> list[int]:
    """Greedy tokens by full forward passes, each step's logits changed by `adjust(logits, tokens so far)`."""
    out: list[int] = []
    for _ in range(n):
        token = int(adjust(logits_of(lm, ids + out), ids + out).argmax())
        if token == EOS:
            break
        out.append(token)
    return out


def completion(server: Server, prompt, **body) -> dict:
    return server.ok("POST", "/completion", {"prompt": prompt, "temperature": 0, "return_tokens": True, **body})


def chat_ids(lm, messages: list[dict]) -> list[int]:
    text = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return lm.tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------
# implemented fields against oracles


def test_penalties_and_logit_bias_follow_the_rule_applied_by_hand(server, lm):
    prompt = "the cat sat on"
    ids = lm.tokenizer.encode(prompt)
    plain = by_hand(lm, ids, 12)
    banned, boosted = plain[0], plain[3]
    rep, last_n, freq, pres = 1.5, 6, 0.3, 0.4

    def rule(logits: torch.Tensor, seen: list[int]) -> torch.Tensor:
        x = logits.clone()
        x[boosted] += 2.5
        x[banned] = -math.inf
        window = seen[-last_n:]
        for t in set(window):
            x[t] = x[t] * rep if x[t] <= 0 else x[t] / rep
            x[t] -= window.count(t) * freq + pres
        return x

    want = by_hand(lm, ids, 12, rule)
    got = completion(server, prompt, n_predict=12, repeat_penalty=rep, repeat_last_n=last_n, frequency_penalty=freq,
                     presence_penalty=pres, logit_bias=[[boosted, 2.5], [banned, False]])["tokens"]
    assert got == want and got != plain and banned not in got
    # OpenAI's shape: {"token id": bias}, on chat
    messages = [{"role": "user", "content": "hi"}]
    first = by_hand(lm, chat_ids(lm, messages), 1)[0]

    def minus(logits: torch.Tensor, seen: list[int]) -> torch.Tensor:
        x = logits.clone()
        x[first] -= 100
        return x

    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "logit_bias": {str(first): -100},
            "logprobs": True}
    out = server.ok("POST", "/v1/chat/completions", body)
    tokens = [item["bytes"] for item in out["choices"][0]["logprobs"]["content"]]
    assert tokens == [[t] for t in by_hand(lm, chat_ids(lm, messages), 4, minus)]  # byte tokens: id = the byte


def test_log_probabilities_are_log_softmax_of_the_models_forward(server, lm):
    messages = [{"role": "user", "content": "hello there"}]
    ids = chat_ids(lm, messages)
    out = server.ok("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                     "logprobs": True, "top_logprobs": 3})
    content = out["choices"][0]["logprobs"]["content"]
    tokens = by_hand(lm, ids, 5)
    assert len(content) == len(tokens)
    for i, item in enumerate(content):
        logp = torch.log_softmax(logits_of(lm, ids + tokens[:i]), 0)
        top = logp.topk(3)
        assert item["bytes"] == [tokens[i]] and item["logprob"] == pytest.approx(float(logp[tokens[i]]), abs=1e-4)
        assert [x["bytes"] for x in item["top_logprobs"]] == [[t] for t in top.indices.tolist()]
        assert [x["logprob"] for x in item["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)
    # llama.cpp's shape (n_probs) and OpenAI's legacy completions shape carry the same numbers
    prompt_ids = lm.tokenizer.encode("abc")
    llama = completion(server, "abc", n_predict=3, n_probs=2)
    legacy = server.ok("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                                   "echo": True})
    lp = legacy["choices"][0]["logprobs"]
    assert legacy["choices"][0]["text"].startswith("abc") and lp["text_offset"][0] == 3
    for i, (mine, token) in enumerate(zip(llama["completion_probabilities"], llama["tokens"])):
        logp = torch.log_softmax(logits_of(lm, prompt_ids + llama["tokens"][:i]), 0)
        assert mine["id"] == token and mine["logprob"] == pytest.approx(float(logp[token]), abs=1e-4)
        assert [x["id"] for x in mine["top_logprobs"]] == logp.topk(2).indices.tolist()
        assert lp["token_logprobs"][i] == pytest.approx(mine["logprob"], abs=1e-6)
        assert list(lp["top_logprobs"][i].values()) == pytest.approx([x["logprob"] for x in mine["top_logprobs"]])


def test_concurrent_requests_decode_batched_and_equal_one_at_a_time(server, lm):
    prompts = ["a", "the cat sat on the mat", "x" * 30, "hello world, hello"]
    before = metrics(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: completion(server, p, n_predict=60, ignore_eos=True)["tokens"], prompts))
    for p, got in zip(prompts, outs):
        want = by_hand(lm, lm.tokenizer.encode(p), 60, lambda x, _: torch.where(torch.arange(x.numel()) == EOS,
                                                                                 -math.inf, x))
        assert got == want
    after = metrics(server)
    rows = after["remat_decode_rows_total"] - before["remat_decode_rows_total"]
    steps = after["remat_decode_steps_total"] - before["remat_decode_steps_total"]
    assert rows == 4 * 59 and rows / steps > 1.5  # one forward served several rows


def metrics(server: Server) -> dict[str, float]:
    text = server.ok("GET", "/metrics")
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] not in "#"}


def test_stops_ignore_eos_top_k_and_seeds(server, lm):
    plain = completion(server, "the cat", n_predict=8)["tokens"]
    k = next(i for i in range(1, 8) if plain[i] not in plain[:i])
    stopped = completion(server, "the cat", n_predict=8, stop=[plain[k], "never"])
    assert stopped["tokens"] == plain[:k] and stopped["stop_type"] == "word"
    eos_first = completion(server, "the cat", n_predict=5, logit_bias=[[EOS, 100]])
    assert eos_first["stop_type"] == "eos" and eos_first["tokens"] == []
    ignored = completion(server, "the cat", n_predict=5, logit_bias=[[EOS, 100]], ignore_eos=True)
    assert ignored["stop_type"] == "limit" and len(ignored["tokens"]) == 5 and EOS not in ignored["tokens"]
    hot = {"n_predict": 10, "temperature": 1.5, "top_k": 1, "top_p": 1.0, "min_p": 0}
    assert completion(server, "the cat", **hot)["tokens"] == completion(server, "the cat", n_predict=10)["tokens"]
    sampled = {"prompt": ["one", "two"], "max_tokens": 6, "temperature": 1.2, "top_k": 0, "n": 2, "seed": 5}
    a = server.ok("POST", "/v1/completions", sampled)
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3] and a["usage"]["prompt_tokens"] == 6
    assert a["choices"] == server.ok("POST", "/v1/completions", sampled)["choices"]
    assert len({c["text"] for c in a["choices"]}) > 1
    many = server.ok("POST", "/completion", {"prompt": "x", "n_cmpl": 2, "n_predict": 2, "seed": 1, "temperature": 2})
    assert [r["index"] for r in many] == [0, 1]
    picked = server.ok("POST", "/completion", {"prompt": "x", "n_predict": 2,
                                               "response_fields": ["content", "generation_settings/seed", "nope"]})
    assert set(picked) == {"content", "generation_settings/seed"}


def test_usage_and_timings_in_every_answer(server):
    chat = {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
            "max_tokens": 4, "temperature": 0}
    whole = server.ok("POST", "/v1/chat/completions", chat)
    assert whole["usage"]["completion_tokens"] == whole["timings"]["predicted_n"] == 4
    events = list(server.sse("POST", "/v1/chat/completions", {**chat, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert events[-1]["data"] == "[DONE]" and chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
    assert all(c["usage"] is None for c in chunks[:-1]) and "timings" in chunks[-2]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    # ignore_eos: sampled at the default temperature, an end of text can come first (1 token of 3, once)
    legacy = server.ok("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert legacy["usage"]["total_tokens"] == 5 and legacy["timings"]["prompt_n"] == 2
    streamed = list(server.sse("POST", "/completion", {"prompt": "hi", "n_predict": 3, "stream": True,
                                                      "ignore_eos": True}))
    assert json.loads(streamed[-1]["data"])["timings"]["predicted_n"] == 3


def test_a_final_assistant_message_is_continued(server, lm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = lm.tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    want = by_hand(lm, lm.tokenizer.encode(text, add_special_tokens=False), 5)
    out = server.ok("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                     "logprobs": True})
    assert [x["bytes"] for x in out["choices"][0]["logprobs"]["content"]] == [[t] for t in want]


# ---------------------------------------------------------------------------------------------------------
# neutral and unsupported fields


NEUTRAL = {  # fields that change nothing remat answers, at values other than their defaults
    "cache_prompt": False, "n_cache_reuse": 16, "n_keep": -1, "n_discard": 8, "id_slot": 2, "timings_per_token": True,
    "return_progress": True, "sse_ping_interval": 5, "verbose": True, "backend_sampling": True, "chat_format": 3,
    "generation_prompt": "x", "parse_tool_calls": True, "chat_parser": "p", "reasoning_control": True,
    "mirostat_tau": 3.0, "mirostat_eta": 0.2, "dry_base": 2.0, "dry_allowed_length": 3, "dry_penalty_last_n": 32,
    "dry_sequence_breakers": ["\n"], "adaptive_decay": 0.5, "grammar_lazy": True, "preserved_tokens": ["a"],
    "model": "gpt-4o", "mirostat": 0, "dry_multiplier": 0, "grammar": "", "reasoning_format": "auto",
}
OPENAI_NEUTRAL = {"user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "flex", "safety_identifier": "s",
                  "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"}}
CHAT_NEUTRAL = {"parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"}, "tools": [],
                "tool_choice": "auto", "response_format": {"type": "text"}, "modalities": ["text"],
                "reasoning_effort": "high", "verbosity": "medium", "chat_template_kwargs": {"enable_thinking": False},
                "stream_options": {"include_obfuscation": True}}


def test_neutral_fields_are_accepted_at_any_value(server):
    plain = completion(server, "abc", n_predict=4)
    assert completion(server, "abc", n_predict=4, **NEUTRAL)["tokens"] == plain["tokens"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    want = server.ok("POST", "/v1/chat/completions", chat)["choices"]
    assert server.ok("POST", "/v1/chat/completions", {**chat, **NEUTRAL, **OPENAI_NEUTRAL, **CHAT_NEUTRAL})[
        "choices"] == want
    legacy = {"prompt": "abc", "max_tokens": 3, "temperature": 0}
    assert server.ok("POST", "/v1/completions", {**legacy, **OPENAI_NEUTRAL, "best_of": 1, "suffix": ""})[
        "choices"] == server.ok("POST", "/v1/completions", legacy)["choices"]


UNSUPPORTED = [
    ("/completion", "mirostat", 2), ("/completion", "dry_multiplier", 0.8), ("/completion", "grammar", "root ::= x"),
    ("/completion", "json_schema", {}), ("/completion", "n_indent", 4), ("/completion", "adaptive_target", 0.5),
    ("/completion", "reasoning_budget_tokens", 100), ("/completion", "echo", True),
    ("/v1/completions", "best_of", 3), ("/v1/completions", "suffix", "end"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"), ("/v1/chat/completions", "response_format",
                                                          {"type": "json_object"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]), ("/v1/chat/completions", "reasoning_format",
                                                                "deepseek"),
    ("/v1/chat/completions", "thinking_budget_tokens", 10), ("/v1/chat/completions", "web_search_options", {}),
]


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[f"{p} {f}" for p, f, _ in UNSUPPORTED])
def test_unsupported_fields_are_refused_naming_them(server, case):
    path, field, value = case
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    status, out = server.request("POST", path, {**body, field: value, "max_tokens": 1})
    assert status == 400 and "not supported" in out["error"]["message"] and field in out["error"]["message"], out
    assert out["error"].get("param") == field and "\n" not in out["error"]["message"]


@pytest.mark.parametrize("body, part", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": "high"}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "samplers": ["temperature", "top_k"]}, "order"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "'n'"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}, "99999"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [7, 99999]}, "99999"),
    ({"messages": [{"role": "user", "content": "x"}], "mirostatt": 1}, "unknown field 'mirostatt'"),
])
def test_bad_generation_fields_are_400(server, body, part):
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and part in out["error"]["message"], out
