"""Causal masks that a layer cuts from a buffer of its own by the cache's length, cut by the queries' positions
while the walk runs the model (GPT-Neo).

GPT-Neo's attention keeps its mask as a buffer (`bias`: (1, 1, n, n) booleans, local layers with their window)
and takes the rows `key_length - query_length : key_length`, as if the queries were the cache's last rows. The
walk's cache holds the whole window, so a chunk's queries are not its last rows: its local layers would attend
to the window's end. While the walk runs the model (`by_positions`), each such layer's buffer is, for one call,
the same size with the rows of its queries' positions where the layer cuts: the mask the layer would take over a
cache that ends at its queries. The buffer's values are the model's; only which rows are read changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

BUFFER = "bias"


def _cuts_by_length(module: nn.Module) -> bool:
    """A layer keeping its causal mask as GPT-2 once did: a square boolean buffer (1, 1, n, n)."""
    mask = module._buffers.get(BUFFER)
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[:2] == (1, 1) and mask.shape[2] == mask.shape[3])


class _Rows:
    """Forward hooks on one layer: before the call its buffer's rows of the queries' positions, at the rows the
    layer reads; after the call its own buffer back."""

    def __init__(self) -> None:
        self.own: torch.Tensor | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("layer_past")
        if cache is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        queries = hidden.shape[1]
        keys = cache.get_mask_sizes(queries)[0]  # the rows the cache hands the layer: the whole window's
        own = self.own = module._buffers[BUFFER]  # what is there now (under tracing: the step's placeholder)
        assert own is not None
        positions = cache.get_query_offset() + torch.arange(queries, device=hidden.device)
        rows = own[:, :, :, :keys].index_select(2, positions)
        module._buffers[BUFFER] = torch.cat([rows.new_zeros(1, 1, keys - queries, keys), rows], dim=2)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        module._buffers[BUFFER] = self.own


@contextlib.contextmanager
def by_positions(model: nn.Module) -> Iterator[None]:
    """While the walk runs `model`: the layers that cut their causal mask by the cache's length cut it by the
    queries' positions."""
    handles = []
    for module in model.modules():
        if _cuts_by_length(module):
            rows = _Rows()
            handles.append(module.register_forward_pre_hook(rows.before, with_kwargs=True))
            handles.append(module.register_forward_hook(rows.after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
