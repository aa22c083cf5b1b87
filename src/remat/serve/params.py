"""The generation requests' fields: every field of OpenAI's completions and chat completions requests and of
llama.cpp's completion schema (which llama.cpp's server takes on all three routes, and so does remat).

A field is one of three kinds:
- implemented (sampling, penalties, logit bias, log-probabilities, `n` choices, stops, seeds, ...);
- neutral: it changes nothing remat answers (`user`, `metadata`, `store`, `service_tier`, `cache_prompt`,
  `timings_per_token`, prompt-cache hints, slot ids): accepted at any value of its type;
- unsupported (`unsupported`): accepted at the value that leaves the answer as it is (`mirostat: 0`, no
  grammar, no tools), refused at any other with a one-line 400 that names it ("not supported"). Settings that
  only matter when an unsupported one is on (`mirostat_tau`, `dry_base`) are accepted at any value.

A field sent as null is not sent (llama.cpp's rule: clients send null for "the server's default"). Fields in
neither schema are refused as unknown. The routes turn a request into decoding settings
(`remat.serve.generation.decoding`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, create_model, model_validator
from pydantic_core import PydanticCustomError, core_schema

from remat.serve.sampling import sampler_names
from remat.serve.schemas import (
    CHARS_PER_TOKEN,
    MAX_TEMPERATURE,
    MAX_TEXT,
    Body,
    DetokenizeRequest,
    LoraScale,
    Probability,
    Seed,
    Text,
    TokenId,
    TokenizeRequest,
)

__all__ = ["MAX_PROMPTS", "ChatRequest", "CompletionRequest", "CompletionsRequest", "Limits", "StreamOptions",
           "Unsupported", "bounded", "prompts"]

MAX_PROMPTS = 64  # prompts in one request (each decoded `n` times)
MAX_PROBS = 100  # top log-probabilities per token
Int = Annotated[int, Field(ge=0, le=2**31 - 1)]
Count = Annotated[int, Field(ge=-1, le=2**31 - 1)]  # -1: no limit
Real = Annotated[float, Field(ge=-1e9, le=1e9)]
Penalty = Annotated[float, Field(ge=-100, le=100)]
Bias = Annotated[float, Field(ge=-100, le=100)] | Literal[False]  # false: never this token
# llama.cpp's [token or text, bias] pair (JSON has no tuples: a two-item array is one)
BiasPair = Annotated[tuple[TokenId | Text, Bias], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]


class Unsupported:
    """Field metadata: remat does not do `what`; the field is accepted only at a neutral value (`neutral`, and
    null). Any other value is a 400 naming the field; the document lists the neutral values."""

    def __init__(self, what: str, *neutral: Any):
        self.what, self.neutral = what, neutral
        self.shown = " or ".join(json.dumps(v) for v in neutral) if neutral else "null"

    def check(self, value: Any) -> Any:
        if value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.neutral):
            return value
        raise PydanticCustomError("not_supported", "not supported: {what} (send {shown} or leave it out)",
                                  {"what": self.what, "shown": self.shown})

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict:
        return {"enum": [*self.neutral, None], "description": f"not supported ({self.what}): only {self.shown}"}


def _samplers(v: list[str] | str | None) -> list[str] | str | None:
    if v is not None:
        try:
            sampler_names(v)
        except ValueError as e:
            raise PydanticCustomError("not_supported" if "not supported" in str(e) else "value_error", str(e)) from None
    return v


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # neutral: remat sends no obfuscation field


class PromptObject(Body):
    """llama.cpp's prompt object; remat serves a text-only model, so no multimodal data."""

    prompt_string: Text
    multimodal_data: Annotated[list[Text] | None, Unsupported("multimodal prompts (a text-only model)", [])] = None


def prompt_type(token: Any = TokenId, text: Any = Text, max_items: int = 2**31 - 1) -> Any:
    """A prompt as llama.cpp and OpenAI take it: a text; token ids, or ids and texts mixed (one prompt); or a
    list of prompts (texts, id lists, llama.cpp's objects). `prompts()` tells them apart."""
    one = Annotated[list[token | text], Field(min_length=1, max_length=max_items)]
    return Annotated[text, Field(min_length=1)] | Annotated[
        list[token | text | one | PromptObject], Field(min_length=1, max_length=max_items)]


# the unbounded prompt (the served model bounds it: `remat.serve.schemas.bounded`)
Prompt = Annotated[Text, Field(min_length=1)] | Annotated[
    list[TokenId | Text | Annotated[list[TokenId | Text], Field(min_length=1)] | PromptObject], Field(min_length=1)]


def prompts(prompt: Any) -> list[str | list[int | str]]:
    """The prompts of a `prompt` field, as llama.cpp reads it: a text, or a list with a token id in it (ids
    and texts mixed), is one prompt; any other list is a list of prompts."""
    if isinstance(prompt, str) or any(isinstance(x, int) for x in prompt):
        return [prompt]
    out: list[str | list[int | str]] = []
    for x in prompt:
        out.append(x.prompt_string if isinstance(x, PromptObject) else x)
    if len(out) > MAX_PROMPTS:
        raise PydanticCustomError("value_error", f"more than {MAX_PROMPTS} prompts in one request")
    return out


class Sampled(Body):
    """llama.cpp's completion fields, on every generation route."""

    model: Text | None = None  # one model is served: any name
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n_predict: Count | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    n_cmpl: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, description="0: greedy")] | None = None
    dynatemp_range: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    dynatemp_exponent: Annotated[float, Field(ge=0, le=100)] | None = None
    top_k: Int | None = None
    top_p: Probability | None = None
    min_p: Probability | None = None
    top_n_sigma: Real | None = None
    typical_p: Probability | None = None
    typ_p: Probability | None = Field(None, description="llama.cpp's web UI's name for typical_p")
    xtc_probability: Probability | None = None
    xtc_threshold: Probability | None = None
    repeat_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    repeat_last_n: Count | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    min_keep: Int | None = None
    samplers: Annotated[list[Text] | Text | None, AfterValidator(_samplers)] = None
    seed: Seed | None = None
    logit_bias: dict[Text, Bias] | list[BiasPair] | None = None
    ignore_eos: bool | None = None
    stop: Text | list[TokenId | Text] | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_PROBS)] | None = None
    post_sampling_probs: bool | None = None
    t_max_predict_ms: Annotated[int, Field(ge=-1, le=2**53)] | None = None
    return_tokens: bool | None = None
    response_fields: list[Text] | None = None  # /completion's (llama.cpp applies it there only)
    lora: list[LoraScale] | None = None
    # neutral: prompt caching, slots, streaming extras and debug output change nothing remat answers
    cache_prompt: bool | None = None
    n_cache_reuse: Int | None = None
    n_keep: Count | None = None  # remat refuses a prompt over the context rather than shifting it
    n_discard: Int | None = None
    id_slot: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    sse_ping_interval: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    verbose: bool | None = None
    backend_sampling: bool | None = None
    chat_format: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    generation_prompt: Text | None = None
    parse_tool_calls: bool | None = None
    chat_parser: Text | None = None
    reasoning_control: bool | None = None
    reasoning_budget_start_tag: Text | None = None
    reasoning_budget_end_tags: list[Text] | None = None
    reasoning_budget_end_tag: Text | None = None
    reasoning_budget_message: Text | None = None
    # unsupported, and the settings that only matter when they are on
    n_indent: Annotated[int | None, Unsupported("minimum line indentation", 0)] = None
    mirostat: Annotated[int | None, Unsupported("Mirostat sampling", 0)] = None
    mirostat_tau: Real | None = None
    mirostat_eta: Real | None = None
    dry_multiplier: Annotated[float | None, Unsupported("DRY sampling", 0)] = None
    dry_base: Real | None = None
    dry_allowed_length: Int | None = None
    dry_penalty_last_n: Count | None = None
    dry_sequence_breakers: Annotated[list[Text], Field(min_length=1)] | None = None
    adaptive_target: Annotated[float | None, Unsupported("adaptive-p sampling", -1)] = None
    adaptive_decay: Annotated[float, Field(ge=0, le=0.99)] | None = None
    grammar: Annotated[Text | None, Unsupported("grammars", "")] = None
    json_schema: Annotated[dict[Text, Any] | None, Unsupported("JSON-schema constraints")] = None
    grammar_lazy: bool | None = None
    grammar_triggers: list[Any] | None = None
    preserved_tokens: list[Text] | None = None
    reasoning_format: Annotated[Text | None, Unsupported("splitting reasoning out", "none", "auto")] = None
    reasoning_budget_tokens: Annotated[int | None, Unsupported("reasoning budgets", -1)] = None
    thinking_budget_tokens: Annotated[int | None, Unsupported("reasoning budgets", -1)] = None
    continue_final_message: bool | None = None  # chat: continue the last assistant message

    @property
    def max_new(self) -> int | None:
        """llama.cpp's n_predict under its three names, the first sent."""
        return next((v for v in (self.n_predict, self.max_completion_tokens, self.max_tokens) if v is not None), None)

    @property
    def choices(self) -> int:
        return self.n_cmpl or self.n or 1


class OpenAIFields(Sampled):
    """OpenAI's request fields beyond llama.cpp's."""

    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: dict[Text, Any] | None = None


class CompletionRequest(Sampled):
    """llama.cpp's /completion."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_PROBS)] | None = Field(None, description="n_probs, when it is not sent")
    echo: Annotated[bool | None, Unsupported("echo on /completion (use /v1/completions)", False)] = None


class CompletionsRequest(OpenAIFields):
    """OpenAI's /v1/completions."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_PROBS)] | None = Field(
        None, description="the top `logprobs` tokens' log-probabilities with each token")
    echo: bool | None = Field(None, description="the prompt's text before the completion")
    best_of: Annotated[int | None, Unsupported("best_of above 1", 1)] = None
    suffix: Annotated[Text | None, Unsupported("a suffix (insertion)", "")] = None


class TextPart(Body):
    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: dict[Text, Any] | None = None


class RefusalPart(Body):
    type: Literal["refusal"]
    refusal: Text


def _not_text(v: Any) -> Any:
    raise PydanticCustomError("not_supported", "not supported: {kind} parts (remat serves a text-only model)",
                              {"kind": v.type})


class OtherPart(Body):
    """A part OpenAI or llama.cpp take that a text-only model cannot: refused, naming its type."""

    model_config = Body.model_config | {"extra": "allow"}
    type: Literal["image_url", "input_audio", "input_video", "file"]


Part = Annotated[TextPart | RefusalPart | Annotated[OtherPart, AfterValidator(_not_text)], Field(discriminator="type")]


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[Part] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None  # passed to the template, which may render it
    refusal: Text | None = None
    tool_calls: Annotated[list[Any] | None, Unsupported("tool calls", [])] = None
    function_call: Annotated[dict[Text, Any] | None, Unsupported("function calls")] = None
    audio: Annotated[dict[Text, Any] | None, Unsupported("audio")] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content
                       if isinstance(p, (TextPart, RefusalPart)))


class ChatRequest(OpenAIFields):
    """OpenAI's /v1/chat/completions, with llama.cpp's fields."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="passed to the chat template; none turns thinking off (enable_thinking false)")
    chat_template_kwargs: dict[Text, Any] | None = Field(None, description="variables for the chat template")
    add_generation_prompt: bool | None = None
    parallel_tool_calls: bool | None = None  # neutral without tools
    prediction: dict[Text, Any] | None = None  # neutral: predicted outputs only change the latency
    echo: Annotated[bool | None, Unsupported("echo on chat completions", False)] = None
    tools: Annotated[list[Any] | None, Unsupported("tools", [])] = None
    tool_choice: Annotated[Text | dict[Text, Any] | None, Unsupported("tool choice", "none", "auto")] = None
    functions: Annotated[list[Any] | None, Unsupported("functions", [])] = None
    function_call: Annotated[Text | dict[Text, Any] | None, Unsupported("function calls", "none", "auto")] = None
    response_format: Annotated[dict[Text, Any] | None, Unsupported("formats but text", {"type": "text"})] = None
    audio: Annotated[dict[Text, Any] | None, Unsupported("audio output")] = None
    modalities: Annotated[list[Text] | None, Unsupported("output modalities other than text", ["text"])] = None
    moderation: Annotated[dict[Text, Any] | None, Unsupported("moderation")] = None
    verbosity: Annotated[Text | None, Unsupported("verbosity", "medium")] = None
    web_search_options: Annotated[dict[Text, Any] | None, Unsupported("web search")] = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("value_error", "top_logprobs needs logprobs: true")
        return self


# ---------------------------------------------------------------------------------------------------------
# the served model's bounds


@dataclass(frozen=True)
class Limits:
    """What the served model and server bound in a request by themselves: the context (tokens), the
    vocabulary and the sequences decoded at once (`--parallel`: the most choices a request may ask)."""

    n_ctx: int
    vocab: int
    parallel: int = 1

    @property
    def max_chars(self) -> int:
        """The longest text the server tokenizes: CHARS_PER_TOKEN per token of the context."""
        return CHARS_PER_TOKEN * self.n_ctx


@functools.cache
def bounded(limits: Limits) -> dict[type[BaseModel], type[BaseModel]]:
    """The request models with the served model's bounds, by the model each one narrows: a token id is in
    the vocabulary, a prompt of token ids is shorter than the context, a text is at most `max_chars`
    characters (a longer one is refused untokenized), token ids to detokenize too, and `n` at most
    `parallel`. The server validates with these and documents these (same names), so what the document
    allows, it takes (but for what a text tokenizes to)."""
    token = Annotated[int, Field(ge=0, le=max(0, limits.vocab - 1))]
    text = Annotated[Text, Field(max_length=min(limits.max_chars, MAX_TEXT))]
    prompt: Any = (prompt_type(token, text, max(1, limits.n_ctx - 1)), ...)
    n: Any = (Annotated[int, Field(ge=1, le=limits.parallel)] | None, None)

    def narrow(model: type[BaseModel], **fields: Any) -> type[BaseModel]:
        return create_model(model.__name__, __base__=model, __doc__=model.__doc__, **fields)

    return {
        CompletionRequest: narrow(CompletionRequest, prompt=prompt, n=n, n_cmpl=n),
        CompletionsRequest: narrow(CompletionsRequest, prompt=prompt, n=n, n_cmpl=n),
        ChatRequest: narrow(ChatRequest, n=n, n_cmpl=n),
        TokenizeRequest: narrow(TokenizeRequest, content=(text, ...)),
        DetokenizeRequest: narrow(DetokenizeRequest, tokens=(Annotated[list[token], Field(max_length=limits.max_chars)],
                                                             ...)),
    }
