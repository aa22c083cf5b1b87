"""Training data: read records, tokenize them with loss masks, cut the token stream into windows.

Records are ``{"text": str}`` (every token is trained on), ``{"messages": [{role, content, weight?}, ...]}``
(rendered with the model's chat template; only assistant messages are trained on, and not those with
``"weight": 0``, OpenAI's convention) or ``{"prompt": ..., "completion": ...}`` (TRL's form: both strings, or
both message lists rendered with the chat template; only the completion is trained on).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
from dataclasses import dataclass

import torch

from remat.base.settings import UsageError

ROLES = ("system", "user", "assistant")
IGNORE = -100  # label value that cross-entropy skips


class DataError(UsageError):
    """Bad training data; the message is one line that names the file, the line and what is wrong."""


@dataclass
class Example:
    ids: list[int]
    loss_mask: list[bool]  # True where the token is a training target


@dataclass
class Windows:
    input_ids: torch.Tensor  # [N, ctx] int64
    labels: torch.Tensor  # [N, ctx] int64, -100 where not trained on

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def default_data_path() -> pathlib.Path:
    """The bundled demo corpus (chat records about remat itself)."""
    path = importlib.resources.files("remat.training") / "corpus" / "remat_chat.jsonl"
    return pathlib.Path(str(path))


# ---------------------------------------------------------------- reading


def read_records(path: str | os.PathLike) -> list[dict]:
    """Read a .jsonl file (text or chat records), a .json file, or any other file as one text record."""
    name = str(path)
    p = pathlib.Path(path)
    try:
        content = p.read_text(encoding="utf-8-sig")  # -sig: a BOM must not break the first line
    except FileNotFoundError:
        raise DataError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{name}: is a directory, expected a data file") from None
    except PermissionError:
        raise DataError(f"{name}: permission denied") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{name}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise DataError(f"{name}: cannot read ({e.strerror or e})") from None

    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _parse_jsonl(content, name)
    if suffix == ".json":
        return _parse_json(content, name)
    if not content.strip():
        raise DataError(f"{name}: the file is empty, nothing to train on")
    return [{"text": content}]


def parse_records(records: list, source: str = "data") -> list[dict]:
    """Validate in-memory records (e.g. sent inline to the server); errors say "<source> record N: ..."."""
    if not isinstance(records, list):
        raise DataError(f"{source}: expected a list of records, got {type(records).__name__}")
    if not records:
        raise DataError(f"{source}: no records, nothing to train on")
    return [_check_record(r, f"{source} record {i}") for i, r in enumerate(records, 1)]


def _parse_jsonl(content: str, name: str) -> list[dict]:
    records = []
    for lineno, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        records.append(_check_record(obj, where))
    if not records:
        raise DataError(f"{name}: no records (the file is empty), nothing to train on")
    return records


def _parse_json(content: str, name: str) -> list[dict]:
    # .json is either one JSON document (a list of records or one record) or, as often in practice,
    # JSON Lines under a .json name.
    try:
        obj = json.loads(content)
    except json.JSONDecodeError:
        return _parse_jsonl(content, name)
    if isinstance(obj, dict):
        return [_check_record(obj, name)]
    return parse_records(obj, name)


def _check_record(obj: object, where: str) -> dict:
    """Return the record reduced to the keys we use, or raise DataError naming `where`."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    forms = [k for k in ("text", "messages", "prompt") if k in obj]
    if "completion" in obj and "prompt" not in obj:
        forms.append("completion")
    if len(forms) > 1:
        both = " and ".join(f'"{k}"' for k in forms)
        raise DataError(f"{where}: record has both {both}; use one")
    if not forms:
        keys = ", ".join(f'"{k}"' for k in list(obj)[:5]) or "none"
        needs = '"text", "messages", or "prompt" and "completion"'
        raise DataError(f"{where}: record needs {needs} (keys found: {keys})")
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f'{where}: "text" must be a non-empty string, got {_show(text)}')
        return {"text": text}
    if "messages" in obj:
        messages = _check_messages(obj["messages"], "messages", where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: chat record has no assistant message, nothing to train on")
        _check_trainable(messages, where)
        return {"messages": messages}
    return _check_prompt_completion(obj, where)


def _check_prompt_completion(obj: dict, where: str) -> dict:
    # TRL's prompt-completion form: both strings, or both message lists (conversational).
    for key, other in (("prompt", "completion"), ("completion", "prompt")):
        if key not in obj:
            raise DataError(f'{where}: record has "{other}" but no "{key}"')
    prompt, completion = obj["prompt"], obj["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not value.strip():
                raise DataError(f'{where}: "{key}" must be a non-empty string, got {_show(value)}')
        return {"prompt": prompt, "completion": completion}
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = _check_messages(prompt, "prompt", where)
        completion = _check_messages(completion, "completion", where)
        if not any(m["role"] == "assistant" for m in completion):
            raise DataError(f'{where}: "completion" has no assistant message, nothing to train on')
        _check_trainable(completion, where)
        return {"prompt": prompt, "completion": completion}
    raise DataError(
        f'{where}: "prompt" and "completion" must both be non-empty strings or both lists of messages, '
        f"got {_show(prompt)} and {_show(completion)}"
    )


def _check_messages(messages: object, key: str, where: str) -> list[dict]:
    """Validated messages reduced to role, content and (on assistant messages) weight."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "{key}" must be a non-empty list, got {_show(messages)}')
    label = "message" if key == "messages" else f"{key} message"
    clean = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            got = _json_type(m)
            raise DataError(f"{where}: {label} {i} must be an object with role and content, got {got}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: {label} {i} role must be one of {', '.join(ROLES)}, got {_show(role)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {label} {i} content must be a string, got {_show(content)}")
        message = {"role": role, "content": content}
        if "weight" in m:
            weight = m["weight"]
            # OpenAI's convention: 0 leaves the message out of the loss, 1 trains it; nothing in between.
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
                raise DataError(f"{where}: {label} {i} weight must be 0 or 1, got {_show(weight)}")
            if role == "assistant":  # only assistant messages are ever trained on
                message["weight"] = int(weight)
        clean.append(message)
    return clean


def _check_trainable(messages: list[dict], where: str) -> None:
    if all(m.get("weight", 1) == 0 for m in messages if m["role"] == "assistant"):
        raise DataError(f"{where}: every assistant message has weight 0, nothing to train on")


def _json_type(obj: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(obj), "a number" if isinstance(obj, (int, float)) else type(obj).__name__)


def _show(value: object) -> str:
    if isinstance(value, (dict, list)):
        return _json_type(value) + ("" if value else " (empty)")
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------- tokenizing


def tokenize(records: list[dict], tokenizer) -> list[Example]:
    """Token ids and loss masks: every token of a text record; only assistant turns of a chat record;
    only the completion (and EOS) of a prompt-completion record."""
    examples = []
    for i, record in enumerate(records, 1):
        where = f"record {i}"
        if "messages" in record:
            examples.append(_tokenize_chat(record["messages"], tokenizer, where))
        elif "prompt" in record and isinstance(record["prompt"], list):
            # Conversational prompt-completion: the prompt's turns are context, even its assistant turns.
            turns = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in record["prompt"]]
            examples.append(_tokenize_chat(turns + record["completion"], tokenizer, where))
        elif "prompt" in record:
            # Encoded apart so the prompt/completion boundary is exact whatever the tokenizer merges.
            prompt = _encode(tokenizer, record["prompt"])
            completion = _encode(tokenizer, record["completion"]) + [_eos(tokenizer)]
            mask = [False] * len(prompt) + [True] * len(completion)
            examples.append(Example(ids=prompt + completion, loss_mask=mask))
        else:
            ids = _encode(tokenizer, record["text"]) + [_eos(tokenizer)]
            examples.append(Example(ids=ids, loss_mask=[True] * len(ids)))
    return examples


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no end-of-sequence token to close text records with")
    return tokenizer.eos_token_id


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> list[int]:
    import jinja2  # transformers renders chat templates with it

    messages = [{"role": m["role"], "content": m["content"]} for m in messages]  # the template sees no weight
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (jinja2.TemplateError, ValueError, TypeError, LookupError) as e:  # no template, or it raised
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: chat records need a chat template and this tokenizer has none") from None
        raise DataError(f"{where}: the chat template failed: {e}") from None
    return _encode(tokenizer, text)


def _tokenize_chat(messages: list[dict], tokenizer, where: str) -> Example:
    # Render the whole conversation once, then find each assistant turn as the difference between the
    # conversation up to and including it and the conversation before it plus the generation prompt.
    # This works for any template whose renders of shorter conversations are token prefixes of longer
    # ones, without relying on {% generation %} markers.
    ids = _render(tokenizer, messages, False, where)
    mask = [False] * len(ids)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        prompt = _render(tokenizer, messages[:k], True, where)
        upto = _render(tokenizer, messages[: k + 1], False, where)
        if not (len(prompt) <= len(upto) and upto == ids[: len(upto)] and prompt == upto[: len(prompt)]):
            raise DataError(
                f"{where}: the chat template is not prefix-stable (rendering messages 1..{k} with the "
                f"generation prompt, then 1..{k + 1}, does not extend the same tokens), so assistant "
                "tokens cannot be located; use text records or a model with a simpler template"
            )
        # Targets: the assistant content and its end-of-turn token; formatting the template adds
        # after that token (e.g. ChatML's trailing newline) is not something the model should learn to emit.
        end = len(upto)
        turn_specials = [j for j in range(len(prompt), end) if ids[j] in special]
        if turn_specials:
            end = turn_specials[-1] + 1
        for j in range(len(prompt), end):
            mask[j] = True
    return Example(ids=ids, loss_mask=mask)


# ---------------------------------------------------------------- windows and batches


def make_windows(examples: list[Example], ctx: int, pad_id: int, *, pack: bool = True) -> Windows:
    """Windows of ctx inputs with their shifted labels (-100 where not trained on).

    pack=True concatenates the examples (each already ends with EOS or its end-of-turn token) and cuts the
    stream so window k covers stream[k*ctx : k*ctx+ctx+1]. pack=False cuts each example the same way on its
    own, so a window never holds two documents; the tail is padded. Windows without targets are dropped.
    """
    if ctx < 1:
        raise ValueError(f"ctx must be at least 1, got {ctx}")
    if pack:
        docs = [([t for e in examples for t in e.ids], [m for e in examples for m in e.loss_mask])]
    else:
        docs = [(e.ids, e.loss_mask) for e in examples]
    cut = [_cut(ids, mask, ctx, pad_id) for ids, mask in docs]
    window = torch.cat([w for w, _ in cut]) if cut else torch.zeros(0, ctx + 1, dtype=torch.int64)
    window_target = torch.cat([t for _, t in cut]) if cut else torch.zeros(0, ctx + 1, dtype=torch.bool)
    labels = torch.where(window_target[:, 1:], window[:, 1:], torch.full_like(window[:, 1:], IGNORE))
    keep = window_target[:, 1:].any(dim=1)
    return Windows(input_ids=window[:, :-1][keep].contiguous(), labels=labels[keep].contiguous())


def _cut(ids: list[int], mask: list[bool], ctx: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, ctx+1] token and target windows over one stream; consecutive windows share one token."""
    n = max(0, -(-(len(ids) - 1) // ctx))  # windows that hold at least one (input, target) pair
    total = n * ctx + 1
    stream = torch.full((total,), pad_id, dtype=torch.int64)
    target = torch.zeros(total, dtype=torch.bool)
    stream[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    target[: len(mask)] = torch.tensor(mask, dtype=torch.bool)  # padding is never a target
    index = torch.arange(n).unsqueeze(1) * ctx + torch.arange(ctx + 1)
    return stream[index], target[index]


def batches(windows: Windows, batch: int, *, seed: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled full batches of windows; the same seed and epoch give the same batches."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(windows), generator=generator)
    # Drop the incomplete last batch so every step has the same shapes (one traced graph).
    return [
        (windows.input_ids[idx], windows.labels[idx])
        for idx in (order[s : s + batch] for s in range(0, len(order) - batch + 1, batch))
    ]


@dataclass(frozen=True)
class Records:
    """Checked training records and the name errors call them by (the file's path, or "data")."""

    items: list[dict]
    name: str

    @classmethod
    def of(cls, source: str | os.PathLike | list) -> Records:
        """Read a data file (`read_records`), or check a list of in-memory records (`parse_records`)."""
        if isinstance(source, list):
            return cls(parse_records(source), "data")
        return cls(read_records(source), str(source))


def load_windows(
    source: str | os.PathLike | list | Records, tokenizer, ctx: int, batch: int, *, pack: bool = True
) -> Windows:
    """Read (unless read already), tokenize and window a data file or records; refuse data too small to train.

    pack: concatenate the documents into full windows (True), or give each document windows of its own.
    """
    records = source if isinstance(source, Records) else Records.of(source)
    name = records.name
    examples = tokenize(records.items, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    windows = make_windows(examples, ctx, pad_id if pad_id is not None else 0, pack=pack)
    if len(windows) == 0:
        raise DataError(
            f"{name}: no trainable tokens (text too short, or chat records whose assistant turns are empty)"
        )
    if len(windows) < batch:
        tokens = sum(len(e.ids) for e in examples)
        hint = f"lower batch to {len(windows)}"
        if pack and (tokens - 1) // batch >= 1:  # unpacked, a smaller ctx only splits long documents
            hint += f" or ctx to about {(tokens - 1) // batch}"
        raise DataError(
            f"{name}: gives {len(windows)} window(s) of {ctx} tokens ({tokens} tokens), fewer than batch "
            f"{batch}; {hint}, or add more data"
        )
    return windows
