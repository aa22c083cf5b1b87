"""The stamped step (`remat.stamp`: five layers traced, the middle one copied) is the whole trace, node for node,
on every family of the conformance matrix whose layers are alike; the others are traced whole."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import conformance as C
from remat import models, stamp
from remat.capture import EagerStridesFakeMode, capture
from remat.graph import TrainGraph, tensors_in
from remat.hf import UnsupportedModel
from remat.plan import plan

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 7  # the fewest a stamp copies a layer for (five traced, two copies)

# Families traced whole, with why (what `stamp` says): the test asserts they still are, so a family that starts to
# stamp shows up. Most alternate layer kinds (sliding and full attention, MoE and dense MLP, attention and
# recurrent mixers): stamping a repeating group of layers, not one, is what would take them in.
TRACED_WHOLE: dict[str, str] = {
    "afmoe": "self_attn is_local_attention, sliding_window",
    "axk1": "mlp: AXK1MoE / mlp: AXK1MLP",
    "axk2": "mlp: AXK2MoE / mlp: AXK2MLP",
    "bailing_hybrid": "the layer block_type",
    "bamba": "the layer block_type",
    "beam": "the layer attn_residual_add_idx, mlp_residual_add_idx",
    "cohere2": "self_attn sliding_window",
    "cohere2_moe": "self_attn sliding_window",
    "cwm": "self_attn layer_type, sliding_window",
    "deepseek_v32": "mlp: DeepseekV32MoE / mlp: DeepseekV32MLP",
    "diffllama": "self_attn lambda_init",
    "ernie4_5_moe": "mlp: Ernie4_5_MoeSparseMoeBlock / mlp: Ernie4_5_MoeMLP",
    "exaone4": "self_attn is_sliding",
    "exaone_moe": "self_attn is_sliding",
    "falcon": "layers 1 and 2 differ at _tensor_constant2 / _tensor_constant4",
    "flint": "self_attn sliding_window",
    "gemma2": "self_attn layer_type, sliding_window",
    "gemma3_text": "self_attn is_sliding, layer_type, sliding_window",
    "glm4_moe_lite": "mlp: Glm4MoeLiteMoE / mlp: Glm4MoeLiteMLP",
    "gpt_neo": "attn attention_type",
    "gpt_neox_japanese": "attention dense_bias, use_bias",
    "gpt_oss": "self_attn layer_type, sliding_window",
    "granite_swa": "self_attn layer_type, sliding_window",
    "granitemoe_swa": "self_attn layer_type, sliding_window",
    "hrm_text": "2 layers: too few to copy one",
    "hy_v3": "mlp: HYV3MoE / mlp: HYV3MLP",
    "jamba": "JambaAttentionDecoderLayer / JambaMambaDecoderLayer",
    "kimi_linear": "the layer block_type",
    "kolibri1": "self_attn is_sliding",
    "laguna": "mlp: LagunaSparseMoeBlock / mlp: LagunaMLP",
    "lara_mini": "the layer block_type",
    "lfm3": "the layer is_attention_layer",
    "llama4_text": "the layer is_moe_layer",
    "mimo_v2_flash": "self_attn layer_type, num_key_value_groups, sinks, sliding_window",
    "minimax": "the layer block_type",
    "mpt": "the backward does not run layer by layer",
    "nemotron_h": "4 layers: too few to copy one",
    "olmo3": "self_attn attention_type, sliding_window",
    "olmo_hybrid": "OlmoHybridAttentionDecoderLayer / OlmoHybridLinearAttentionDecoderLayer",
    "qwen3_5_moe_text": "the layer block_type",
    "qwen3_5_text": "the layer block_type",
    "qwen3_next": "the layer block_type",
    "recurrent_gemma": "temporal_block: RecurrentGemmaRecurrentBlock / temporal_block: RecurrentGemmaAttention",
    "vaultgemma": "self_attn layer_type, sliding_window",
    "xlstm": "2 layers: too few to copy one",
    "zamba2": "Zamba2MambaDecoderLayer / Zamba2HybridLayer",
}


def _planning_model(name: str) -> torch.nn.Module:
    config = models.with_layers(C.tiny_config(name), LAYERS)
    with EagerStridesFakeMode(allow_non_fake_inputs=True):
        model = models.build_from_config(config)
    model.config.use_cache = False
    return model.train()


def _layout(t: object) -> object:
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) if isinstance(t, torch.Tensor) else t


def _described(tg: TrainGraph) -> list[tuple]:
    """Each node as what it computes: op, target, arguments (graph values by position, placeholders by name),
    its value's layout, and which earlier node first held its storage."""
    nodes = list(tg.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    names = dict(zip(tg.placeholders(), tg.names))
    owner: dict[object, int] = {}
    out = []
    for n in nodes:
        args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: names.get(a, index.get(a)) if isinstance(
            a, fx.Node) else a)
        vals = tensors_in(n.meta.get("val"))
        storages = [owner.setdefault(t.untyped_storage()._cdata, index[n]) for t in vals]
        out.append((n.op, str(n.target), args, [_layout(t) for t in vals], storages))
    return out


@pytest.mark.parametrize("name", C.matrix_families())
def test_stamped_step_is_the_whole_trace(name):
    try:
        model = _planning_model(name)
    except Exception as e:  # noqa: BLE001 - the family's own config or init, at this depth or on fake weights
        pytest.skip(f"no {LAYERS}-layer model on fake weights: {C._one_line(e)}")
    ids = torch.zeros(C.BATCH, C.SEQ, dtype=torch.long)

    def whole() -> TrainGraph:
        return capture(model, ids, ids.clone())

    try:
        stamped = stamp.stamp(model, whole)
    except UnsupportedModel as e:  # refused for the window path as a whole (the matrix asserts it)
        pytest.skip(str(e))
    except torch._subclasses.fake_tensor.DataDependentOutputException as e:  # fake weights: traced whole too
        pytest.skip(f"its trace reads tensor values: {e}")
    except stamp.NotStampable as e:
        assert name in TRACED_WHOLE, f"{name} is traced whole: {e}"
        assert TRACED_WHOLE[name] in str(e).replace("the layer: ", ""), e
        return
    assert name not in TRACED_WHOLE, f"{name} stamps now: drop it from TRACED_WHOLE"
    full = whole()
    assert _described(stamped) == _described(full)
    assert stamped.names == full.names and stamped.roles == full.roles
    assert plan(stamped).as_dict() == plan(full).as_dict()  # the same graph and layouts: every policy's plan too
