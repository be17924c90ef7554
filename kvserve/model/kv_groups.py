"""KV cache groups: how a hybrid model's layers share one pool of blocks.

A model whose layers attend differently (Gemma 3: five sliding-window layers to one global
layer; Qwen with ``max_window_layers``) does not need the same KV for every layer: a
sliding layer can never again read a token that left its window. The hybrid layout splits
the layers into **groups of equal size**, each group of one attention type, and gives
every group its own block table over one shared pool. A pool block (a *page*) holds
``group_size`` layers' K/V for ``block_size`` tokens; which group's layers it holds is
decided when it is allocated. A global group keeps every block of a sequence; a sliding
group keeps only the blocks its window can still see, so at long context a 5:1 model holds
about a fifth of the KV a uniform cache does.

Equal group sizes keep one page size (vLLM's hybrid manager does the same): the layers at
position ``j`` of every group share cache tensor ``j``, and a page id says which rows of
it. With ``g`` layers of each kind's count divisible by ``group_size`` (their greatest
common divisor), every group is full.

The uniform layout is the special case of one group holding every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from kvserve.utils import cdiv


@dataclass(frozen=True)
class KVGroups:
    """Layers → groups. ``windows[g]`` is group ``g``'s sliding window in tokens (None: it
    attends to the whole context); global groups come first, so group 0 of a model with
    any global layer keeps every block. ``layer_group[i]`` / ``layer_slot[i]``: layer
    ``i``'s group and its position in it (the shared cache tensor it uses)."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @classmethod
    def uniform(cls, num_layers: int, window: int | None = None) -> KVGroups:
        """One group of every layer (every layer sees ``window`` tokens, or everything)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def for_layer_windows(cls, layer_windows: tuple[int, ...]) -> KVGroups:
        """Groups for per-layer windows (0: a global layer), e.g. ``ModelSpec.layer_windows``."""
        kinds: dict[int, list[int]] = {}
        for i, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(i)
        size = 0
        for layers in kinds.values():
            size = gcd(size, len(layers))
        windows: list[int | None] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        for w in sorted(kinds):  # 0 (global) first, then by window
            layers = kinds[w]
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start : start + size]):
                    group[layer], slot[layer] = len(windows), j
                windows.append(w or None)
        return cls(tuple(windows), tuple(group), tuple(slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """More than one group: each has its own block table."""
        return len(self.windows) > 1

    def describe(self) -> str:
        """One line for logs and ``kvserve plan``."""
        full = sum(w is None for w in self.windows)
        windows = "/".join(str(w) for w in sorted({w for w in self.windows if w is not None}))
        return (
            f"hybrid: {self.num_groups} groups of {self.group_size} layers, {full} global, "
            f"{self.num_groups - full} sliding over {windows}"
        )

    def blocks_held(self, num_tokens: int, block_size: int, extra_tokens: int = 0) -> int:
        """Pages one sequence of ``num_tokens`` computed tokens holds at most, with
        ``extra_tokens`` more being computed in a step: every block in a global group; in a
        sliding group the blocks its window can see plus those of the new tokens."""
        total = num_tokens + extra_tokens
        every = cdiv(total, block_size)
        n = 0
        for w in self.windows:
            n += every if w is None else min(every, cdiv(w + extra_tokens, block_size) + 1)
        return n
