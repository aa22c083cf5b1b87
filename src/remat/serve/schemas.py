"""The server's request and response bodies as pydantic models: they validate requests and write the
OpenAPI document (`/openapi.json`), so what the document says is what the server checks.

Requests are strict (a string is not a number, `true` is not 1) except that an integral float (`3.0`)
is an integer, as JSON Schema has it. Text never holds a lone surrogate (`"\\ud800"`): it cannot be
tokenized or stored. A training job's fields are `TrainSettings`' fields (one declaration, in
`remat.base.settings`), with the JSON forms of `recompute` (true / false / a policy), `memory_budget` (bytes or
"512MiB") and `lora` ({r, alpha, ...}).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, create_model, model_validator
from pydantic.fields import FieldInfo

from remat.base.settings import MAX_SEED, Device, TrainSettings

MAX_SCALE = 100.0  # |adapter scale|: larger ones only overflow the logits
MAX_TEMPERATURE = 100.0
MAX_TEXT = 4 << 20  # characters of one text field; the served context bounds prompts far below this
MAX_NAME = 64
CHARS_PER_TOKEN = 32  # text longer than this many characters per token of context is refused untokenized


def _no_surrogate(s: str) -> str:
    if s.isascii():  # no scan: CPython knows it
        return s
    try:
        s.encode("utf-8")  # in C, ~0.1 ms a MB (a regular expression takes ~15 ms)
    except UnicodeEncodeError as e:
        raise ValueError(f"lone surrogate \\u{ord(s[e.start]):04x} at character {e.start}: not valid Unicode text") \
            from None
    return s


def _integral(v: object) -> object:
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


Text = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_no_surrogate)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-1, le=MAX_SEED, description="-1: a random seed")]
Scale = Annotated[float, Field(ge=-MAX_SCALE, le=MAX_SCALE)]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, description="0: greedy")]
Probability = Annotated[float, Field(ge=0, le=1)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: _integral(v) for k, v in data.items()}
        return data


# ---------------------------------------------------------------------------------------------------------
# generation


class LoraScale(Body):
    id: Annotated[int, Field(ge=0, le=2**31 - 1)]
    scale: Scale = 1.0


class LoraScales(RootModel[list[LoraScale]]):
    """Every adapter's scale (POST /lora-adapters); unlisted adapters go to 0."""


class TokenizeRequest(Body):
    content: Text
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------------------
# training: TrainSettings' fields, as JSON


def _field(name: str) -> tuple[Any, FieldInfo]:
    """TrainSettings' field `name` as it is (type, bounds, default, description), for `create_model`."""
    info = TrainSettings.model_fields[name]
    return info.annotation, info


_LoraFields: type[Body] = create_model(
    "_LoraFields", __base__=Body, r=_field("lora_r"), alpha=_field("lora_alpha"), dropout=_field("lora_dropout"))


class LoraRequest(_LoraFields):
    targets: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = Field(
        None, description=TrainSettings.model_fields["lora_targets"].description)


class Loose(Body):
    """A training record: other keys are allowed (datasets carry ids and metadata) and left out."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class Message(Loose):

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text
    weight: Literal[0, 1] | None = Field(None, description="assistant messages: 0 leaves it out of the loss")


class TextRecord(Loose):
    text: Annotated[Text, Field(min_length=1)]


class ChatRecord(Loose):
    messages: Annotated[list[Message], Field(min_length=1)]


class PromptRecord(Loose):
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[Message], Field(min_length=1)]
    completion: Annotated[Text, Field(min_length=1)] | Annotated[list[Message], Field(min_length=1)]


Record = TextRecord | ChatRecord | PromptRecord
# The knobs a job takes from TrainSettings, by the same name; the rest are the server's to set.
TRAIN_FIELDS = ("epochs", "steps", "ctx", "batch", "accumulate", "lr", "seed", "path", "ubatch", "walk",
                "loss_chunk", "save_every", "pack", "device", "dtype")


# A memory size as `remat.base.settings.parse_bytes` reads it: 512MiB, 2GiB, 1.5G, a bare number of MiB.
SIZE_PATTERN = r"^[0-9]{1,15}(\.[0-9]{1,6})? ?([KkMmGgTt]([Ii]?[Bb])?|[Bb])?$"


def _optional(name: str, annotation: Any = None, description: str | None = None) -> tuple[Any, FieldInfo]:
    """TrainSettings' field `name` for a request: not sent is None (the server's default). `annotation`
    replaces the field's type where JSON spells it differently; `description` is put before its own."""
    info = TrainSettings.model_fields[name]
    copy = info._copy() if hasattr(info, "_copy") else info
    copy.default = None
    if annotation is not None:
        copy.metadata = []  # the type's constraints move into `annotation`
    if description:
        copy.description = f"{description}; {info.description}"
    base: Any = annotation if annotation is not None else info.annotation
    return base | None, copy


def _recompute() -> tuple[Any, FieldInfo]:
    """`recompute`: TrainSettings' policies (its type and pattern, as declared there), or true (on) / false (off)."""
    pattern = next(m.pattern for m in TrainSettings.model_fields["recompute"].metadata if getattr(m, "pattern", None))
    return _optional("recompute", bool | Annotated[str, Field(pattern=pattern)], "true (on), false (off), or a policy")


def _memory_budget() -> tuple[Any, FieldInfo]:
    """`memory_budget`: bytes, or a size string as the command line takes it."""
    size = Annotated[int, Field(gt=0)] | Annotated[str, Field(pattern=SIZE_PATTERN)]
    annotation, info = _optional("memory_budget", size)
    info.description = ("this job's memory budget, capped by the server's (--memory-budget, else free memory): "
                        "bytes, or a size like 512MiB or 2GiB (a bare number in a string is MiB)")
    return annotation, info


_TRAIN_FIELDS: dict[str, Any] = {"recompute": _recompute(), "memory_budget": _memory_budget(),
                                 **{n: _optional(n) for n in TRAIN_FIELDS},
                                 # its constraints on the string, not on `| None` (null would reach the pattern)
                                 "device": _optional("device", Device)}
TrainFields: type[Body] = create_model("TrainFields", __base__=Body, **_TRAIN_FIELDS)


class TrainRequest(TrainFields):
    """A training job (LoRA by default). Unset fields take the server's defaults."""

    data: Annotated[list[Record], Field(min_length=1, description="records: {text}, {messages: [...]} or "
                                                                  "{prompt, completion}")]
    name: Annotated[Text, Field(min_length=1, max_length=MAX_NAME, pattern=r"\S")] | None = Field(
        None, description="a name for the job and its adapter")
    lora: LoraRequest | bool | None = Field(None, description="{r, alpha, dropout, targets}, or false for full "
                                                              "fine-tuning")
    model: Text | None = Field(None, description="ignored: the server trains the model it serves")


class PlanRequest(TrainRequest):
    """A training job to plan (POST /train/plan): a job as POST /train takes it, or with `"ctx": "max"` the
    longest window that fits its budget, on each path."""

    ctx: Annotated[int, Field(ge=1)] | Literal["max"] | None = Field(
        None, description="tokens per window, or max: the longest window that fits the budget on the window path "
        "and on the walk (in multiples of ubatch), each with the gate's plan there")


# ---------------------------------------------------------------------------------------------------------
# responses


class Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class Health(Out):
    status: Literal["ok"]


class ModelCard(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    meta: dict[str, Any]


class ModelList(Out):
    object: Literal["list"]
    data: list[ModelCard]


class Props(Out):
    model: str
    model_path: str
    n_ctx: int
    total_slots: int
    parallel: int
    max_slowdown_ppm: int
    memory_budget: int | None
    default_generation_settings: dict[str, Any]
    chat_template: str | None
    build_info: str


class Timings(Out):
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float


class CompletionResponse(Out):
    """One choice's completion; several prompts or choices answer a list of these."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]
    prompt: str
    truncated: bool
    stop_type: Literal["none", "eos", "limit", "word"]
    stopping_word: str
    timings: Timings


class Picked(RootModel[dict[str, Any]]):
    """The fields llama.cpp's `response_fields` names, each under its path ("generation_settings/seed")."""


# /completion answers one object, a list of them (several prompts or choices), or the fields asked for
CompletionAnswer = CompletionResponse | list[CompletionResponse] | Picked


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Out):
    role: Literal["assistant"]
    content: str


class TextChoice(Out):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None


class ChatChoice(Out):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None


class CompletionsResponse(Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class ChatResponse(Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Piece(Out):
    id: int
    piece: str


class TokenizeResponse(Out):
    tokens: list[int] | list[Piece]


class DetokenizeResponse(Out):
    content: str


class Adapter(Out):
    id: int
    name: str
    path: str
    scale: float
    job_id: str


class Job(Out):
    id: str
    object: Literal["train.job"]
    name: str | None
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    reason: str | None
    step: int
    steps: int | None
    losses: list[float | None]
    plan: dict[str, Any]
    plans: dict[str, Any]
    recompute: bool
    policy: str
    budget: int
    adapter: dict[str, Any] | None
    output: str | None
    resumable: bool
    checkpoint_step: int | None
    created: float
    finished: float | None
    settings: dict[str, Any]


class Plan(Out):
    """The gate's answer on a job: the plan that would run, every plan it looked at (bytes by category,
    by policy; `off` and `on` always), the policy chosen and why, the budget and the optimizer steps."""

    plan: dict[str, Any]
    plans: dict[str, Any]
    policy: str
    recompute: bool
    recompute_reason: str
    budget: int
    steps: int | None
    dtype: str = Field(description="what the step computes in (float32, bfloat16, float16): `auto` resolved")
    dtype_reason: str = Field(description="why: the setting, or what auto found on the device")


class Longest(Out):
    """The longest window within the budget (POST /train/plan with `"ctx": "max"`), as `remat plan --ctx max
    --json` prints it: by path (window, walk), its window (`ctx`, null when none fits), whether the model's maximum
    context is the limit (`capped`), the gate's policy and plans there, and the next window's plan total."""

    ctx: Literal["max"]
    budget: int
    max_ctx: int
    paths: dict[str, Any]


class Submitted(Plan):
    id: str
    status: Literal["queued"]


class JobList(Out):
    object: Literal["list"]
    data: list[Job]


class Deleted(Out):
    """A finished job's record removed (DELETE /train/{id}), as OpenAI answers a deletion."""

    id: str
    object: Literal["train.job.deleted"]
    deleted: Literal[True]


class Event(Out):
    id: int
    event: str
    data: dict[str, Any]
    created: float


class EventList(Out):
    object: Literal["list"]
    data: list[Event]
