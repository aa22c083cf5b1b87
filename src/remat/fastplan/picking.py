"""Which layers a stamped plan traces (`pick`): the first, and two of each type of layer after it (the type's
first and its second, or the last layer, which feeds the head, where it is of the type), told apart by their
`signature` (module classes, weight shapes, the plain settings their modules keep). The model runs only those
layers while the small trace runs: `models.hf.only_layers`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

COPIES = 2  # the fewest layers a stamp must spare the trace (with fewer, the small trace is most of the whole)


class NotStampable(Exception):
    """The trace does not split into alike layers: trace the model whole."""


@dataclass(frozen=True)
class Picked:
    """Which of the n layers the small trace runs (`traced`, in order; a layer's place is its index there), and
    what each of the model's layers is stamped from (`source`: a place). The first layer (and any layer of a
    type that does not occur twice, and the last where it must) stands for itself; every other layer is its
    type's second traced layer, copied. `alike`: the two places of each type, checked against each other.
    The head stands after the layers, at place len(traced) and layer n."""

    n: int
    traced: tuple[int, ...]
    source: tuple[int, ...]
    alike: tuple[tuple[int, int], ...]

    @property
    def head(self) -> int:
        return len(self.traced)

    def itself(self, place: int) -> bool:
        """Whether a place stands for its own layer (the first, the head, ...) rather than being copied."""
        return place == self.head or all(place not in pair for pair in self.alike)

    @property
    def last_copied(self) -> bool:
        """Whether the last layer is its type's copied one (checked against the type's first) or stands for itself."""
        return not self.itself(self.source[-1])

    def layer(self, place: int) -> int:
        """The model's layer a place that stands for itself is (the head: n)."""
        return self.n if place == self.head else self.traced[place]

    def source_of(self, layer: int) -> int:
        return self.head if layer == self.n else self.source[layer]


def pick(signatures: list[tuple], last_copied: bool = True) -> Picked:
    """The first layer, as few more at either end as it takes for every type between to occur twice, and two of
    each type between: its first and its second, or the last layer where that is of the type (unless not
    `last_copied`: then the last layer always stands for itself); NotStampable when that spares the trace fewer
    than COPIES layers."""
    n, s = len(signatures), 0 if last_copied else 1  # s: the fewest last layers that stand for themselves
    for ends in range(1 + s, n - 1):
        for a in range(1, ends + 1 - s):
            between: dict[tuple, list[int]] = {}
            for i in range(a, n - ends + a):
                between.setdefault(signatures[i], []).append(i)
            if all(len(layers) >= 2 for layers in between.values()):
                return _picked(n, a, ends - a, list(between.values()))
    if n < 4 + COPIES:
        raise NotStampable(f"{n} layers: too few to copy one")
    i = next(i for i in range(2, n) if signatures[i] != signatures[1])
    raise NotStampable(f"its layers do not repeat: {difference(signatures[1], signatures[i])} (layers 1, {i})")


def _picked(n: int, a: int, s: int, types: list[list[int]]) -> Picked:
    # each type's first layer and the one copied: its second, or the last layer where it is of the type
    pairs = [(t[0], t[-1] if t[-1] == n - 1 else t[1]) for t in types]
    traced = sorted({*range(a), *range(n - s, n), *(i for pair in pairs for i in pair)})
    if n - len(traced) < COPIES:
        raise NotStampable(f"{n} layers: too few to copy one")
    place = {layer: j for j, layer in enumerate(traced)}
    source = [place.get(i, -1) for i in range(n)]
    for layers, (_, copied) in zip(types, pairs):
        for i in layers:
            source[i] = place[copied]
    return Picked(n, tuple(traced), tuple(source), tuple((place[x], place[y]) for x, y in pairs))




_POSITION = re.compile(r"layer_?(idx|id|index|number)|block_?(idx|id)")


def signature(layer: nn.Module) -> tuple:
    """What can make two layers different functions: module classes, parameter and buffer shapes, and the
    plain settings the modules keep (sliding window or not, layer type, ...), its own position aside."""
    parts: list = []
    for name, m in layer.named_modules():
        settings = sorted((k, repr(v)) for k, v in vars(m).items()
                          if not k.startswith("_") and not _POSITION.fullmatch(k) and k != "training"
                          and isinstance(v, (int, float, str, bool, type(None), tuple, list)))
        tensors = [(k, tuple(t.shape), t.dtype, t.requires_grad)
                   for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        parts.append((name, type(m).__qualname__, tuple(settings), tuple(tensors)))
    return tuple(parts)


def difference(a: tuple, b: tuple) -> str:
    """What differs between two layer signatures, in a few words."""
    for (name, cls, settings, tensors), (name_b, cls_b, settings_b, tensors_b) in zip(a, b):
        where = name or "the layer"
        if (name, cls) != (name_b, cls_b):
            return f"{where}: {cls} / {name_b or 'the layer'}: {cls_b}"
        keys = sorted({k for k, _ in set(settings) ^ set(settings_b)})
        if keys:
            return f"{where} {', '.join(keys)}"
        if tensors != tensors_b:
            return f"{where}'s weights"
    return "their module trees"


def qualified_name(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, m in model.named_modules() if m is layers)
