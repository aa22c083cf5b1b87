"""remat.models.load: the embedded GGUF, safetensors folders, presets, the tiny tokenizer and bad input."""

from __future__ import annotations

import json
import re
import time

import gguf
import numpy as np
import pytest
import torch
import transformers

from remat.models import load as models
from remat.models.load import ModelError, build_from_config, load_config, load_model


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    # Every test in this module reads the GGUF's header and tokenizer into one temporary cache, once.
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("remat-cache")
        mp.setenv("REMAT_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smol() -> models.LoadedModel:
    return load_model()  # first load: parses the GGUF's header and tokenizer into the cache


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cache_dir_follows_env(_cache):
    assert models.cache_dir() == _cache


def test_default_gguf_loads_smollm2(smol):
    assert smol.name == models.default_gguf_path().name
    assert smol.name.endswith(".gguf")
    m = smol.model
    assert isinstance(m, transformers.LlamaForCausalLM)
    assert m.config.num_hidden_layers == 30 and len(m.model.layers) == 30
    assert m.training and m.config.use_cache is False
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    assert m.config._attn_implementation == "sdpa"
    assert smol.max_ctx == m.config.max_position_embeddings == 8192
    tok = smol.tokenizer
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_gguf_weights_match_the_file(smol):
    # Independent check of the dequantization: gguf's own reader must give the very same numbers.
    reader = gguf.GGUFReader(models.default_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "token_embd.weight": smol.model.model.embed_tokens.weight,
        "blk.0.ffn_down.weight": smol.model.model.layers[0].mlp.down_proj.weight,
    }
    for name, param in pairs.items():
        t = tensors[name]
        rows = t.data[:512]  # enough rows to compare, without dequantizing the whole embedding
        expected = gguf.quants.dequantize(rows, t.tensor_type).astype(np.float32)
        assert torch.equal(param.detach()[:512], torch.from_numpy(expected)), name


def test_second_load_is_cached_fast_and_identical(smol, _cache):
    # The cache holds what is slow to parse (config, tensor table, tokenizer), never a float copy of the weights.
    entries = sorted(p.name.split(".", 1)[1] for p in (_cache / "gguf").iterdir())
    assert entries == ["config.json", "tensors.json", "tokenizer"], entries
    assert not list(_cache.rglob("*.safetensors"))
    config = next((_cache / "gguf").glob("*.config.json"))
    assert "quantization_config" not in json.loads(config.read_text())
    start = time.perf_counter()
    again = load_model()
    elapsed = time.perf_counter() - start
    assert elapsed < 15, f"cached load took {elapsed:.1f} s"  # gguf-py's reader parses the vocabulary: ~3 s idle
    assert _same_weights(smol.model, again.model)
    assert again.tokenizer.chat_template == smol.tokenizer.chat_template


def test_tied_embeddings_share_one_copy_of_the_blocks(smol):
    m = smol.model
    assert m.config.tie_word_embeddings
    assert m.lm_head.parametrizations.weight.original is m.model.embed_tokens.parametrizations.weight.original


def test_config_of_default_comes_without_weights(smol):
    config = load_config(None)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert not hasattr(config, "quantization_config")


def test_config_of_a_gguf_is_parsed_once(tmp_path, monkeypatch):
    # Parsing a GGUF for its config reads every field (seconds); the second plan of a file reads it back.
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    first = load_config(None)
    kept = [models._gguf_kept(models.default_gguf_path(), what).name for what in ("config.json", "tensors.json")]
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == kept

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_parse)
    again = load_config(None)
    assert {**again.to_dict(), "_name_or_path": ""} == {**first.to_dict(), "_name_or_path": ""}
    assert not hasattr(again, "quantization_config")


def test_gguf_file_by_path(smol):
    loaded = load_model(str(models.default_gguf_path()))
    assert loaded.name == smol.name
    assert _same_weights(loaded.model, smol.model)


def test_safetensors_folder_round_trip(tmp_path):
    src = load_model("tiny-llama", seed=3)
    folder = tmp_path / "my-model"
    src.model.save_pretrained(folder)
    src.tokenizer.save_pretrained(folder)
    loaded = load_model(str(folder))
    assert loaded.name == "my-model"
    assert isinstance(loaded.model, transformers.LlamaForCausalLM)
    assert _same_weights(src.model, loaded.model)
    assert loaded.model.training and loaded.model.config.use_cache is False
    assert loaded.tokenizer.chat_template == src.tokenizer.chat_template
    assert loaded.tokenizer("héllo")["input_ids"] == src.tokenizer("héllo")["input_ids"]
    # A path to the config.json inside the folder means the folder.
    by_config = load_model(str(folder / "config.json"))
    assert _same_weights(src.model, by_config.model)
    assert load_config(str(folder)).hidden_size == 64
    assert load_config(str(folder / "config.json")).hidden_size == 64


def test_a_saved_config_is_read_as_transformers_reads_it(tmp_path):
    """`save_pretrained` writes what JSON cannot hold as transformers' own tags (Mamba-2's `time_step_limit`
    (0.0, inf) as `[0.0, {"__float__": "Infinity"}]`); the folder's config is read by transformers' reader."""
    config = transformers.Mamba2Config(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, vocab_size=259)
    config.save_pretrained(tmp_path)
    assert '"__float__"' in (tmp_path / "config.json").read_text()
    for spec in (tmp_path, tmp_path / "config.json"):
        read = load_config(str(spec))
        assert list(read.time_step_limit) == [0.0, float("inf")]
        mine = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
        assert {k: v for k, v in read.to_dict().items() if k != "_name_or_path"} == mine


@pytest.mark.parametrize(("config", "why"), [({"model_type": "nope"}, "knows no model_type 'nope'"),
                                             ({"model_type": "llama", "hidden_size": "x"}, "hidden_size")])
def test_a_bad_config_is_refused_in_one_line(tmp_path, config, why):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=why) as refused:
        load_config(str(tmp_path))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_tiny_presets_are_deterministic_per_seed(name):
    a, b, c = load_model(name, seed=1), load_model(name, seed=1), load_model(name, seed=2)
    assert _same_weights(a.model, b.model)
    assert not _same_weights(a.model, c.model)
    assert a.name == name and a.max_ctx == 2048
    assert a.model.config.vocab_size == len(a.tokenizer)
    assert a.model.training and a.model.config.use_cache is False
    assert a.model.dtype == torch.float32
    # Building leaves the caller's RNG alone.
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_from_config(load_config(name), seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_qwen35_is_the_hybrid():
    m = load_model("tiny-qwen35").model
    assert type(m).__name__ == "Qwen3_5ForCausalLM"
    assert m.config.model_type == "qwen3_5_text"
    assert m.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert m.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_tiny_presets_are_tiny(name):
    """Tiny presets stay small enough for a fast train step (time itself is the bench's business)."""
    m = load_model(name).model
    assert sum(p.numel() for p in m.parameters()) < 500_000
    x = torch.randint(0, m.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.parameters())


def test_num_layers_override():
    llama = load_model("tiny-llama", num_layers=6).model
    assert llama.config.num_hidden_layers == 6 and len(llama.model.layers) == 6
    qwen = load_config("tiny-qwen35", num_layers=8)
    assert qwen.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert load_config("qwen3.5-0.8b", num_layers=5).layer_types[-2:] == ["full_attention", "linear_attention"]
    with pytest.raises(ModelError, match="num_layers"):
        load_model("tiny-llama", num_layers=0)


@pytest.mark.parametrize(
    "name, model_type, layers, hidden, vocab",
    [
        ("smollm2-135m", "llama", 30, 576, 49152),
        ("qwen2.5-coder-1.5b", "qwen2", 28, 1536, 151936),
        ("qwen3.5-0.8b", "qwen3_5_text", 24, 1024, 248320),
    ],
)
def test_plan_only_presets(name, model_type, layers, hidden, vocab):
    config = load_config(name)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        model_type, layers, hidden, vocab)
    assert config.tie_word_embeddings
    with pytest.raises(ModelError, match=f"'{name}' is a plan-only preset: use `remat plan`"):
        load_model(name)


def test_qwen35_plan_config_is_three_linear_to_one_full():
    config = load_config("qwen3.5-0.8b")
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 6
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 256)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25


def test_tiny_tokenizer_round_trips_and_chats():
    tok = models.tiny_tokenizer()
    assert len(tok) == 259
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    for text in ["", "plain ascii", "  leading and trailing spaces  ", "tabs\tand\nnew\r\nlines",
                 "héllo wörld, 日本語, emoji 🤖🎉", "\x00\x01 control bytes \x7f", "<|im_start|>in text"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok("é")["input_ids"] == [0xC3, 0xA9]  # one token per UTF-8 byte
    assert tok.encode("<|im_end|>") == [tok.eos_token_id] == [258]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert models.tiny_tokenizer()("same?")["input_ids"] == tok("same?")["input_ids"]


def test_bad_inputs_give_one_line_model_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + b"\x00" * 16)
    (tmp_path / "tiny.json").write_text(json.dumps(load_config("tiny-llama").to_dict()))
    assert load_config(str(tmp_path / "tiny.json")).hidden_size == 64
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    load_config("tiny-llama").save_pretrained(no_weights)
    cases = {
        "foo": "unknown model 'foo': not a file, folder or preset (presets: tiny-llama, tiny-qwen35",
        str(tmp_path / "missing.gguf"): "does not exist",
        str(tmp_path / "missing" / "model"): "does not exist",
        str(tmp_path / "empty"): "has no config.json",
        str(tmp_path / "notes.txt"): "neither a GGUF file nor a config.json",
        str(tmp_path / "other.json"): "not a model config.json",
        str(tmp_path / "broken.json"): "cannot read config",
        str(tmp_path / "fake.gguf"): "GGUF",
        str(no_weights): "no *.safetensors weights",
        str(tmp_path / "tiny.json"): "is a config without weights",
    }
    for spec, message in cases.items():
        with pytest.raises(ModelError, match=re.escape(message)) as info:
            load_model(spec)
        assert "\n" not in str(info.value), spec
    for spec in ["foo", str(tmp_path / "empty"), str(tmp_path / "notes.txt"), str(tmp_path / "fake.gguf")]:
        with pytest.raises(ModelError) as info:
            load_config(spec)
        assert "\n" not in str(info.value), spec
    with pytest.raises(ModelError, match="num_layers only applies"):
        load_model(str(no_weights), num_layers=3)


def test_a_float32_gguf_loads_without_a_second_copy_of_its_weights(tmp_path):
    """The weights read through the file's mapping count in the process's resident set until the reader is closed:
    a float32 GGUF held them twice at load (SmolLM2: peak 1,580 MiB, 902 once loaded). The load's peak over what
    the process holds once loaded (the reader's vocabulary, freed) must stay below the file's size."""
    import subprocess
    import sys

    from remat.bench.llama_cpp import float32_gguf
    from remat.models.load import default_gguf_path

    path = float32_gguf(default_gguf_path(), tmp_path / "smollm2.f32.gguf")
    child = ("import sys\nfrom remat.models.load import load_model\nmodel = load_model(sys.argv[1])\n"
             "print(*(l.split()[1] for l in open('/proc/self/status') if l.startswith(('VmHWM', 'VmRSS'))))")
    r = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, check=True)
    peak, held = (int(kb) << 10 for kb in r.stdout.split())
    assert peak - held < path.stat().st_size, (peak >> 20, held >> 20, path.stat().st_size >> 20)
