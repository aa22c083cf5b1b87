"""Mamba's selective scan from a carried state (`remat.models.scan`): from a zero state it is transformers' own
function bitwise, and a sequence scanned in two pieces, the second from the first's last state, is the sequence
scanned whole, bitwise (the same ops per token), which is what lets the walk's chunks compute the window's."""

from __future__ import annotations

import pytest
import torch
from transformers.models.falcon_mamba import modeling_falcon_mamba
from transformers.models.jamba import modeling_jamba
from transformers.models.mamba import modeling_mamba

from remat.models.scan import scan_from

BATCH, INNER, STATE, TOKENS = 2, 8, 4, 12


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {"hidden_states": r(BATCH, INNER, TOKENS), "dt": r(BATCH, INNER, TOKENS), "A": -r(INNER, STATE).exp(),
            "B": r(BATCH, STATE, TOKENS), "C": r(BATCH, STATE, TOKENS), "D": r(INNER), "z": r(BATCH, INNER, TOKENS),
            "delta_bias": r(INNER)}


@pytest.mark.parametrize("module", [modeling_mamba, modeling_falcon_mamba, modeling_jamba])
def test_from_a_zero_state_it_is_the_models_scan(module):
    x = inputs()
    own, own_state = module.mamba_selective_scan(**x, delta_softplus=True, return_last_state=True)
    ours, state = scan_from(torch.zeros(BATCH, INNER, STATE), **x, delta_softplus=True, return_last_state=True)
    assert torch.equal(ours, own) and torch.equal(state, own_state)


def test_two_pieces_from_the_carried_state_are_the_whole_scan():
    x = inputs(1)
    whole, last = scan_from(torch.zeros(BATCH, INNER, STATE), **x, delta_softplus=True, return_last_state=True)
    cut = TOKENS // 3

    def piece(part: slice) -> dict[str, torch.Tensor]:
        return {k: v[..., part].contiguous() if v.dim() == 3 else v for k, v in x.items()}  # as a chunk makes them

    first, carried = scan_from(torch.zeros(BATCH, INNER, STATE), **piece(slice(0, cut)), delta_softplus=True,
                               return_last_state=True)
    second, end = scan_from(carried, **piece(slice(cut, None)), delta_softplus=True, return_last_state=True)
    assert torch.equal(torch.cat([first, second], dim=-1), whole) and torch.equal(end, last)
    # and the state matters: from zero, the second piece is another one
    assert not torch.equal(scan_from(torch.zeros(BATCH, INNER, STATE), **piece(slice(cut, None)),
                                     delta_softplus=True), second)
