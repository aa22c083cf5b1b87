"""`--weights <mix>`: a model planned at the types llama.cpp's quantizer gives each tensor (remat.models.mixes).

The independent check is a file llama.cpp made: the shipped SmolLM2 GGUF is its Q4_1 mix (the tied embedding
falls back from Q6_K to Q8_0, its rows of 576 not filling K blocks). The other cases spell out llama.cpp's
rules (src/llama-quant.cpp) tensor by tensor."""

from __future__ import annotations

import gguf
import pytest

from planning import planner_of
from remat.base.settings import TrainSettings
from remat.core.capture import EagerStridesFakeMode
from remat.models import load as models
from remat.models import mixes, planned, quant
from remat.training.step import StepShape

Q = gguf.GGMLQuantizationType


def fake(spec: str | None):
    """The model's shapes, nothing allocated."""
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        return models.build_from_config(models.load_config(spec))


def types(spec: str | None, weights: str | None = None) -> dict[str, int]:
    return planned.stored_types(spec, weights, fake(spec))


def test_the_shipped_gguf_is_llama_cpps_q4_1_mix():
    as_filed = types(None)  # the file's own header
    assert as_filed == types(None, "q4_1")
    assert as_filed["model.embed_tokens.weight"] == Q.Q8_0 and len(as_filed) == 211
    assert set(as_filed.values()) == {Q.Q4_1, Q.Q8_0}


def test_q4_k_m_of_qwen2_5_coder_1_5b():
    t = types("qwen2.5-coder-1.5b", "q4_k_m")
    layer = "model.layers.{}.{}.weight".format
    assert t["model.embed_tokens.weight"] == Q.Q6_K  # tied: the output's type, Q6_K
    # attn_v and ffn_down: Q6_K where use_more_bits (the first 3 of 28, the last 4, every third between), else Q4_K
    more = [i for i in range(28) if mixes.more_bits(i, 28)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    for i in range(28):
        want = Q.Q6_K if i in more else Q.Q4_K
        assert (t[layer(i, "self_attn.v_proj")], t[layer(i, "mlp.down_proj")]) == (want, want), i
        assert {t[layer(i, p)] for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj",
                                         "mlp.gate_proj", "mlp.up_proj")} == {Q.Q4_K}
    assert not any("norm" in name or name.endswith("bias") for name in t)  # 1-D tensors stay float32


def test_k_types_fall_back_on_rows_they_cannot_fill():
    """SmolLM2's rows of 576 (not a multiple of 256): Q4_K -> Q5_0, Q6_K -> Q8_0; ffn_down's rows of 1536 fit."""
    t = types("smollm2-135m", "q4_k_m")
    assert t["model.embed_tokens.weight"] == Q.Q8_0
    assert t["model.layers.0.self_attn.q_proj.weight"] == Q.Q5_0
    assert t["model.layers.0.self_attn.v_proj.weight"] == Q.Q8_0  # Q6_K (more bits in layer 0), fallen back
    assert t["model.layers.3.self_attn.v_proj.weight"] == Q.Q5_0
    assert t["model.layers.0.mlp.down_proj.weight"] == Q.Q6_K and t["model.layers.3.mlp.down_proj.weight"] == Q.Q4_K


@pytest.mark.parametrize("mix, qtype", [("f16", Q.F16), ("bf16", Q.BF16), ("q8_0", Q.Q8_0)])
def test_plain_mixes_and_their_frozen_bytes(mix, qtype):
    """Every 2-D weight at the mix's type (Q8_0's tied head too: Q8_0 is kept), the 1-D ones in float32."""
    t = types("tiny-qwen35", mix)
    assert set(t.values()) == {qtype}
    shapes = fake("tiny-qwen35")
    weights = dict(shapes.named_parameters())
    assert set(t) == {n for n, p in weights.items() if p.dim() >= 2 and "conv1d" not in n}
    expected = sum(quant.stored_bytes(q, tuple(weights[n].shape)) for n, q in t.items())
    expected += sum(p.nbytes for n, p in weights.items() if n not in t) + sum(b.nbytes for b in shapes.buffers())
    s = TrainSettings(model="tiny-qwen35", weights=mix)  # LoRA: the base is frozen, as stored
    plan = planner_of(s).plans(StepShape.of(s), ("off",))["off"]
    assert plan.frozen == expected


def test_weights_is_for_plans_only():
    with pytest.raises(models.ModelError):
        planned.stored_types("no-such-model", None, models.build_from_config(models.load_config("tiny-llama")))
    with pytest.raises(ValueError, match="weights"):
        TrainSettings(weights="q3_k_m")  # a mix with types remat does not keep in blocks
    assert TrainSettings(weights="Q4_K_M").weights == "q4_k_m"
