"""The loss head cut in bytes: the default loss chunk comes from the model's vocabulary (`hf.loss_chunk_for`), is
recorded in the receipt and kept on resume; `--loss-chunk` still fixes it. The oracles: today's path (an explicit
`--loss-chunk 256`, bitwise) and the unchunked loss (within the chunked loss's tolerance)."""

from __future__ import annotations

import pytest
import torch

from planning import plan_settings
from remat.base.settings import TrainSettings
from remat.models.hf import LOSS_PIECE_BYTES, loss_chunk_for
from remat.models.load import build_from_config, load_config, tiny_tokenizer
from remat.models.steps import window_step
from remat.training.train import finetune

pytestmark = pytest.mark.usefixtures("one_thread")


def run(**kw) -> dict:
    base = {"model": "tiny-llama", "ctx": 64, "batch": 2, "steps": 3, "lora": False}
    return finetune(TrainSettings(**{**base, **kw}), progress=False).as_dict()


@pytest.mark.parametrize("spec, chunk", [("smollm2-135m", 256), ("qwen2.5-coder-1.5b", 64), ("qwen3.5-0.8b", 32),
                                         ("tiny-llama", 256)])
def test_the_default_chunk_is_the_longest_whose_logits_fit_the_bytes(spec, chunk):
    """A piece's fp32 logits (tokens x vocabulary x 4) within 48 MiB, twice as many tokens over it (or the cap)."""
    vocab = load_config(spec).vocab_size
    assert loss_chunk_for(load_config(spec)) == chunk
    assert chunk * vocab * 4 <= LOSS_PIECE_BYTES
    assert 2 * chunk * vocab * 4 > LOSS_PIECE_BYTES or chunk == 256


def test_qwen35_plans_with_its_own_chunk_far_below_the_old_default():
    """qwen3.5-0.8b's 248,320-token vocabulary, ctx 256, recompute on: the default plans as --loss-chunk 32 does,
    and the old 256-token default held five times the graph."""
    default = plan_settings(TrainSettings(model="qwen3.5-0.8b", ctx=256), ("on",))["on"]
    assert default == plan_settings(TrainSettings(model="qwen3.5-0.8b", ctx=256, loss_chunk=32), ("on",))["on"]
    old = plan_settings(TrainSettings(model="qwen3.5-0.8b", ctx=256, loss_chunk=256), ("on",))["on"]
    assert old.graph > 5 * default.graph


def test_where_the_model_chooses_256_the_losses_are_todays():
    """tiny-llama at ctx 512 (two pieces of 256): the default and today's --loss-chunk 256 train bitwise alike."""
    chosen = run(ctx=512, batch=1)
    today = run(ctx=512, batch=1, loss_chunk=256)
    assert chosen["settings"]["loss_chunk"] == 256
    assert chosen["losses"] == today["losses"]
    measured = ("runtime", "trace", "total")  # the process's own, measured: not the step's
    assert {k: v for k, v in chosen["plan"].items() if k not in measured} == {
        k: v for k, v in today["plan"].items() if k not in measured}


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory) -> str:
    """tiny-llama with a 200,000-token vocabulary (a safetensors folder): its chunk is 32 tokens."""
    config = load_config("tiny-llama")
    config.vocab_size = 200_000
    folder = tmp_path_factory.mktemp("wide")
    build_from_config(config, seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_a_wide_vocabulary_is_cut_finer_within_the_chunked_losss_tolerance(wide_vocab):
    """The chunk chosen (32 of 128 tokens: four pieces) against the unchunked loss: within 1e-5 relative per step
    (the pieces' sums run in another order), and recorded in the receipt."""
    chosen = run(model=wide_vocab, ctx=128, batch=1)
    whole = run(model=wide_vocab, ctx=128, batch=1, loss_chunk=0)
    assert chosen["settings"]["loss_chunk"] == 32
    assert chosen["losses"] != whole["losses"]  # four pieces, not one
    for a, b in zip(chosen["losses"], whole["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (chosen["losses"], whole["losses"])


def test_a_resumed_run_keeps_the_chunk_its_checkpoint_chose(tmp_path):
    """Written with --loss-chunk 16 (four pieces of a 64-token window), resumed without the setting: the run keeps
    16 (its losses are the uninterrupted run's, bitwise), where a new run would choose 256 (one piece)."""
    whole = run(steps=4, loss_chunk=16, out=str(tmp_path / "a"), save_every=2)
    resumed = run(steps=4, out=str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed["settings"]["loss_chunk"] == 16
    assert resumed["losses"] == whole["losses"]
    fresh = run(steps=4)
    assert fresh["settings"]["loss_chunk"] == 256 and fresh["losses"] != whole["losses"]
    assert torch.tensor(fresh["losses"]).isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
def test_each_loss_piece_runs_the_head_as_one_matrix_product(make_case, batch, dtype):
    """A piece's hidden states are copied out of the window before the head reads them (`hf._cut`). Sliced, they
    keep the window's stride between batch rows, and `matmul` ran the head as a batched product of the transposed
    weight instead of one `mm`: the same values, but in bfloat16 on a CPU ~25x the time (qwen3.5-0.8b's head,
    32 tokens: 2.0 s against 0.08; a one-layer model of its vocabulary, 8 pieces: 33-37 s a step against 4-5)."""
    case = make_case("tiny-llama")
    for name, p in case.model.named_parameters():  # a frozen head, as with LoRA (a trained one's product folds)
        p.requires_grad_(".layers." in name)
    vocab = case.model.config.vocab_size
    ids, labels = case.ids[:batch], case.labels[:batch]
    tg = window_step(case.model, ids, labels, loss_chunk=ids.shape[1] // 4, dtype=dtype)
    products = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    heads = [n for n in tg.gm.graph.nodes if n.target in products and n.meta["val"].shape[-1] == vocab]
    assert len(heads) == 4 and all(n.target is torch.ops.aten.mm.default for n in heads), [n.target for n in heads]
