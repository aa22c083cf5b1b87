"""Every setting once: its type, default, bounds and help; the byte parser; the error types.

This module is light (pydantic, no torch): the command line builds its arguments from
these fields, the server builds its request models from them, and the trainer reads
them. A new knob is one field here (see CONTRIBUTING.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

try:
    VERSION = metadata.version("remat")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0+local"

MiB = 1 << 20
DEFAULT_SLOWDOWN_PPM = 50_000  # training may slow decoding by 5%
MAX_SEED = 2**63 - 1  # torch.manual_seed's range


# ---------------------------------------------------------------------------------------------- errors


class RematError(Exception):
    """An error meant for the user: one line, and the command line's exit code."""

    exit_code = 1


class UsageError(RematError, ValueError):
    """A setting or input that cannot work (bad model, data, adapter, checkpoint or option)."""

    exit_code = 2


class AdapterError(UsageError):
    """An adapter that cannot be made, saved or merged; the message is one line meant for the user."""


class GateRefused(RematError):
    """The job does not fit the budget with any allowed setting; the message gives the figures."""

    exit_code = 3

    def __init__(self, message: str, plans: dict[str, dict[str, int]] | None = None, extra: dict | None = None):
        super().__init__(message)
        self.plans = plans or {}  # policy -> plan by category, for a caller that shows them
        self.extra = extra or {}  # other figures of the refusal (a LoRA's own bytes)


class Cancelled(Exception):
    """Raised by a `before_chunk` hook to stop training at a chunk boundary (not an error)."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line of at most `limit` characters (its type name when it says nothing)."""
    text = " ".join(str(e).split())
    return (text[:limit] + "…" if len(text) > limit else text) or type(e).__name__


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------------------------- sizes

_UNITS = {"": MiB, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB, "mb": MiB, "mib": MiB,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G' or a bare number of MiB -> bytes."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value < float("inf"):
        raise ValueError(f"memory size '{text}' is not a positive size like 512MiB or 8GiB")
    return int(value * _UNITS[unit])


def _bytes(value: object) -> object:
    return parse_bytes(value) if isinstance(value, str) else value


def _comma_list(value: object) -> object:
    return [t for t in value.split(",") if t] if isinstance(value, str) else value


MemorySize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
# llama.cpp's file types whose every tensor type remat keeps in blocks (`remat.models.mixes.MIXES`)
WeightMix = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_s", "q4_k_m", "q5_k_s",
                    "q5_k_m", "q6_k"]
Names = Annotated[list[str], BeforeValidator(_comma_list), Field(min_length=1)]
# Where a step runs (`remat.core.devices`): checked present when it runs; a plan needs none.
Device = Annotated[str, BeforeValidator(lambda v: v.strip().lower() if isinstance(v, str) else v),
                   Field(pattern=r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$")]
DEVICE_HELP = ("auto (CUDA if present, else MPS, else the CPU), cpu, cuda, cuda:N or mps (untested); `remat plan` "
               "plans for a device this machine lacks")


@dataclass(frozen=True)
class Cli:
    """How a field appears on the command line when not as `--field-name VALUE`."""

    flags: tuple[str, ...] = ()
    action: str | None = None  # argparse action: "store_true", "store_false", "append"; "store": the text kept
    # as it is and checked with the settings (a bad value: one error line, not argparse's usage)


# ---------------------------------------------------------------------------------------------- training


class TrainSettings(BaseModel):
    """One training job, as `remat finetune` and `POST /train` take it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(None, description="GGUF file, HF safetensors folder, or preset "
                              "(default: the embedded SmolLM2-135M-Instruct)")
    data: str | list | None = Field(None, description="text file, JSONL {text}, JSONL chat {messages} or "
                                    "{prompt, completion} records (default: the bundled corpus)")
    ctx: int = Field(256, ge=1, description="tokens per window")
    batch: int = Field(1, ge=1, description="windows per step")
    epochs: int = Field(1, ge=1, description="passes over the data")
    steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    lr: float | None = Field(None, gt=0, allow_inf_nan=False,
                             description="learning rate (default 1e-3 with LoRA, 1e-4 with full fine-tuning)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of the adapter's initial weights and the data order")
    recompute: str = Field(
        "auto", pattern=r"^(auto|budget|off|on|layer|dots|offload|every:[1-9][0-9]*)$",
        description="what the backward recomputes: off (keep everything), on (keep one l_out mark per layer), "
        "dots (keep matrix products too), offload (on a GPU: on, the marks kept in host memory), every:K (one "
        "mark every K layers), budget (the fastest plan within --memory-budget), auto (off when that fits, else "
        "as budget)")
    loss_chunk: int | None = Field(None, ge=0, description="tokens per piece of the loss head, 0 = one piece "
                                   "(default: from the model's vocabulary, a piece's fp32 logits at most 48 MiB, "
                                   "16 to 256 tokens)")
    path: Annotated[Literal["window", "walk"], BeforeValidator(lambda v: _renamed(v, "ubatch", "window"))] = Field(
        "window", description="window: one graph per whole window; walk: chunks of --ubatch tokens over a KV cache")
    ubatch: int = Field(256, ge=1, description="walk: tokens per chunk (llama.cpp's n_ubatch)")
    walk: Literal["exact", "truncated"] = Field(
        "exact", description="walk: exact gives the whole window's gradient (a forward sweep fills the cache, then "
        "the chunks' steps run in reverse); truncated treats earlier chunks' cache and state as constants (the "
        "reference's cost, not the window's gradient)")
    accumulate: int = Field(1, ge=1, description="windows per optimizer step")
    optimizer_in_backward: Literal["auto", "on", "off"] = Field(
        "auto", description="apply each parameter's AdamW update the moment its gradient is complete, inside the "
        "backward, so the gradients never all exist at once (auto: for full fine-tuning where the job fits no other "
        "way, as it slows the backward: one window per step on the window path in one process; off otherwise)")
    pack: Annotated[bool, Cli(action="store_true")] = Field(
        False, description="concatenate documents into windows (default: one document per window, padded)")
    memory_budget: MemorySize | None = Field(None, description="e.g. 2GiB (default: free memory of the device)")
    device: Device = Field("auto", description=DEVICE_HELP)
    out: str | None = Field(None, description="folder for the adapter (PEFT + adapter.gguf), or the model when full")
    lora: Annotated[bool, Cli(("--full",), "store_false")] = Field(
        True, description="train a LoRA adapter (--full: fine-tune every weight instead)")
    lora_r: int = Field(8, ge=1, le=4096, description="LoRA rank")
    lora_alpha: float = Field(16.0, gt=0, allow_inf_nan=False, description="LoRA alpha (scale alpha / r)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout")
    lora_targets: Names | None = Field(None, description="comma-separated module names (default: every linear "
                                       "layer of the decoder)")
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Cli(action="store")] = Field(
        "auto", description="the dtype the step computes in, as autocast's mixed precision (trainable weights, AdamW's "
        "state and the loss stay float32); auto: bfloat16 where the hardware computes it natively (a CPU with "
        "AVX512-BF16 or AMX, CUDA), else float32")
    weights: Annotated[WeightMix | None, BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)] = Field(
        None, description="plan only: the frozen weights at a GGUF file type, each tensor at the type llama.cpp's "
        "quantizer gives it (default: as the model stores them: a GGUF's own types, a preset in float32)")
    save_every: int | None = Field(None, ge=1, description="write a checkpoint every N steps into --out")
    resume: str | None = Field(None, description="continue from the latest checkpoint in this folder")
    dist_timeout: float = Field(600, gt=0, allow_inf_nan=False,
                                description="under torchrun: seconds a process waits for the others before the "
                                "run stops")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.lora else 1e-4)

    def optimizer_steps(self, n_windows: int) -> tuple[int, int]:
        """(steps per epoch, steps of the run) for data giving `n_windows` windows."""
        per_epoch = n_windows // self.batch // self.accumulate
        if per_epoch == 0:
            raise UsageError(f"--accumulate {self.accumulate} needs more batches than the data gives per epoch "
                             f"({n_windows // self.batch})")
        return per_epoch, min(self.steps or per_epoch * self.epochs, per_epoch * self.epochs)

    @model_validator(mode="after")
    def _together(self) -> TrainSettings:
        if self.save_every is not None and not self.out:
            raise ValueError("--save-every needs --out")
        if self.path == "walk" and self.ctx % self.ubatch:
            raise ValueError(f"--ctx {self.ctx} must be a multiple of --ubatch {self.ubatch} on the walk path")
        return self


class Renamed(UserWarning):
    """An old spelling of a setting, still accepted."""


class Note(UserWarning):
    """What a user should know that is not an error (a weight dequantized at load); the CLI shows it on stderr."""


def _renamed(value: object, old: str, new: str) -> object:
    if value == old:
        warnings.warn(f"'{old}' is now called '{new}'", Renamed, stacklevel=2)
        return new
    return value


# ---------------------------------------------------------------------------------------------- serving


class ServeSettings(BaseModel):
    """`remat serve`: the server's own knobs (a job's knobs are TrainSettings)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description=TrainSettings.model_fields["model"].description)
    host: str = Field("127.0.0.1", description="address to bind (default 127.0.0.1: this machine only)")
    port: int = Field(8080, ge=0, le=65535, description="port")
    api_key: Annotated[list[str], Cli(action="append")] = Field(
        [], description="require this key (Authorization: Bearer KEY or X-Api-Key); repeatable")
    parallel: Annotated[int, Cli(("--parallel", "-np"))] = Field(
        1, ge=1, description="requests that decode at once; more wait")
    ctx: int | None = Field(None, ge=1, description="context size for serving (default: the model's maximum)")
    n_predict: Annotated[int, Cli(("--n-predict", "-n"))] = Field(
        -1, ge=-1, le=2**31 - 1, description="the most tokens a request generates, also where it names no count "
        "(as llama.cpp's server: a request asking more gets this many; -1: until the end of text or the context "
        "is full)")
    max_slowdown_ppm: int = Field(DEFAULT_SLOWDOWN_PPM, ge=0, le=1_000_000,
                                  description="how much training may slow decoding, in parts per million "
                                  "(50000 = 5%)")
    memory_budget: MemorySize | None = Field(None, description="memory for training jobs, e.g. 2GiB "
                                             "(default: free memory)")
    state_dir: str = Field("remat-state", description="folder for jobs, their events and adapters")
    max_queued_jobs: int = Field(16, ge=1, le=1_000_000, description="training jobs that may wait their turn; "
                                 "one more (a new job, or a resumed one) is refused with 429 until one starts or "
                                 "is cancelled")
    max_body: int = Field(64 << 20, ge=1, description="largest request body in bytes")
    body_timeout: float = Field(10.0, gt=0, allow_inf_nan=False,
                                description="seconds a request body may pause before the server answers 408")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    device: Device = Field("auto", description="where the model decodes and jobs train by default: "
                           + DEVICE_HELP.split(";")[0])
    weights: Literal["blocks", "float32"] = Field(
        "blocks", description="what the model decodes from on a CPU: blocks (a GGUF's quantized weights through "
        "PyTorch's int4 kernel, bfloat16 products; other stored weights made float32 at load) or float32 (every "
        "weight dequantized at load)")
    compile: Annotated[bool, Cli(action="store_true")] = Field(
        False, description="compile the decode step of one sequence without adapters (torch.compile): faster "
        "tokens once it is compiled, which takes a minute or more on a CPU before the server is ready")


def describe(e: ValidationError, *, flags: bool) -> str:
    """A pydantic error as one line: `--ctx: must be ...` (flags) or `ctx: ...` (request fields)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        where = ("--" + loc.replace("_", "-") if flags else loc) if loc else ""
        msg = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if loc and not isinstance(err.get("input"), (dict, list)) else ""
        parts.append(f"{where}: {msg}{got}" if where else msg)
    text = "; ".join(parts)
    return text if flags else text.replace("--", "")
