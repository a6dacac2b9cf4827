"""Turn a SchedulerOutput into the tensors of one flat batch (vectorised; no per-token Python loops)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from twophase.model.attention import AttentionMetadata, PrefillChunk
from twophase.outputs import SchedulerOutput


@dataclass
class InputBatch:
    """Model inputs for one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_token_indices: torch.Tensor  # [num_sampled] rows of the hidden states to turn into logits
    sample_request_ids: list[str]  # the request of each sampled row


def build_input_batch(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
    """Flatten the scheduled requests into one token batch with positions, slots and block tables."""
    scheduled = scheduler_output.scheduled
    q_lens = [len(s.token_ids) for s in scheduled]
    query_start_loc = [0, *itertools.accumulate(q_lens)]
    input_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in scheduled)), dtype=torch.long)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    starts_t = torch.tensor([s.start_position for s in scheduled], dtype=torch.long)
    offsets = torch.tensor(query_start_loc[:-1], dtype=torch.long)
    positions = torch.arange(query_start_loc[-1]) + torch.repeat_interleave(starts_t - offsets, q_lens_t)  # [T]
    block_tables = _padded_block_tables([s.block_ids for s in scheduled])  # [R, max_blocks]
    req_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens_t)  # [T]
    slot_mapping = block_tables[req_index, positions // block_size] * block_size + positions % block_size  # [T]
    seq_lens_t = starts_t + q_lens_t  # [R]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        prefill_chunks=_prefill_chunks(q_lens, query_start_loc, seq_lens_t.tolist(), block_tables, block_size, device),
    )
    _add_decode_metadata(meta, q_lens_t, seq_lens_t, block_tables, block_size, offsets, device)
    sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
    sample_token_indices = torch.tensor([query_start_loc[i + 1] - 1 for i in sample_rows], dtype=torch.long)
    return InputBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        meta=meta,
        sample_token_indices=sample_token_indices.to(device),
        sample_request_ids=[scheduled[i].request_id for i in sample_rows],
    )


def _padded_block_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=1) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of positions 0..max_len-1 for each row of ``block_tables`` ([rows, max_len]; pads point into block 0)."""
    positions = torch.arange(int(seq_lens.max()))  # [max_len]
    return block_tables[:, positions // block_size] * block_size + positions % block_size


def _prefill_chunks(q_lens, query_start_loc, seq_lens, block_tables, block_size: int, device) -> list[PrefillChunk]:
    """Context slots and causal mask of every multi-token request, built once for all layers."""
    chunks = []
    for row, num_q in enumerate(q_lens):
        if num_q == 1:
            continue
        seq_len = seq_lens[row]
        slots = context_slots(block_tables[row : row + 1], torch.tensor([seq_len]), block_size)[0]  # [seq_len]
        positions = torch.arange(seq_len)
        mask = positions[None, :] <= torch.arange(seq_len - num_q, seq_len)[:, None]  # [num_q, seq_len]
        start = query_start_loc[row]
        chunks.append(PrefillChunk(start, start + num_q, slots.to(device), mask.to(device)))
    return chunks


def _add_decode_metadata(meta, q_lens, seq_lens, block_tables, block_size: int, token_offsets, device) -> None:
    """Rows with one query token are attended together in one padded call."""
    decode_rows = torch.nonzero(q_lens == 1).flatten()  # [num_decode]
    if len(decode_rows) == 0:
        return
    decode_seq_lens = seq_lens[decode_rows]  # [num_decode]
    slots = context_slots(block_tables[decode_rows], decode_seq_lens, block_size)  # [num_decode, max_len]
    visible = torch.arange(slots.shape[1])[None, :] < decode_seq_lens[:, None]  # [num_decode, max_len]
    meta.decode_token_indices = token_offsets[decode_rows].to(device)
    meta.decode_context_slots = slots.to(device)
    meta.decode_mask = visible[:, None, None, :].to(device)  # [num_decode, 1, 1, max_len]
