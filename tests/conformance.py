"""The conformance matrix: every decoder-only causal LM of the installed transformers, as a tiny model.

The families come from transformers' own causal-LM auto mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
not from a hand list. Each is built from its config class's defaults shrunk to a tiny size (2-4
layers, hidden 64, vocab 256) that keeps the family's special features: every layer type of its
pattern (sliding / full / linear / mamba / conv...), mixture of experts with few experts, logit
scaling and softcapping, attention sinks. A family that is not a text decoder (encoder or
encoder-decoder models, multimodal wrappers) or that cannot build from a tiny config is listed in
`SKIPPED` with the reason.

The oracle is the model's own definition: `model(input_ids, labels=hf_labels)` and `.backward()` in
plain eager transformers, fp32. remat's labels are already the next token (`causal_lm_loss` does not
shift); transformers shifts internally, so `hf_labels` is remat's labels moved one to the right.

The user's path is part of each family's checks: the tiny model and the tiny byte tokenizer saved with
`save_pretrained`, trained from that folder by `finetune` with the CLI's hooks (the gate from the config read off
the folder, then the weights), losses bitwise the same run's on the model in memory (`trained_from_folder`).

`python tests/conformance.py --table` prints the README's support table from the matrix.
"""

from __future__ import annotations

import functools
import gc
import pathlib
import sys
import tempfile
from dataclasses import dataclass, field

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# VOCAB: the tiny byte tokenizer's (`models.load.tiny_tokenizer`), so the matrix's model is the one saved with it.
# WINDOW: sliding / chunked attention, < SEQ
VOCAB, HIDDEN, BATCH, SEQ, UBATCH, WINDOW = 259, 64, 2, 16, 8, 4

# Tiny sizes, applied to the fields a config class has (its defaults' keys): nothing else is added.
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # mixture of experts: few experts, two per token, one shared
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "decoder_sparse_step": 1,
    # local attention smaller than the sequence, so it matters
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # linear attention (gated delta-net)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,  # linear attention (Kimi delta attention, Bailing's): 32 heads of 128 by default
    "linear_head_dim": 16,
    # state space layers
    "state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
    "chunk_size": 8,
    "n_groups": 1,
    "num_heads": 4,
    "time_step_rank": 8,
    "expand": 2,
    "conv_kernel": 4,
    # LFM2
    "block_dim": HIDDEN,
    "block_ff_dim": 128,
    "conv_L_cache": 3,
}

# Dropout off: the oracle and remat must draw nothing (remat's dropout is tested elsewhere).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "mlp_dropout",
                "resid_dropout", "embedding_dropout", "attn_dropout", "activation_dropout", "ffn_dropout",
                "router_jitter_noise", "input_jitter_noise", "summary_first_dropout", "layer_norm_dropout")

# Per-family settings on top of TINY, to keep a feature the generic shrink would lose.
FAMILY_OVERRIDES: dict[str, dict] = {
    "gemma2": {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"final_logit_softcapping": 30.0},
    "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.1},
    "cohere": {"logit_scale": 0.25},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "use_mamba_kernels": False},
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "falcon_h1": {"mamba_d_ssm": 128, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0},
    "nemotron_h": {"hybrid_override_pattern": "M*-E", "num_hidden_layers": 4},
    "zamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 4},
    "zamba2": {"num_hidden_layers": 4, "hybrid_layer_ids": [1, 3]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": WINDOW},
    "dots3_note_text": {"num_key_value_heads": 4},
    "mamba2": {"num_heads": 8},
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "mamba": {"use_mambapy": True},
    "falcon_mamba": {"use_mambapy": True},
}

# Families left out of the matrix by model_type: not text decoders (the mapping lists them because they
# have a ForCausalLM head), with the reason.
NOT_DECODERS = (
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
    "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus",
    "plbart", "prophetnet", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr",
    "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl", "xmod", "reformer", "xlnet", "moshi", "musicgen",
    "musicgen_melody", "git", "mllama", "fuyu",
)


@dataclass
class Family:
    name: str  # the model_type
    cls: str  # the ForCausalLM class name in the mapping
    skip: str | None = None  # why it is not in the matrix
    overrides: dict = field(default_factory=dict)


def _layer_types(types: list[str], n: int) -> list[str]:
    """The first `n` (2-4) layer types, with every distinct type of the pattern kept."""
    distinct = list(dict.fromkeys(types))
    n = min(4, max(n, len(distinct)))
    out = list(types[:n])
    missing = [t for t in distinct if t not in out]
    for i, t in enumerate(missing):
        out[n - len(missing) + i] = t
    return out


def tiny_config(name: str, **extra: object) -> transformers.PretrainedConfig:
    """The family's config: its defaults, shrunk to TINY where it has the field, plus its overrides."""
    default = transformers.AutoConfig.for_model(name)
    if getattr(default, "text_config", None) is not None and not isinstance(default.text_config, dict):
        raise ValueError("composite config (text_config): the text model is listed under its own name")
    keys = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    d = {k: v for k, v in TINY.items() if k in keys}
    d |= {k: 0.0 for k in keys if (k in DROPOUT_KEYS or k.endswith("dropout"))
          and isinstance(getattr(default, k, None), float)}
    d |= FAMILY_OVERRIDES.get(name, {}) | extra
    if "qk_rope_head_dim" in d:  # multi-head latent attention: the rotary part is the head dim
        d["head_dim"] = d["qk_rope_head_dim"]
        d["num_key_value_heads"] = d["num_attention_heads"]
    types = getattr(default, "layer_types", None)
    field_name = getattr(default, "attribute_map", {}).get("layer_types", "layer_types")
    if types and not isinstance(getattr(type(default), field_name, None), property):
        d["layer_types"] = _layer_types(types, d.get("num_hidden_layers", 2))
        d["num_hidden_layers"] = len(d["layer_types"])
    return transformers.AutoConfig.for_model(name, **d)


def build(name: str, *, seed: int = 0, attn: str | None = "eager", **extra: object) -> transformers.PreTrainedModel:
    """The tiny model of a family, fp32, train mode, random weights fixed by `seed`."""
    config = tiny_config(name, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    return model.train()


def reference(name: str) -> transformers.PreTrainedModel:
    """The model as transformers builds it by default, its experts (mixture of experts) run by transformers'
    "batched_mm" as remat runs them (`hf.EXPERTS`): the default "grouped_mm" sums in another order, a rounding
    difference between transformers' own kernels (1.2e-5 relative on a DeepSeek-V4 gradient), not remat's."""
    from remat.models.hf import EXPERTS

    model = build(name, attn=None)
    if model._can_set_experts_implementation():
        model.set_experts_implementation(EXPERTS)
    return model


@functools.cache
def families() -> list[Family]:
    """Every causal-LM architecture of the installed transformers, one per (config, model) class pair."""
    out, seen = [], set()
    for name, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        f = Family(name, cls)
        try:
            config_cls = type(transformers.AutoConfig.for_model(name)).__name__
        except Exception as e:  # noqa: BLE001 - any failure is a reason to skip
            f.skip = f"no config: {type(e).__name__}"
            out.append(f)
            continue
        if (config_cls, cls) in seen:
            f.skip = f"same classes as another entry ({config_cls}, {cls})"
        elif name in NOT_DECODERS:
            f.skip = "not a decoder-only text model"
        elif "ConditionalGeneration" in cls:
            f.skip = "multimodal wrapper (its text model has its own entry)"
        seen.add((config_cls, cls))
        out.append(f)
    return out


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and remat's labels (the next token; -100 ignored, the last position always ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    labels[:, :3] = -100
    return ids, labels


def hf_labels(labels: torch.Tensor) -> torch.Tensor:
    """remat's labels as transformers takes them: it shifts left by one, so shift right by one."""
    assert (labels[:, -1] == -100).all()
    return torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)


def oracle(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
           names: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's own loss and the grads of the named parameters: eager forward + backward."""
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=hf_labels(labels), use_cache=False).loss
    loss.backward()
    grads = [params[n].grad.detach().clone() if params[n].grad is not None else torch.zeros_like(params[n])
             for n in names]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference |a - b| / |b| (norms), 0 when both are zero."""
    den = b.double().norm().item()
    num = (a.double() - b.double()).norm().item()
    return num / den if den else num


def grads_rel(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The worst tensor's ||g - ref|| / ||ref||, where ||ref|| is at least 1e-3 of the largest tensor's norm.

    The floor is for gradients that are sums cancelling to near zero, whose fp32 rounding is that of
    the much larger summands: a key bias (softmax ignores a shift shared by every key: its true gradient
    is 0), a delta rule's decay parameters (tests/test_walk.py holds those in fp64, where they agree).
    """
    floor = 1e-3 * max(r.double().norm().item() for r in reference)
    return max((g.double() - r.double()).norm().item() / max(r.double().norm().item(), floor)
               for g, r in zip(grads, reference))


# ------------------------------------------------------------------------------------------ the checks

TOL = 1e-5  # relative, fp32
MAX_PARAMS = 3_000_000


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:240]}"


# Open failures, each asserted to still fail (strict xfail) so a fix shows up: (family, check) -> what happens.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


@dataclass
class Report:
    """What one family does in remat, each check run once (the tests assert on it, the table prints it)."""

    name: str
    refused: dict[str, str] = field(default_factory=dict)  # check -> remat's one-line refusal
    errors: dict[str, str] = field(default_factory=dict)  # check -> anything else that went wrong
    loss_rel: dict[str, float] = field(default_factory=dict)  # "off" / "on" -> vs the model's own loss
    grad_rel: dict[str, float] = field(default_factory=dict)  # worst parameter
    bitwise: bool | None = None  # recompute on == off
    planned: int | None = None  # -1: planned without the graph, the plan differs from the graph's
    measured: int | None = None
    walk_rel: float | None = None  # walk window loss vs the ubatch loss
    walk_grad_rel: float | None = None  # the exact walk's grads vs the model's own (worst parameter)
    lora_changed: bool | None = None
    lora_grad_rel: float | None = None  # the adapter's grads vs PEFT's own eager backward (worst tensor)
    lora_note: str = ""
    verify: str | None = None  # `remat verify`'s first difference on the rewritten step ("" when every clone is equal)
    folder_losses: list[float] | None = None  # trained from the saved folder through `finetune`, as the CLI does
    memory_losses: list[float] | None = None  # the same run on the model in memory

    def status(self, check: str) -> str:
        if check in self.refused:
            return "refused"
        if check in self.errors:
            return "error"
        ok = {
            "ubatch": self.bitwise and self.planned == self.measured and self.verify == ""
            and max(self.loss_rel.values(), default=1) <= TOL,
            "full": max(self.grad_rel.values(), default=1) <= TOL,
            "walk": self.walk_rel is not None and self.walk_rel <= TOL
            and self.walk_grad_rel is not None and self.walk_grad_rel <= TOL,
            "LoRA": bool(self.lora_changed) and self.lora_grad_rel is not None and self.lora_grad_rel <= TOL,
            "folder": self.folder_losses is not None and len(self.folder_losses) == FOLDER_STEPS
            and self.folder_losses == self.memory_losses,
        }[check]
        return "yes" if ok else "differs"


def _refusal() -> type[Exception]:
    from remat.models.hf import UnsupportedModel

    return UnsupportedModel


def _attempt(report: Report, check: str, fn) -> object:
    try:
        return fn()
    except _refusal() as e:
        report.refused[check] = str(e)
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        report.errors[check] = _one_line(e)
    return None


@functools.cache
def check(name: str) -> Report:
    """Run every check of one family: oracle, ubatch (recompute off, on, verify), plan vs measured, walk, LoRA,
    trained from a saved folder."""
    from remat.core.graph import StepInputs
    from remat.core.plan import measure, plan
    from remat.core.process import keep_for_good
    from remat.core.recompute import LAYER, Rewriter, verify
    from remat.models import adapters, steps
    from remat.models import load as models
    from remat.models.steps import window_step
    from remat.training import walk

    # The families checked before left garbage and what lives on (torch's fake-kernel cache grows by thousands of
    # entries a family): collected once, the rest moved out of the collector's way, as `remat finetune` keeps its
    # imports. Each in-process `finetune` (the folder check) collects three times (`process.trim_heap`), and those
    # walked every family's leftovers: 0.24 s each, 92 s over the matrix.
    gc.collect()
    keep_for_good()
    report = Report(name)
    ids, labels = batch()
    own = reference(name)
    names = [n for n, _ in own.named_parameters()]
    loss, grads = oracle(own, ids, labels, names)
    del own
    model = models.build_from_config(tiny_config(name))
    model.train()
    graphs = {}  # the traced step, recompute on: the in-memory run of the saved-folder check runs it

    def ubatch():
        tg = window_step(model, ids, labels)
        args = StepInputs.of(model).args(ids, labels)
        trainable = list(StepInputs.of(model).trainable)
        by_name = dict(zip(names, grads))
        off = tg(*args)
        rewriter = Rewriter(tg)
        rt = graphs["on"] = rewriter(LAYER)
        on, measured = measure(rt, args)
        on = (on[0], on[1:])
        for key, (value, g) in (("off", off), ("on", on)):
            report.loss_rel[key] = rel(value, loss)
            report.grad_rel[key] = grads_rel(list(g), [by_name[n] for n in trainable])
        report.bitwise = bool(torch.equal(off[0], on[0]) and all(torch.equal(a, b) for a, b in zip(off[1], on[1])))
        planned = rewriter.plan(LAYER)  # how `remat plan` plans it: without making the graph
        report.planned = planned.graph if planned == plan(rt) else -1  # and the same plan as the graph's
        report.measured = measured.graph
        d = verify(rt, args).first_difference
        report.verify = "" if d is None else f"{d.node} ({d.op}) output {d.output} in {d.mark}: {d.max_abs_diff:g}"
        return off[0]

    ubatch_loss = _attempt(report, "ubatch", ubatch)
    if "ubatch" in report.refused:
        report.refused.setdefault("full", report.refused["ubatch"])

    def walked():
        tg = steps.chunk_step(model, BATCH, SEQ, UBATCH, exact=True)
        tensors = StepInputs.of(model)
        total, summed = 0, []
        for inputs in walk.Walk(model, BATCH, SEQ, UBATCH, exact=True).chunks(ids, labels, lambda: None):
            chunk_loss, summed = tg(*tensors.args(*inputs))  # the window's grads, summed in place
            total = total + chunk_loss
        if ubatch_loss is not None:
            report.walk_rel = rel(total, ubatch_loss)
        by_name = dict(zip(names, grads))
        report.walk_grad_rel = grads_rel(summed, [by_name[n] for n in tensors.trainable])

    _attempt(report, "walk", walked)

    def lora():
        base = models.build_from_config(tiny_config(name))
        base.train()
        report.lora_note = adapters.left_out(base, adapters.LoraSettings())
        pm = adapters.apply_lora(base, adapters.LoraSettings())
        tensors = StepInputs.of(pm)
        before = {k: v.detach().clone() for k, v in tensors.trainable.items()}
        tg = window_step(pm, ids, labels)
        _, g = tg(*tensors.args(ids, labels))
        # the oracle: PEFT's own model (the same adapter on the model as transformers builds it), eager
        peft_own = adapters.apply_lora(reference(name), adapters.LoraSettings())
        report.lora_grad_rel = grads_rel(g, oracle(peft_own, ids, labels, list(tensors.trainable))[1])
        # no weight decay: a step moves the adapter only where it has a gradient
        opt = torch.optim.AdamW(list(tensors.trainable.values()), lr=1e-2, weight_decay=0.0)
        for p, gi in zip(tensors.trainable.values(), g):
            p.grad = gi
        opt.step()
        report.lora_changed = any(not torch.equal(before[k], v) for k, v in tensors.trainable.items())

    _attempt(report, "LoRA", lora)

    def folder():
        with tempfile.TemporaryDirectory() as tmp:
            report.folder_losses, report.memory_losses = trained_from_folder(name, pathlib.Path(tmp), graphs.get("on"))

    _attempt(report, "folder", folder)
    return report


# ------------------------------------------------------------------------------------------ the user's path

FOLDER_STEPS = 2  # optimizer steps trained from a saved folder


def save(name: str, folder: pathlib.Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The family's tiny model and the tiny byte tokenizer, saved as a user saves them (`save_pretrained`)."""
    from remat.models import load as models

    tokenizer = models.tiny_tokenizer()
    assert len(tokenizer) == VOCAB
    model = build(name, attn=None)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def folder_settings(folder: pathlib.Path, **extra: object):
    """A few steps of full fine-tuning on the bundled corpus, recompute on, from `folder`: one batch is the
    matrix's shape (`BATCH`, `SEQ`), so the matrix's traced step is the one that trains."""
    from remat.base.settings import TrainSettings

    return TrainSettings(model=str(folder), ctx=SEQ, batch=BATCH, steps=FOLDER_STEPS, lora=False, recompute="on",
                         **extra)


def in_memory_losses(model: torch.nn.Module, tokenizer, s, graph=None) -> list[float]:
    """The trainer's loop (`train._train`) on the model held in memory: the same windows, batches, step graph
    (`graph`, else the `Planner`'s), runner (`BatchRunner`), gradients (`set_grads`) and AdamW; only the loading
    is left out."""
    from remat.core.graph import StepInputs
    from remat.training import data, train
    from remat.training.step import Planner, StepShape

    windows = data.load_windows(data.default_data_path(), tokenizer, s.ctx, s.batch, pack=s.pack)
    graph = graph or Planner(model).build(StepShape.of(s), s.recompute)
    runner = train.BatchRunner(model, graph, s, train.Hooks())
    params = list(StepInputs.of(model).trainable.values())
    optimizer = torch.optim.AdamW(params, lr=s.learning_rate, weight_decay=0.0)
    batches = data.batches(windows, s.batch, seed=s.seed, epoch=0)
    losses = []
    for i in range(s.optimizer_steps(len(windows))[1]):
        losses.append(train.set_grads(params, runner, batches[i * s.accumulate:(i + 1) * s.accumulate]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def trained_from_folder(name: str, folder: pathlib.Path, graph=None) -> tuple[list[float], list[float]]:
    """(losses trained from the saved folder by `finetune`, with the CLI's hooks: the gate from the config read
    off the folder first; the same run's losses on the model in memory, through `graph` where it is traced)."""
    from remat.training.train import Hooks, finetune

    model, tokenizer = save(name, folder)
    s = folder_settings(folder)
    receipt = finetune(s, progress=False, hooks=Hooks(on_early_plan=lambda gate: None))
    assert receipt.policy == s.recompute, receipt.policy
    return receipt.losses, in_memory_losses(model, tokenizer, s, graph)


def matrix_families() -> list[str]:
    """The families in the matrix: every decoder-only entry of the mapping whose tiny model builds."""
    return [f.name for f in families() if f.skip is None and build_error(f.name) is None]


@functools.cache
def build_error(name: str) -> str | None:
    """Why the tiny model of a family cannot be built and run by transformers itself (None: it can)."""
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(tiny_config(name)).parameters())
        if size > MAX_PARAMS:
            return f"its config did not shrink: {size:,} parameters (fields named unlike the tiny sizes)"
        model = build(name, attn=None)
        ids, labels = batch()
        with torch.no_grad():
            model(input_ids=ids[:, :4], labels=hf_labels(labels[:, :4].clone().fill_(-100)), use_cache=False)
    except Exception as e:  # noqa: BLE001 - the reason is the point
        return _one_line(e)
    return None


# ------------------------------------------------------------------------------------------ the table


def table(rows: dict[str, dict[str, str]]) -> str:
    """Markdown: family x window / walk / LoRA / full / folder, from {family: {column: status}}."""
    cols = ("window", "walk", "LoRA", "full", "folder")
    lines = ["| family | " + " | ".join(cols) + " | notes |", "|---|" + "---|" * len(cols) + "---|"]
    for name in sorted(rows):
        r = rows[name]
        lines.append(f"| {name} | " + " | ".join(r.get(c, "") for c in cols) + f" | {r.get('notes', '')} |")
    return "\n".join(lines)


def report_row(r: Report) -> dict[str, str]:
    row = {c: r.status(c) for c in ("walk", "LoRA", "full", "folder")} | {"window": r.status("ubatch")}
    notes = sorted({f"{c.replace('ubatch', 'window')}: {m}" for c, m in r.refused.items() if c != "full"})
    notes += [f"open: {why}" for (name, c), why in KNOWN_FAILURES.items() if name == r.name]
    if r.lora_note:
        notes.append(r.lora_note)
    row["notes"] = "; ".join(notes).replace("|", "/")
    return row


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "--list" in sys.argv:
        for f in families():
            print(f.name, f.cls, f.skip or "")
    elif "--table" in sys.argv:
        print(table({name: report_row(check(name)) for name in matrix_families()}))
