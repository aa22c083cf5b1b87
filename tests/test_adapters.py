"""LoRA adapters: PEFT wrapping, the saved folder, the llama.cpp GGUF adapter, merging into the base."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import gguf
import numpy as np
import peft
import pytest
import torch
import transformers
from peft.tuners.lora import ParamWrapper
from transformers import AttentionInterface
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    BloomTensorProcessor,
    LlamaTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
)
from transformers.pytorch_utils import Conv1D

import conformance
from remat.models import stored
from remat.models.adapters import AdapterError, LoraSettings, apply_lora, merge_into_base, save_adapter
from remat.models.load import build_from_config, default_gguf_path, load_model
from remat.models.lora_gguf import CONVERTERS, write_gguf_adapter

SMOL = "smollm2"  # marks the parameter that means the real SmolLM2 GGUF


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    # The SmolLM2 GGUF -> safetensors conversion (~25 s) happens once for the module, in a fresh cache.
    old = os.environ.get("REMAT_CACHE_DIR")
    os.environ["REMAT_CACHE_DIR"] = str(tmp_path_factory.mktemp("remat-cache"))
    yield
    if old is None:
        del os.environ["REMAT_CACHE_DIR"]
    else:
        os.environ["REMAT_CACHE_DIR"] = old


def spec_of(name: str) -> str | None:
    return None if name == SMOL else name


def perturbed(name: str, settings: LoraSettings | None = None, seed: int = 0) -> peft.PeftModel:
    """A LoRA model whose B is not zero (at init it is, and every comparison would pass trivially)."""
    model = apply_lora(load_model(spec_of(name), seed=seed).model, settings or LoraSettings(), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def decoder_linears(model: torch.nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def adapted(model: peft.PeftModel) -> set[str]:
    return {n for n, m in model.get_base_model().named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


# ---------------------------------------------------------------------------------------------------------
# apply_lora


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_apply_lora_trains_only_the_adapter(name):
    base = load_model(name).model
    linears = decoder_linears(base)
    model = apply_lora(base, LoraSettings())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    # Every linear layer of the decoder, and not the head.
    assert adapted(model) == linears
    assert "lm_head" not in adapted(model)
    if name == "tiny-llama":
        kinds = {n.rsplit(".", 1)[1] for n in linears}
        assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_apply_lora_targets():
    model = apply_lora(load_model("tiny-llama").model, LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj"]))
    assert adapted(model) == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    a = model.get_base_model().model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert a.shape == (4, 64)


@pytest.mark.parametrize("settings, message", [
    (LoraSettings(r=0), "rank r must be a positive integer"),
    (LoraSettings(r=2.5), "rank r must be a positive integer"),
    (LoraSettings(alpha=0), "alpha must be positive"),
    (LoraSettings(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (LoraSettings(dropout=-0.1), r"dropout must be in \[0, 1\)"),
    (LoraSettings(targets=[]), "targets is empty"),
    (LoraSettings(targets=["q_proj", "qproj", "embed_tokens"]), "match no linear layer: qproj, embed_tokens$"),
])
def test_apply_lora_bad_settings(settings, message):
    base = load_model("tiny-llama").model
    with pytest.raises(AdapterError, match=message):
        apply_lora(base, settings)
    assert all(p.requires_grad for p in base.parameters())  # the model is left as it was
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in base.modules())


def test_apply_lora_twice_is_refused():
    model = apply_lora(load_model("tiny-llama").model, LoraSettings())
    with pytest.raises(AdapterError, match="already has an adapter"):
        apply_lora(model, LoraSettings())


def test_apply_lora_init_is_deterministic_per_seed():
    def lora_a(seed: int) -> list[torch.Tensor]:
        model = apply_lora(load_model("tiny-llama").model, LoraSettings(), seed=seed)
        return [p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n]

    state = torch.random.get_rng_state()
    first, again, other = lora_a(0), lora_a(0), lora_a(1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not any(torch.equal(x, y) for x, y in zip(first, other))


# ---------------------------------------------------------------------------------------------------------
# save_adapter: the PEFT files


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35"])
def test_saved_adapter_reloads_with_the_same_logits(name, tmp_path):
    model = perturbed(name, seed=5)
    out = tmp_path / "adapter"
    files = save_adapter(model, out, base_name=name)
    assert {Path(f).name for f in files} >= {"adapter_config.json", "adapter_model.safetensors", "adapter.gguf"}
    assert all(Path(f).is_file() and Path(f).parent == out for f in files)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == name

    lm = load_model(name, seed=5)
    reloaded = peft.PeftModel.from_pretrained(lm.model, out).eval()
    want = logits(model, len(lm.tokenizer))
    got = logits(reloaded, len(lm.tokenizer))
    assert (got - want).abs().max() <= 1e-5
    with reloaded.disable_adapter():  # the adapter matters, so the comparison above is not trivial
        assert (logits(reloaded, len(lm.tokenizer)) - want).abs().max() > 1e-3


def test_save_refuses_a_non_empty_folder(tmp_path):
    model = perturbed("tiny-llama")
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    before = {p: p.read_bytes() if p.is_file() else None for p in out.rglob("*")}
    with pytest.raises(AdapterError, match="not an empty folder"):
        save_adapter(model, out, base_name="tiny-llama")
    assert {p: p.read_bytes() if p.is_file() else None for p in out.rglob("*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left behind


def test_save_into_an_empty_folder_or_a_new_path(tmp_path):
    model = perturbed("tiny-llama")
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        files = save_adapter(model, out, base_name="tiny-llama")
        assert sorted(str(p) for p in out.iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]
    with pytest.raises(AdapterError, match="not an empty folder"):
        save_adapter(model, tmp_path / "empty" / "adapter.gguf", base_name="tiny-llama")


def test_unsupported_architecture_skips_only_the_gguf(tmp_path):
    model = apply_lora(build_from_config(conformance.tiny_config("gptj")), LoraSettings(r=2))
    with pytest.warns(UserWarning, match="adapter.gguf not written: GGUF adapter export is not supported for "
                                         "gptj: llama.cpp's converter has no GPTJForCausalLM"):
        files = save_adapter(model, tmp_path / "a", base_name="some/folder")
    assert sorted(Path(f).name for f in files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_layers_llama_cpp_reshapes_are_left_out_with_a_warning(tmp_path):
    model = apply_lora(build_from_config(conformance.tiny_config("deepseek_v2")), LoraSettings(r=2))
    with pytest.warns(UserWarning, match=r"adapter.gguf leaves out kv_b_proj \(2 layers\): llama.cpp splits it per "
                                         r"head into k_b \(transposed\) and v_b"):
        files = save_adapter(model, tmp_path / "a", base_name="x")
    assert "adapter.gguf" in {Path(f).name for f in files}


def test_falcon_layout_the_converter_cannot_regroup_gets_no_gguf(tmp_path):
    # Multi-query Falcon with num_kv_heads == num_heads: llama.cpp's converter fails on the base weight itself.
    model = apply_lora(build_from_config(conformance.tiny_config("falcon")), LoraSettings(r=2))
    with pytest.warns(UserWarning, match="adapter.gguf not written: llama.cpp's converter cannot regroup"):
        files = save_adapter(model, tmp_path / "a", base_name="x")
    assert "adapter.gguf" not in {Path(f).name for f in files}


# ---------------------------------------------------------------------------------------------------------
# the GGUF adapter


def read_adapter(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
    return fields, {t.name: np.array(t.data) for t in reader.tensors}


def unpermute_llama(b: np.ndarray, gguf_name: str, config) -> np.ndarray:
    """Undo the Q/K row permutation with transformers' own GGUF loader code (the inverse of llama.cpp's)."""
    processor = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                             "num_key_value_heads": config.num_key_value_heads})
    return processor.process(b, gguf_name).weights


def untile_v_heads(t: np.ndarray, dim: int, n_k: int, v_per_k: int, head_dim: int) -> np.ndarray:
    """Tiled [K0v0, K1v0, K0v1, K1v1] back to grouped [K0v0, K0v1, K1v0, K1v1] along `dim`."""
    shape = t.shape
    t = t.reshape(*shape[:dim], v_per_k, n_k, head_dim, *shape[dim + 1:])
    return t.swapaxes(dim, dim + 1).reshape(shape)


def to_hf_layout(arch: str, hf_name: str, gguf_name: str, a: np.ndarray, b: np.ndarray, config):
    if arch == "llama":
        return a, unpermute_llama(b, gguf_name, config)
    if arch in ("qwen35", "qwen35moe") and ".linear_attn." in hf_name:
        n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
        v_per_k, dk, dv = n_v // n_k, config.linear_key_head_dim, config.linear_value_head_dim
        if hf_name.endswith("in_proj_qkv"):
            qk = 2 * n_k * dk
            b = np.concatenate([b[:qk], untile_v_heads(b[qk:], 0, n_k, v_per_k, dv)])
        elif hf_name.endswith("in_proj_z"):
            b = untile_v_heads(b, 0, n_k, v_per_k, dv)
        elif hf_name.endswith(("in_proj_a", "in_proj_b")):
            b = untile_v_heads(b, 0, n_k, v_per_k, 1)
        elif hf_name.endswith("out_proj"):
            a = untile_v_heads(a, 1, n_k, v_per_k, dv)
    return a, b


def test_v_head_reorder_matches_the_documented_order():
    # llama.cpp's converter: grouped [K0v0, K0v1, K1v0, K1v1] -> tiled [K0v0, K1v0, K0v1, K1v1].
    from remat.models.lora_gguf import reorder_v_heads

    grouped = np.arange(4).reshape(4, 1)
    assert reorder_v_heads(grouped, 0, 2, 2, 1).ravel().tolist() == [0, 2, 1, 3]
    x = np.random.default_rng(0).standard_normal((3, 2 * 3 * 4))
    assert np.array_equal(untile_v_heads(reorder_v_heads(x, 1, 2, 3, 4), 1, 2, 3, 4), x)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen35", SMOL])
def test_gguf_adapter_applied_by_hand_equals_the_peft_merge(name, tmp_path):
    settings = LoraSettings(r=4, alpha=12)
    model = perturbed(name, settings)
    config = model.get_base_model().config
    arch = {"llama": "llama", "qwen3_5_text": "qwen35"}[config.model_type]
    base_gguf = default_gguf_path() if name == SMOL else None
    save_adapter(model, tmp_path / "a", base_name=name if name != SMOL else "default", base_gguf=base_gguf)
    fields, tensors = read_adapter(tmp_path / "a" / "adapter.gguf")

    assert fields == {"general.architecture": arch, "general.type": "adapter", "adapter.type": "lora",
                      "adapter.lora.alpha": 12.0}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35 if arch == "qwen35" else gguf.MODEL_ARCH.LLAMA,
                                        config.num_hidden_layers)
    lora_layers = adapted(model)
    targets = {name_map.get_name(n + ".weight", try_suffixes=(".weight",)): n for n in lora_layers}
    assert set(tensors) == {t + s for t in targets for s in (".lora_a", ".lora_b")}
    if base_gguf is not None:
        base = {t.name: t for t in gguf.GGUFReader(base_gguf).tensors}
        assert set(targets) <= set(base)
        for t in targets:  # llama.cpp's loader checks: a.ne[0] == W.ne[0], b.ne[1] == W.ne[1]
            assert tensors[t + ".lora_a"].shape[1] == base[t].shape[0]
            assert tensors[t + ".lora_b"].shape[0] == base[t].shape[1]

    weights = {n: m.weight.detach().clone() for n, m in model.get_base_model().named_modules() if n in lora_layers}
    # PEFT merges into `weight.data`: a GGUF base's weights are made from its blocks on each read (quant), so it
    # merges into float32 copies of them, as `merge_into_base` does
    merged = dict(stored.to_float(model).merge_and_unload().named_modules())
    scale = 12.0 / 4
    for gguf_name, hf_name in targets.items():
        a, b = tensors[gguf_name + ".lora_a"], tensors[gguf_name + ".lora_b"]
        w = weights[hf_name]
        assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
        a, b = to_hf_layout(arch, hf_name, gguf_name, a, b, config)
        # The same float32 ops as PEFT's merge (W + (B @ A) * scale), so the result is bit-identical.
        by_hand = w + (torch.from_numpy(b) @ torch.from_numpy(a)) * scale
        assert torch.equal(by_hand, merged[hf_name].weight), hf_name

    if base_gguf is not None:
        # Apply the adapter to the base GGUF tensor itself, in GGUF row order, as llama.cpp does.
        for gguf_name in ("blk.5.attn_q.weight", "blk.5.attn_k.weight"):
            t = base[gguf_name]
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in], Q/K rows permuted
            w = w + scale * (tensors[gguf_name + ".lora_b"] @ tensors[gguf_name + ".lora_a"])
            # Back to HF order, as transformers does when it loads a GGUF. numpy's and torch's matmuls
            # round differently in the last bit, so this is compared to 1e-6, not exactly.
            got = torch.from_numpy(unpermute_llama(w, gguf_name, config))
            assert (got - merged[targets[gguf_name]].weight).abs().max() <= 1e-6


def small_base_gguf(path: Path, arch: str, shapes: dict[str, tuple[int, int]]) -> Path:
    """A stand-in base GGUF: just the architecture and zero tensors of these [out, in] shapes."""
    writer = gguf.GGUFWriter(path, arch)
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_adapter_is_checked_against_the_base_gguf(tmp_path):
    model = perturbed("tiny-llama", LoraSettings(targets=["q_proj"]))
    right = {f"blk.{i}.attn_q.weight": (64, 64) for i in range(2)}
    ok = small_base_gguf(tmp_path / "ok.gguf", "llama", right)
    assert "adapter.gguf" in {Path(f).name for f in save_adapter(model, tmp_path / "a", base_name="x", base_gguf=ok)}

    cases = [
        ("llama", {"blk.0.attn_q.weight": (64, 64)}, "base GGUF has no tensor 'blk.1.attn_q.weight'"),
        ("llama", {**right, "blk.1.attn_q.weight": (32, 64)},
         "'model.layers.1.self_attn.q_proj' is 64x64, but 'blk.1.attn_q.weight' in the base GGUF is 32x64"),
        ("qwen3", right, "is a qwen3 model, the adapter is for llama"),
    ]
    for i, (arch, shapes, message) in enumerate(cases):
        base = small_base_gguf(tmp_path / f"bad{i}.gguf", arch, shapes)
        with pytest.raises(AdapterError, match=message):
            save_adapter(model, tmp_path / "b", base_name="x", base_gguf=base)
        assert not (tmp_path / "b").exists()


# ---------------------------------------------------------------------------------------------------------
# the GGUF adapter of every family llama.cpp converts, read back with transformers' own GGUF loader code

FALCON_NEW = {"new_decoder_architecture": True, "num_kv_heads": 2}  # a layout llama.cpp's converter regroups
# Adapted layers each family leaves out of adapter.gguf (kind -> why, abbreviated); every other family, none.
MLA = {"kv_b_proj": "splits it per head"}
LEFT_OUT = {
    "deepseek_v2": MLA, "deepseek_v3": MLA, "sarvam_mla": MLA, "youtu": MLA, "glm4_moe_lite": MLA,
    "glm_moe_dsa": MLA, "kimi_linear": {**MLA, "f_a_proj": "no tensor", "f_b_proj": "no tensor"},
    "qwen3_next": {"in_proj_qkvz": "splits it into attn_qkv and attn_gate"},
    "granitemoehybrid": {"shared_mlp.input_linear": "splits it into the gate and up"},
}
NO_GGUF = {
    "nemotron_h": "have no tensor",  # transformers names its modules model.*, llama.cpp the checkpoint's backbone.*
    "falcon_h1": "folds its multipliers into the weights",
}
PERMUTED = {"llama", "arcee", "smollm3", "mistral3", "granite", "granitemoe", "granitehybrid", "olmo"}


def gguf_cases() -> list:
    names = sorted(f.name for f in conformance.families() if f.skip is None and f.cls in CONVERTERS)
    return [pytest.param(n, {}, id=n) for n in names if n != "falcon"] + [
        pytest.param("falcon", FALCON_NEW, id="falcon-new-arch")]


def gguf_to_hf(arch: str, gguf_name: str, delta: np.ndarray, config) -> np.ndarray:
    """A GGUF weight back in the HF parameter's layout, by transformers' GGUF loader (its TensorProcessors
    undo llama.cpp's converter; LlamaModel.permute and the Bloom/GPT-NeoX QKV reorder serve every family
    whose converter applies them)."""
    if arch in PERMUTED:
        processor: TensorProcessor = LlamaTensorProcessor(config={
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads})
    elif arch in ("bloom", "gptneox"):
        processor = BloomTensorProcessor(config={"n_head": config.num_attention_heads,
                                                 "hidden_size": config.hidden_size})
    else:
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config={})
    return processor.process(delta, gguf_name + ".weight").weights


def falcon_gguf_rows(attn: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
    """A fused query_key_value weight in llama.cpp's [all q; all k; all v] rows, split by Falcon's own forward:
    its `query_key_value` returns W's columns as positions, and the attention function it calls receives
    the query, key and value heads it split them into."""
    split: list[torch.Tensor] = []

    def capture(module, query, key, value, *args, **kwargs):  # [1, heads, positions, head_dim] each
        split.extend((query, key, value))
        return query.new_zeros(1, query.shape[2], query.shape[1] * query.shape[3]), None

    AttentionInterface.register("remat_capture", capture)
    positions = w.shape[1]
    rope = (torch.ones(1, positions, attn.head_dim), torch.zeros(1, positions, attn.head_dim))  # the identity
    hook = attn.query_key_value.register_forward_hook(lambda module, args, out: w.T[None].to(out.dtype))
    implementation, attn.config._attn_implementation = attn.config._attn_implementation, "remat_capture"
    try:
        with torch.no_grad():
            attn(torch.zeros(1, positions, attn.hidden_size), None, position_embeddings=rope)
    finally:
        attn.config._attn_implementation = implementation
        hook.remove()
    q, k, v = split
    per_kv = k.shape[1] // attn.num_kv_heads  # transformers < 5.25 broadcast each K/V head to its query group
    return torch.cat([t[0, ::step].transpose(0, 1).reshape(positions, -1).T
                      for t, step in ((q, 1), (k, per_kv), (v, per_kv))])


def lora_and_deltas(name: str, extra: dict) -> tuple[peft.PeftModel, dict[str, torch.Tensor]]:
    try:
        base = conformance.build(name, **extra)
    except Exception as e:  # noqa: BLE001 - the family's tiny config is not ours to fix here
        pytest.skip(f"the tiny {name} does not build: {type(e).__name__}")
    model = apply_lora(base, LoraSettings(r=2, alpha=3))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g))
    deltas = {n: m.get_delta_weight("default").detach() for n, m in model.get_base_model().named_modules()
              if isinstance(m, peft.tuners.lora.LoraLayer) and not isinstance(m, ParamWrapper)}  # HF layout
    return model, deltas


@pytest.mark.parametrize("name, extra", gguf_cases())
def test_gguf_adapter_lands_on_the_modules_peft_trained(name, extra, tmp_path):
    model, deltas = lora_and_deltas(name, extra)
    arch_id = CONVERTERS[type(model.get_base_model()).__name__][0]
    arch = gguf.MODEL_ARCH_NAMES[arch_id]
    if name in NO_GGUF:
        with pytest.raises(AdapterError, match=NO_GGUF[name]):
            write_gguf_adapter(model, tmp_path / "a.gguf")
        return
    notes = write_gguf_adapter(model, tmp_path / "a.gguf")
    params = {n for n, m in model.get_base_model().named_modules() if isinstance(m, ParamWrapper)}
    # PEFT's LoRA on fused MoE expert (and router) parameters is left out, with its own note.
    assert any("adapts the parameter itself" in n for n in notes) == bool(params), notes
    notes = [n for n in notes if "adapts the parameter itself" not in n]
    assert {n.split(" (")[0] for n in notes} == set(LEFT_OUT.get(name, {})), notes
    assert all(why in n for n in notes for kind, why in LEFT_OUT[name].items() if n.startswith(kind + " ("))
    fields, tensors = read_adapter(tmp_path / "a.gguf")
    assert fields["general.architecture"] == arch and fields["adapter.lora.alpha"] == 3.0

    plain = model.unload()  # the base model with its HF names, for transformers' GGUF -> HF name map
    config = plain.config
    to_hf = get_gguf_hf_weights_map(plain, TensorProcessor(), model_type=arch, num_layers=config.num_hidden_layers)
    known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch_id]
             for i in range(config.num_hidden_layers)}
    written = {t.rsplit(".", 2)[0] for t in tensors}  # blk.0.attn_q of blk.0.attn_q.weight.lora_a
    assert written <= known, written - known  # names llama.cpp's loader looks up for this architecture
    landed = {to_hf[t + ".weight"].removesuffix(".weight"): t for t in written}
    left = {n for n in deltas if any(n.endswith(kind) for kind in LEFT_OUT.get(name, {}))}
    assert set(landed) == set(deltas) - left  # every trained module, each once, on its own tensor
    modules = dict(plain.named_modules())
    for hf_name, t in landed.items():
        a, b = tensors[t + ".weight.lora_a"], tensors[t + ".weight.lora_b"]
        weight = modules[hf_name].weight
        out, inp = weight.shape[::-1] if isinstance(modules[hf_name], Conv1D) else weight.shape
        # llama.cpp's loader: a.ne[0] == W.ne[0] (in), b.ne[1] == W.ne[1] (out), a.ne[1] == b.ne[0] (rank)
        assert (a.shape[1], b.shape[0], a.shape[0]) == (inp, out, b.shape[1]), hf_name
        got, want = gguf_and_peft_delta(arch, t, hf_name, a, b, modules, deltas[hf_name], config)
        assert got.numel() == want.numel(), hf_name  # (a 1-row weight may come back as [1, 1, in])
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6, msg=hf_name)


def gguf_and_peft_delta(arch: str, gguf_name: str, hf_name: str, a: np.ndarray, b: np.ndarray, modules: dict,
                        peft_delta: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's delta as llama.cpp applies it (alpha / rank · B·A) and PEFT's, in one layout."""
    delta = 1.5 * (torch.from_numpy(b) @ torch.from_numpy(a))
    if arch == "falcon" and hf_name.endswith("query_key_value"):  # transformers' GGUF loader has no reverse
        return delta, falcon_gguf_rows(modules[hf_name.rsplit(".", 1)[0]], peft_delta)
    if arch.startswith("qwen35"):  # nor here: the V-head reorder, undone by untile_v_heads
        a, b = to_hf_layout(arch, hf_name, gguf_name, a, b, config)
        return 1.5 * (torch.from_numpy(b) @ torch.from_numpy(a)), peft_delta
    return torch.from_numpy(np.ascontiguousarray(gguf_to_hf(arch, gguf_name, delta.numpy(), config))), peft_delta


# ---------------------------------------------------------------------------------------------------------
# merge_into_base


def test_merge_into_base_gives_the_adapted_logits(tmp_path):
    model = perturbed("tiny-llama", seed=2)
    save_adapter(model, tmp_path / "a", base_name="tiny-llama")
    # No base given: the one recorded in the adapter.
    files = merge_into_base(None, tmp_path / "a", tmp_path / "merged", seed=2)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {Path(f).name for f in files}
    assert all(Path(f).is_file() for f in files)

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged", local_files_only=True)
    vocab = len(tokenizer)
    want = logits(model, vocab)
    assert (logits(merged, vocab) - want).abs().max() <= 1e-5
    # The folder holds exactly PEFT's merged weights.
    in_memory = model.merge_and_unload().state_dict()
    saved = merged.state_dict()
    assert saved.keys() == in_memory.keys()
    assert all(torch.equal(saved[k], in_memory[k]) for k in saved)


def test_merge_errors(tmp_path):
    model = perturbed("tiny-llama")
    save_adapter(model, tmp_path / "a", base_name="tiny-llama")
    with pytest.raises(AdapterError, match="not an adapter folder"):
        merge_into_base(None, tmp_path, tmp_path / "m")
    with pytest.raises(AdapterError, match="does not fit the base model 'tiny-qwen35'"):
        merge_into_base("tiny-qwen35", tmp_path / "a", tmp_path / "m")
    with pytest.raises(AdapterError, match="does not fit the base model 'tiny-llama'"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns about the adapter weights it cannot place
        merge_into_base(None, tmp_path / "a", tmp_path / "m", num_layers=1)
    with pytest.raises(AdapterError, match="cannot load the base model"):
        merge_into_base("no-such-model", tmp_path / "a", tmp_path / "m")
    with pytest.raises(AdapterError, match="not an empty folder"):
        merge_into_base(None, tmp_path / "a", tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
