"""One engine step as the plugin sees it: which request each batch row is, where its tokens go, what to compact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowPlan:
    """One request's part of a step.

    Attributes:
        req_id: the request.
        start, stop: its tokens in the step's flat batch.
        computed: tokens its cache held before the step (true positions `[computed, seen)` come in now).
        seen: tokens its cache holds after the step.
        prompt: its prompt's tokens.
        blocks: its block-table row as vLLM allocated it (indexed by true position).
        evicted: entries removed from its cache index space before this step.
        due: whether kvsieve compacts it after this step's attention.
        ragged: whether kvsieve's attention reads it this step (its compacted entries are not all at home).
        shared: its first positions that are another request's prefix (whole blocks), never rewritten or freed.
        tally: whether kvsieve attends it itself this step to add up the attention its entries receive.
    """

    req_id: str
    start: int
    stop: int
    computed: int
    seen: int
    prompt: int
    blocks: torch.Tensor
    evicted: int
    due: bool
    ragged: bool = False
    shared: int = 0
    tally: bool = False

    @property
    def positions(self) -> torch.Tensor:
        """`[stop - start]` the true positions of the step's tokens."""
        return torch.arange(self.computed, self.seen)

    @property
    def attended(self) -> bool:
        """Whether kvsieve attends it itself this step (ragged or tallied), in place of vLLM's kernel."""
        return self.ragged or self.tally

    @property
    def stored(self) -> int:
        """Entries per (layer, kv-head) the cache holds after the step."""
        return self.seen - self.evicted


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step and the attention layers that will see them."""

    rows: tuple[RowPlan, ...]
    num_layers: int
    block_size: int

    @property
    def due(self) -> tuple[RowPlan, ...]:
        return tuple(row for row in self.rows if row.due)

    def remap(self, metadata: object) -> object:
        """vLLM's common attention metadata with each compacted row's tokens written at cache index `p - evicted`:
        its block-table row without the freed blocks (`blocks_after`), its slots rewritten in place (the KV write
        reads the same tensor), its attention length cut by `evicted`. The length of a row kvsieve attends itself is
        cut to its query: kvsieve's attention overwrites what vLLM's kernel computes for it, so the kernel reads no
        more than it must."""
        if not any(row.evicted or row.attended for row in self.rows):
            return metadata
        table, seq_lens = metadata.block_table_tensor.clone(), metadata.seq_lens.clone()
        for i, row in enumerate(self.rows):
            if row.evicted:
                blocks = self.blocks_after(row, row.evicted)
                table[i, : len(blocks)] = blocks
                cache_index = row.positions - row.evicted
                slots = table[i, cache_index // self.block_size].long() * self.block_size
                slots += cache_index % self.block_size
                metadata.slot_mapping[row.start : row.stop] = slots.to(metadata.slot_mapping.dtype)
                seq_lens[i] -= row.evicted
            if row.attended:
                seq_lens[i] = row.stop - row.start
        return dataclasses.replace(
            metadata,
            block_table_tensor=table,
            seq_lens=seq_lens,
            max_seq_len=int(seq_lens[: len(self.rows)].max()),
        )

    def blocks_after(self, row: RowPlan, evicted: int) -> torch.Tensor:
        """`row`'s blocks in cache-index order once `evicted` entries are gone from behind its shared prefix: the
        prefix's blocks, then those past the freed ones."""
        first = row.shared // self.block_size
        return torch.cat([row.blocks[:first], row.blocks[first + evicted // self.block_size :]])
