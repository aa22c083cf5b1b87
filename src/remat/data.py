"""Training data: read records, tokenize them with loss masks, cut the token stream into windows.

Records are ``{"text": str}`` (every token is trained on) or ``{"messages": [{role, content}, ...]}``
(rendered with the model's chat template; only assistant tokens are trained on).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant")
IGNORE = -100  # label value that cross-entropy skips


class DataError(ValueError):
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
    path = importlib.resources.files("remat") / "corpus" / "remat_chat.jsonl"
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
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text and has_messages:
        raise DataError(f'{where}: record has both "text" and "messages"; use one')
    if has_text:
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f'{where}: "text" must be a non-empty string, got {_show(text)}')
        return {"text": text}
    if not has_messages:
        keys = ", ".join(f'"{k}"' for k in list(obj)[:5]) or "none"
        raise DataError(f'{where}: record needs "text" or "messages" (keys found: {keys})')

    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list, got {_show(messages)}')
    clean = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} must be an object with role and content, got {_json_type(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} role must be one of {', '.join(ROLES)}, got {_show(role)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} content must be a string, got {_show(content)}")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError(f"{where}: chat record has no assistant message, nothing to train on")
    return {"messages": clean}


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
    """Token ids and loss masks: every token of a text record; only assistant turns of a chat record."""
    examples = []
    for i, record in enumerate(records, 1):
        if "messages" in record:
            examples.append(_tokenize_chat(record["messages"], tokenizer, f"record {i}"))
        else:
            eos = tokenizer.eos_token_id
            if eos is None:
                raise DataError("the tokenizer has no end-of-sequence token to close text records with")
            ids = list(_encode(tokenizer, record["text"])) + [eos]
            examples.append(Example(ids=ids, loss_mask=[True] * len(ids)))
    return examples


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> list[int]:
    import jinja2  # transformers renders chat templates with it

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
        if m["role"] != "assistant":
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


def make_windows(examples: list[Example], ctx: int, pad_id: int) -> Windows:
    """Cut the concatenated examples into windows of ctx inputs; window k covers stream[k*ctx : k*ctx+ctx+1]."""
    if ctx < 1:
        raise ValueError(f"ctx must be at least 1, got {ctx}")
    ids = [t for e in examples for t in e.ids]
    mask = [m for e in examples for m in e.loss_mask]
    n = max(0, -(-(len(ids) - 1) // ctx))  # windows that hold at least one (input, target) pair
    total = n * ctx + 1
    stream = torch.full((total,), pad_id, dtype=torch.int64)
    target = torch.zeros(total, dtype=torch.bool)
    stream[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    target[: len(mask)] = torch.tensor(mask, dtype=torch.bool)  # padding is never a target

    index = torch.arange(n).unsqueeze(1) * ctx + torch.arange(ctx + 1)
    window, window_target = stream[index], target[index]
    labels = torch.where(window_target[:, 1:], window[:, 1:], torch.full_like(window[:, 1:], IGNORE))
    keep = window_target[:, 1:].any(dim=1)
    return Windows(input_ids=window[:, :-1][keep].contiguous(), labels=labels[keep].contiguous())


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


def load_windows(path: str | os.PathLike | list, tokenizer, ctx: int, batch: int) -> Windows:
    """Read, tokenize and window a data file (or a list of in-memory records); refuse data too small to train."""
    if isinstance(path, list):
        records, name = parse_records(path), "data"
    else:
        records, name = read_records(path), str(path)
    examples = tokenize(records, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    windows = make_windows(examples, ctx, pad_id if pad_id is not None else 0)
    if len(windows) == 0:
        raise DataError(
            f"{name}: no trainable tokens (text too short, or chat records whose assistant turns are empty)"
        )
    if len(windows) < batch:
        tokens = sum(len(e.ids) for e in examples)
        hint = f"lower batch to {len(windows)}"
        if (tokens - 1) // batch >= 1:
            hint += f" or ctx to about {(tokens - 1) // batch}"
        raise DataError(
            f"{name}: gives {len(windows)} window(s) of {ctx} tokens ({tokens} tokens), fewer than batch "
            f"{batch}; {hint}, or add more data"
        )
    return windows
