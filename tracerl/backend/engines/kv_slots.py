"""A batched KV cache whose rows join and leave between decode steps (for continuous batching).

Each decoding row owns a slot: row ``i`` of preallocated ``[rows, heads, columns, head_dim]``
key and value buffers per layer, its tokens right-padded in columns ``[0, length_i)``. A decode
step writes each row's new key and value at its own column ``length_i`` and attends over columns
``[0, max length]`` with a mask that hides each row's columns past its own; rows never move to
line up with each other, so a newcomer costs the copy of its own prefilled cache and a leaver
the copy of the last row into its slot. Buffers grow by doubling, in rows and in columns.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class _SlotLayer(DynamicLayer):
    """One layer's slots. ``update`` is called by the model's attention with the step's keys
    and values ``[rows, heads, 1, head_dim]``; it writes them at each row's column and returns
    the rows' keys and values up to the widest row."""

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()
        self.owner = owner
        self.keys = self.values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot layers are allocated by SlotCache.insert")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        assert self.keys is not None and self.values is not None
        rows, cols = o.row_index, o.step_columns
        self.keys[rows, :, cols] = key_states[:, :, 0]
        self.values[rows, :, cols] = value_states[:, :, 0]
        width = o.width + 1
        return self.keys[: o.rows, :, :width], self.values[: o.rows, :, :width]

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width + query_length, 0


class SlotCache(Cache):
    """The decoding rows' KV cache: ``insert`` a row's prefilled cache, ``remove`` a row, and
    before each decode step ``columns_for_step`` gives the attention mask and positions."""

    def __init__(self, num_layers: int, max_columns: int) -> None:
        self.max_columns = max_columns  # the longest a row may grow (doubling stops there)
        self._slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self._slot_layers))
        self.lengths: list[int] = []  # tokens cached per row
        self.row_index = torch.zeros(0, dtype=torch.long)
        self.step_columns = torch.zeros(0, dtype=torch.long)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Columns the widest row has cached."""
        return max(self.lengths, default=0)

    def nbytes(self) -> int:
        return sum(2 * layer.keys.numel() * layer.keys.element_size()
                   for layer in self._slot_layers if layer.keys is not None)

    def _reserve(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """Make room for ``rows`` rows of ``columns`` columns, keeping what is cached."""
        first = self._slot_layers[0].keys
        have_rows, have_cols = (0, 0) if first is None else (first.shape[0], first.shape[2])
        if rows <= have_rows and columns <= have_cols:
            return
        new_rows = max(rows, 2 * have_rows if rows > have_rows else have_rows, 4)
        grow = min(2 * have_cols, self.max_columns) if columns > have_cols else have_cols
        new_cols = max(columns, grow, 64)
        _, heads, _, dim = like.shape
        for layer in self._slot_layers:
            for name in ("keys", "values"):
                grown = like.new_zeros((new_rows, heads, new_cols, dim))
                old = getattr(layer, name)
                if old is not None and self.rows:
                    grown[: self.rows, :, :have_cols] = old[: self.rows]
                setattr(layer, name, grown)
            layer.is_initialized = True

    def insert(self, prefilled: DynamicCache, copies: int = 1) -> list[int]:
        """Add ``copies`` rows holding one prefilled row's keys and values; return their slots."""
        layers: list[Any] = list(prefilled.layers)  # attention layers, each holding the prompt
        length = layers[0].keys.shape[2]
        first = self.rows
        self._reserve(first + copies, length + 1, layers[0].keys)
        for mine, theirs in zip(self._slot_layers, layers, strict=True):
            assert mine.keys is not None and mine.values is not None
            for slot in range(first, first + copies):
                mine.keys[slot, :, :length] = theirs.keys[0]
                mine.values[slot, :, :length] = theirs.values[0]
        self.lengths.extend([length] * copies)
        return list(range(first, first + copies))

    def remove(self, slot: int) -> int | None:
        """Drop the row in ``slot``; the last row moves into it. Return the slot the moved row
        had (None when the dropped row was the last)."""
        last = self.rows - 1
        if slot != last:
            length = self.lengths[last]
            for layer in self._slot_layers:
                assert layer.keys is not None and layer.values is not None
                layer.keys[slot, :, :length] = layer.keys[last, :, :length]
                layer.values[slot, :, :length] = layer.values[last, :, :length]
            self.lengths[slot] = length
        self.lengths.pop()
        if not self.lengths:
            self.release()
        return last if slot != last else None

    def release(self) -> None:
        """Free the buffers (no rows left)."""
        for layer in self._slot_layers:
            layer.keys = layer.values = None
            layer.is_initialized = False

    def columns_for_step(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a decode step: the ``[rows, width + 1]`` attention mask (each row sees its own
        columns and the new token's) and the new tokens' positions ``[rows, 1]``."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        first = self._slot_layers[0].keys
        assert first is not None
        self._reserve(self.rows, self.width + 1, first)
        self.row_index = torch.arange(self.rows, device=device)
        self.step_columns = lengths
        columns = torch.arange(self.width + 1, device=device)
        mask = (columns[None, :] <= lengths[:, None]).long()
        return mask, lengths[:, None]

    def advance(self) -> None:
        """After a decode step: every row cached one more token."""
        self.lengths = [n + 1 for n in self.lengths]
