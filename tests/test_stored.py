"""Frozen weights as stored (remat.models.stored, gguf_file): a GGUF's blocks and a bf16 folder's bytes held as
they are, dequantized inside the step. Real GGUF files (tests/tiny_gguf.py writes them with gguf-py), real
transformers models, real PEFT: the oracle is the model as transformers loads it, dequantized to float32."""

from __future__ import annotations

import gguf
import numpy as np
import peft
import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from planning import planner_of
from remat.base.settings import Note, TrainSettings
from remat.core import policies
from remat.core.plan import plan
from remat.core.recompute import keep_reasons, saved_nodes
from remat.models import adapters, gguf_file, quant, stored
from remat.models import load as models
from remat.training.step import Planner, StepShape
from remat.training.train import BatchRunner, Hooks
from tiny_gguf import MIXED, write

pytestmark = pytest.mark.usefixtures("one_thread")
Q = gguf.GGMLQuantizationType
CTX = 64


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.mktemp("remat-cache")))
        yield


@pytest.fixture(scope="module", params=["untied", "tied"])
def gguf_path(request, tmp_path_factory):
    return write(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", tied=request.param == "tied")


def transformers_model(path) -> torch.nn.Module:
    """The oracle: the model as transformers loads a GGUF (what remat converted and cached before), float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)
    return model.train()


def weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)  # a stored weight: dequantized as the step does


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (1, CTX), generator=g)
    labels = torch.randint(0, 259, (1, CTX), generator=g)
    labels[:, :3] = -100
    return ids, labels


# ------------------------------------------------------------------------------------------------ loading


def test_gguf_weights_stay_in_their_blocks_and_read_as_transformers_loads_them(gguf_path):
    loaded = models.load_model(str(gguf_path)).model
    reference = transformers_model(gguf_path)
    held = {name: p for name, p in loaded.named_parameters()}
    blocks = {n: p for n, p in held.items() if p.dtype == torch.uint8}
    assert len(blocks) == 2 * 7 + 1 + ("untied" in gguf_path.name)  # every 2-D weight; the norms stay float32
    reader = gguf.GGUFReader(gguf_path)
    assert stored.stored_bytes(loaded) == sum(t.n_bytes for t in reader.tensors if t.tensor_type != Q.F32)
    for name, value in reference.state_dict().items():
        assert torch.equal(weight(loaded, name).view(torch.int32), value.view(torch.int32)), name
    types = {stored.float_name(n): int(p.qtype) for n, p, _ in stored.stored(loaded)}
    assert types["model.layers.1.self_attn.q_proj.weight"] == MIXED["attn_q"]
    if gguf_path.name == "tied.gguf":  # one parameter of bytes for the embedding and the head
        head, embedding = loaded.lm_head.parametrizations.weight, loaded.model.embed_tokens.parametrizations.weight
        assert head.original is embedding.original


class _MadeShapes(TorchDispatchMode):
    """Records the shape of every weight `remat::dequantize` makes."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is quant.DEQUANTIZE:
            self.made.append(tuple(out.shape))
        return out


def test_a_stored_embedding_makes_only_the_rows_it_looks_up(gguf_path):
    loaded = models.load_model(str(gguf_path)).model
    emb = loaded.get_input_embeddings()
    ids = torch.tensor([[5, 0, 258], [5, 7, 7]])
    whole = torch.nn.functional.embedding(ids, emb.weight)  # the table made whole, then looked up
    with _MadeShapes() as seen:
        got = emb(ids)
    assert torch.equal(got.view(torch.int32), whole.view(torch.int32))
    assert seen.made == [(6, emb.embedding_dim)]
    stored.to_float(loaded)  # a float table again: the class's own lookup
    with _MadeShapes() as seen:
        again = emb(ids)
    assert torch.equal(again.view(torch.int32), whole.view(torch.int32)) and seen.made == []


def test_a_load_maps_each_tensor_as_gguf_py_reads_it(tmp_path):
    """A load maps each tensor's data from the header's table kept in the cache (`gguf_file.mapped`), without
    gguf-py's reader (which parses the whole header, vocabulary and all, each time): the reader's arrays all the
    same (type, shape, bytes), for F32, F16, BF16, every kept block type, and every tensor of the shipped GGUF."""
    path = write(tmp_path / "types.gguf", MIXED | {"ffn_gate": Q.F16, "ffn_up": Q.BF16})
    for p in (path, models.default_gguf_path()):
        first = models.gguf_header(p)  # read by gguf-py's reader, kept
        arch, table = models.gguf_header(p)
        assert (arch, table) == first and all(t.offset > 0 for t in table)
        reader = gguf.GGUFReader(p)
        assert len(table) == len(reader.tensors)
        for (t, data), r in zip(gguf_file.mapped(p, table), reader.tensors):
            assert (t.name, data.dtype, data.shape) == (r.name, r.data.dtype, r.data.shape), t.name
            assert np.array_equal(data.view(np.uint8), r.data.view(np.uint8)), t.name


def test_full_fine_tuning_loads_float32_copies(gguf_path):
    loaded = models.load_model(str(gguf_path), as_stored=False).model
    reference = transformers_model(gguf_path)
    assert not any(stored.stored(loaded))
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.get_parameter(name), value), name


def test_a_type_without_a_kernel_is_dequantized_at_load_with_a_note(tmp_path):
    path = write(tmp_path / "q3k.gguf", {"ffn_up": Q.Q3_K})
    with pytest.warns(Note, match="2 Q3_K tensors dequantized at load"):
        loaded = models.load_model(str(path)).model
    up = loaded.model.layers[0].mlp.up_proj
    assert not hasattr(up, "parametrizations") and up.weight.dtype == torch.float32
    assert torch.equal(up.weight, transformers_model(path).model.layers[0].mlp.up_proj.weight)


def test_a_bf16_folder_keeps_its_bytes(tmp_path):
    source = models.load_model("tiny-llama", seed=2)
    folder = tmp_path / "bf16"
    source.model.to(torch.bfloat16).save_pretrained(folder)
    source.tokenizer.save_pretrained(folder)
    loaded = models.load_model(str(folder)).model
    as_float = models.load_model(str(folder), as_stored=False).model  # bf16 -> float32, exactly
    assert {Q(p.qtype).name for _, p, _ in stored.stored(loaded)} == {"BF16"}
    assert stored.stored_bytes(loaded) == sum(p.numel() * 2 for p in as_float.parameters())
    for name, value in as_float.state_dict().items():
        assert torch.equal(weight(loaded, name), value), name


# ------------------------------------------------------------------------------------------------ the step


def lora_pair(path, **load) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same LoRA (same seed) on the stored base and on transformers' float32 load of the same file."""
    lora = adapters.LoraSettings(r=4)
    stored_base = models.load_model(str(path), **load).model
    return adapters.apply_lora(stored_base, lora, seed=1), adapters.apply_lora(transformers_model(path), lora, seed=1)


@pytest.mark.parametrize("path_kind, policy, dtype", [
    ("window", "off", "float32"), ("window", "on", "float32"), ("exact", "off", "float32"), ("exact", "on", "float32"),
    ("truncated", "on", "float32"), ("window", "off", "bfloat16"), ("exact", "on", "bfloat16")])
def test_a_step_on_stored_weights_is_the_float_models_step(gguf_path, path_kind, policy, dtype):
    """Loss and every grad, bitwise: the dequantized weight is the float model's, the ops the same. In bfloat16 too:
    a stored weight is dequantized straight into it (`stored.made_in`), the float model's cast from float32."""
    s = TrainSettings(ctx=CTX, recompute=policy, dtype=dtype, **({} if path_kind == "window" else
                                                 {"path": "walk", "ubatch": 16, "walk": path_kind}))
    ids, labels = batch()
    results = []
    for model in lora_pair(gguf_path):
        planner = Planner(model)
        graph = planner.build(StepShape.of(s), policy)
        loss, grads = BatchRunner(model, graph, s, Hooks(), planner.probes).run(ids, labels)
        results.append((loss, grads))
    (loss, grads), (want_loss, want_grads) = results
    assert loss == want_loss and len(grads) == len(want_grads) == 2 * 7 * 2
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))


def test_dequantized_weights_are_recomputed_under_every_policy(gguf_path):
    model, float_model = lora_pair(gguf_path)
    shape = StepShape("window", 1, CTX, None, 0)
    planner, float_planner = Planner(model), Planner(float_model)
    traced = planner._traced_step(planner._at(shape))
    forward = traced.forward_nodes()
    made = [n for n in forward if n.target is quant.DEQUANTIZE]
    assert len(made) == len(list(stored.stored(model))) + ("untied" not in gguf_path.name)  # a tied head: twice
    assert all(traced.roles[i] == "frozen" for i, n in enumerate(traced.placeholders())
               if n.meta["val"].dtype == torch.uint8)
    saved = [n for n in saved_nodes(traced) if policies.always_recomputed(n)]
    assert saved  # the backward reads the float weights (the input's gradient) ...
    for name in ("off", "on", "dots", "every:2"):
        chosen = planner._policy(name, shape)
        assert chosen is not None
        assert not set(saved) & set(keep_reasons(traced, chosen)), name  # ... from clones made in the backward
        assert "recompute" in planner.build(shape, name).info  # off too: a rewrite
    # a float model's off is the trace itself, not a rewrite: byte for byte today's graph
    float_off = float_planner.build(shape, "off")
    assert float_off is float_planner._traced_step(float_planner._at(shape)) and "recompute" not in float_off.info


def test_plans_count_blocks_as_frozen_and_the_float_copies_in_the_graph(gguf_path):
    model, float_model = lora_pair(gguf_path)
    shape = StepShape("window", 1, CTX, None, 0)
    planner = Planner(model)
    mine, theirs = planner.plans(shape), Planner(float_model).plans(shape)
    base_bytes = (stored.stored_bytes(model) + sum(b.nbytes for b in model.buffers())
                  + sum(p.nbytes for p in model.parameters() if p.dtype == torch.float32 and not p.requires_grad))
    assert mine["off"].frozen == base_bytes < theirs["off"].frozen
    assert mine["off"].graph == plan(planner.build(shape, "off")).graph  # planned without the graph: the same
    for p in ("off", "on"):
        assert mine[p].params == theirs[p].params and mine[p].graph > 0


def test_the_plan_from_the_header_is_the_loaded_models(gguf_path):
    """The gate before the weights load (config, header, fake blocks, stamped and recorded) plans what the
    loaded model's step (recorded whole) plans, category for category."""
    s = TrainSettings(model=str(gguf_path), ctx=CTX, lora_r=4)
    shape = StepShape.of(s)
    early = planner_of(s).plans(shape)
    model = adapters.apply_lora(models.load_model(s.model).model, adapters.LoraSettings(r=4), seed=s.seed)
    traced = Planner(model).plans(shape)
    assert {k: p.as_dict() for k, p in early.items()} == {k: p.as_dict() for k, p in traced.items()}


# ------------------------------------------------------------------------------------------------ adapters


def test_an_adapter_trained_on_stored_weights_loads_on_the_float_base(gguf_path, tmp_path):
    model, float_model = lora_pair(gguf_path)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.01)  # trained, as far as the check cares
    adapters.save_adapter(model, tmp_path / "adapter", base_name=str(gguf_path), base_gguf=gguf_path)
    reloaded = peft.PeftModel.from_pretrained(transformers_model(gguf_path), tmp_path / "adapter")
    assert set(peft.get_peft_model_state_dict(reloaded)) == set(peft.get_peft_model_state_dict(float_model))
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert (tmp_path / "adapter" / "adapter.gguf").is_file()


def test_a_merge_from_stored_weights_writes_float32_and_says_so(gguf_path, tmp_path):
    model, _ = lora_pair(gguf_path)
    adapters.save_adapter(model, tmp_path / "adapter", base_name=str(gguf_path))
    with pytest.warns(Note, match=r"the base holds .*Q4_K.* weights: the merged model is written in float32"):
        adapters.merge_into_base(None, tmp_path / "adapter", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    reference = transformers_model(gguf_path)
    assert torch.equal(merged.model.layers[0].mlp.up_proj.weight, reference.model.layers[0].mlp.up_proj.weight)


# ------------------------------------------------------------------------------------------------ bad input


def _one_line_model_error(spec: str, *needles: str) -> None:
    for load in (models.load_config, models.load_model):  # the header alone, and the weights
        with pytest.raises(models.ModelError) as e:
            load(spec)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_a_truncated_gguf_is_refused_in_one_line(tmp_path):
    path = write(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-4096])
    _one_line_model_error(str(path), "cut.gguf", "truncated")


def test_a_header_whose_offset_lies_is_refused_in_one_line(tmp_path):
    path = write(tmp_path / "lies.gguf")
    reader = gguf.GGUFReader(path, "r+")  # the tensor table is mapped: its last field is the data offset
    reader.tensors[3].field.parts[-1][0] = path.stat().st_size  # the tensor starts at the end of the file
    reader.data.flush()
    del reader
    _one_line_model_error(str(path), "lies.gguf")


def test_a_type_remat_cannot_read_is_refused_in_one_line(tmp_path):
    path = write(tmp_path / "q8k.gguf", {"ffn_gate": Q.Q8_K})
    _one_line_model_error(str(path), "blk.0.ffn_gate.weight is Q8_K, a type remat cannot read")


def test_budget_mode_saves_back_no_float_copy(gguf_path):
    """Between on and off, budget mode saves back what is costliest to recompute per byte, as far as the budget
    lets it: never a dequantized weight (the rule `off` keeps too), and the plan it chose is its graph's."""
    model, _ = lora_pair(gguf_path)
    shape = StepShape("window", 1, CTX, None, 0)
    planner = Planner(model)
    planned = planner.plans(shape)
    budget = (planned["on"].total + planned["off"].total) // 2
    choice = planner.choose(shape, "budget", budget)
    assert "+" in choice.policy and choice.plan.total <= budget  # a save-back between the rungs
    # its probe planned what the graph holds: had it saved back a float copy, which the rewrite never keeps,
    # the two would differ
    assert plan(planner.build(shape, choice.policy)).total == choice.plan.total


def test_full_fine_tuning_of_a_gguf_is_planned_in_float32_and_says_so(gguf_path):
    s = TrainSettings(model=str(gguf_path), ctx=CTX, lora=False)
    with pytest.warns(Note, match="full fine-tuning trains float32 copies of the stored"):
        planned = planner_of(s).plans(StepShape.of(s), ("off",))["off"]
    assert planned.frozen == 256  # the rotary tables (buffers) alone: every weight trains, float32
    assert planned.params == sum(p.nbytes for p in transformers_model(gguf_path).parameters())
