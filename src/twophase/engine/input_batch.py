"""Turn a SchedulerOutput into the tensors of one flat batch (Python lists, a range per cache block; one tensor per field)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from twophase.model.attention import AttentionMetadata
from twophase.outputs import SchedulerOutput


@dataclass
class InputBatch:
    """Model inputs for one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_token_indices: torch.Tensor  # [num_logits] rows of the hidden states to turn into logits
    sample_request_ids: list[str]  # the request of each sampled row
    sample_counts: list[int]  # logits rows of each sampled request: 1, or 1 + proposals (speculative decoding)


def build_input_batch(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
    """Flatten the scheduled requests into one token batch with positions, slots and block tables.

    Built as Python lists, one tensor per field at the end: a decode step's handful of rows costs a few tensor
    constructions instead of ~15 small torch ops (0.5-0.8 ms a step on a 2-core CPU, 5% of a Q4_1 decode step);
    a long prefill pays ~0.1 µs a token, nothing beside its forward."""
    scheduled = scheduler_output.scheduled
    q_lens = [len(s.token_ids) for s in scheduled]
    seq_lens = [s.start_position + n for s, n in zip(scheduled, q_lens)]
    query_start_loc = [0, *itertools.accumulate(q_lens)]
    input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in scheduled)), dtype=torch.long)
    positions: list[int] = []
    slots: list[int] = []
    for s, end in zip(scheduled, seq_lens):
        positions.extend(range(s.start_position, end))
        slots.extend(_slots(s.block_ids, s.start_position, end, block_size))
    block_tables = _padded_block_tables([s.block_ids for s in scheduled])  # [R, max_blocks] int32
    slot_mapping = torch.tensor(slots, dtype=torch.long)  # [T]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        block_size=block_size,
        query_lens_list=q_lens,
        seq_lens_list=seq_lens,
    )
    sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
    sample_counts = [len(scheduled[i].spec_token_ids) + 1 for i in sample_rows]
    sample_token_indices = torch.tensor(
        [t for i, c in zip(sample_rows, sample_counts) for t in range(query_start_loc[i + 1] - c, query_start_loc[i + 1])],
        dtype=torch.long,
    )  # fmt: skip
    return InputBatch(
        input_ids=input_ids.to(device),
        positions=torch.tensor(positions, dtype=torch.long).to(device),  # [T]
        meta=meta,
        sample_token_indices=sample_token_indices.to(device),
        sample_request_ids=[scheduled[i].request_id for i in sample_rows],
        sample_counts=sample_counts,
    )


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV cache slots of positions start..end-1 of a request whose blocks are ``block_ids`` (a range per block)."""
    slots: list[int] = []
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        stop = min(end, (block + 1) * block_size)
        base = block_ids[block] * block_size + offset
        slots.extend(range(base, base + stop - p))
        p = stop
    return slots


def _padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
