"""Ranks other than 0: receive each step's command from rank 0 and run the same forward (no sampling)."""

from __future__ import annotations

import dataclasses

import torch

from twophase.engine.input_batch import build_input_batch
from twophase.outputs import SchedulerOutput


def step_payload(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """What the workers need of a step: the scheduled tokens, positions and block tables (no sampling
    parameters, no request bookkeeping — the workers keep no per-request state)."""
    return dataclasses.replace(scheduler_output, new_requests=[], finished_request_ids=[])


@torch.inference_mode()
def run_command(runner, kind: str, scheduler_output: SchedulerOutput) -> None:
    """The forward rank 0 runs for ``kind`` ("execute": logits of the sampled rows; "logits": of every row),
    with the same collectives in the same order."""
    batch = build_input_batch(scheduler_output, runner.block_size, runner.device)
    if kind == "logits":
        runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta))
        return
    hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta,
                          batch.sample_token_indices)  # [num_logits, hidden]
    if batch.sample_request_ids:
        runner.model.compute_logits(hidden)


def worker_loop(runner) -> None:
    """Serve rank 0's commands until it says stop (or the connection to it breaks)."""
    tp = runner.tp
    while True:
        kind, payload = tp.receive_command()
        if kind == "stop":
            return
        run_command(runner, kind, payload)
