"""Real clients against a real server (tiny-llama, `--parallel 2`, `--ctx 128`, an API key): the official
`openai` package drives chat, completions, streaming and log-probabilities, and the server's errors reach it as
its own exception types; a request body recorded from llama.cpp's web UI (its defaults:
tests/fixtures/llamacpp_webui_chat.json) is accepted and answered, with the requests it makes beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_process import Server

openai = pytest.importorskip("openai", reason="the test extra's openai is not installed")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

KEY = "sk-remat-test"
WEBUI = json.loads((Path(__file__).parent / "fixtures" / "llamacpp_webui_chat.json").read_text())
HI = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("clients") / "state", "--parallel", "2", "--ctx", "128", "--api-key", KEY,
               key=KEY).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}v1", api_key=KEY, max_retries=0, timeout=60)


def test_chat_and_completions(server, client):
    r = client.chat.completions.create(model="any-name", messages=HI, max_tokens=5, temperature=0, seed=3)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert isinstance(choice.message.content, str) and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    raw = server.ok("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "temperature": 0})
    assert choice.message.content == raw["choices"][0]["message"]["content"]
    two = client.chat.completions.create(model="m", messages=HI, max_tokens=3, n=2, seed=9, temperature=1.5)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 6
    c = client.completions.create(model="m", prompt="hello", max_tokens=4, temperature=0)
    assert c.object == "text_completion" and c.usage.completion_tokens == 4
    assert c.choices[0].text == server.ok("POST", "/completion", {"prompt": "hello", "n_predict": 4,
                                                                  "temperature": 0})["content"]
    assert [m.id for m in client.models.list()] == ["tiny-llama"]


def test_streaming(client):
    whole = client.chat.completions.create(model="m", messages=HI, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=HI, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    plain = client.completions.create(model="m", prompt="abc", max_tokens=5, temperature=0)
    streamed = list(client.completions.create(model="m", prompt="abc", max_tokens=5, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == plain.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(model="m", messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == item.top_logprobs[0].bytes and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.logprob < 0
    c = client.completions.create(model="m", prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                         lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_errors_reach_the_client_as_its_own_exceptions(server, client):
    with pytest.raises(openai.BadRequestError, match=r"mirostat.*not supported") as e:
        client.chat.completions.create(model="m", messages=HI, extra_body={"mirostat": 2})
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="unknown field 'frobnicate'"):
        client.chat.completions.create(model="m", messages=HI, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    with pytest.raises(openai.BadRequestError, match="context size"):
        client.completions.create(model="m", prompt="x" * 400, max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=HI)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="m", input="x")


def test_llamacpp_webui_request_is_answered(server):
    events = list(server.sse("POST", WEBUI["path"], WEBUI["body"], headers=WEBUI["headers"]))
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length") and final["timings"]["predicted_n"] > 0
    assert len(text) > 0 and all("error" not in c for c in chunks)
    # max_tokens -1: until the end of text or the context (128 tokens here) is full
    assert final["timings"]["prompt_n"] + final["timings"]["predicted_n"] <= 128
    pre = server.ok("POST", WEBUI["path"], WEBUI["pre_encode"]["body"])
    assert pre["usage"]["completion_tokens"] == 0 and pre["choices"][0]["message"]["content"] == ""
    title = list(server.sse("POST", WEBUI["path"], WEBUI["title"]["body"]))
    assert title[-1]["data"] == "[DONE]"
