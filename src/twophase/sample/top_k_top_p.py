"""Top-k then top-p filtering of logits rows without sorting the vocabulary.

A full sort of [32, 49152] float32 logits takes ~80 ms on 2 CPU cores; ``topk`` over 256 candidates ~5 ms, over
4,096 ~15 ms. A row with top-p alone goes to the C++ kernels' selection (``top_p_mask_``: the cut found by
quickselect on the logits, carrying each side's probability mass, O(vocab)) when the caller has the kernels and the
logits are float32 on the CPU. Every other filtered row is settled by the narrowest ``topk`` window that holds its top-k and
enough mass for its top-p, the whole vocabulary sorted at worst.
"""

from __future__ import annotations

from types import ModuleType

import torch

TOP_P_WINDOW = 256  # top-p candidates taken with topk first
TOP_P_WIDE_WINDOW = 4096  # then, for rows the first window does not settle; then the whole vocabulary


def apply_top_k_top_p_(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                       kernels: ModuleType | None = None) -> None:
    """In place: keep the top-k, then the smallest set with cumulative prob >= top_p; mask the rest with -inf.

    logits: [n, vocab]; ``top_k[i] == vocab`` and ``top_p[i] == 1`` disable the filters for row i. The best
    token is always kept. ``kernels``: the C++ kernels, whose selection takes the rows with top-p alone (float32
    logits on the CPU); every other filtered row goes through ``topk`` windows.
    """
    vocab = logits.shape[1]
    selection = kernels is not None and logits.dtype == torch.float32 and logits.device.type == "cpu"
    if selection:  # a row's top_p of 1 leaves it alone, so rows with a top-k (or none) pass 1
        kernels.top_p_mask_(logits, torch.tensor([p if k >= vocab else 1.0 for k, p in zip(top_k, top_p)],
                                                 dtype=torch.float64))  # fmt: skip
    rows = [i for i in range(logits.shape[0]) if top_k[i] < vocab or (top_p[i] < 1.0 and not selection)]
    if rows:
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)  # [m]
        logits[row_index] = _window_filter(logits[row_index], [top_k[i] for i in rows], [top_p[i] for i in rows])


def _window_filter(sub: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p of every row of ``sub`` [m, vocab] by ``topk`` windows: candidates from a window (k, or
    ``TOP_P_WINDOW`` for top-p alone); rows whose window holds less than top_p of the mass try
    ``TOP_P_WIDE_WINDOW``, then the whole vocabulary. Returns the filtered rows [m, vocab]."""
    device, vocab = sub.device, sub.shape[1]
    width = min(vocab, max(k if k < vocab else TOP_P_WINDOW for k in top_k))
    k = torch.tensor(top_k, dtype=torch.long, device=device)  # [m]
    p = torch.tensor(top_p, dtype=torch.float32, device=device)  # [m]
    filtered = torch.empty_like(sub)  # [m, vocab]
    todo = torch.arange(sub.shape[0], device=device)  # [u] rows of sub not settled yet
    windows = [w for w in (width, TOP_P_WIDE_WINDOW) if w < vocab and w >= width] + [vocab]
    for window in windows:
        candidates = sub[todo]  # [u, vocab]
        values, indices = candidates.topk(window, dim=-1)  # [u, window] each, best first
        keep, settled = _keep_mask(values, candidates, k[todo], p[todo])
        filtered[todo] = torch.full_like(candidates, float("-inf")).scatter_(
            1, indices, values.masked_fill(~keep, float("-inf")))  # fmt: skip
        todo = todo[~settled]
        if todo.numel() == 0:
            break
    return filtered


def _keep_mask(
    values: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the best-first candidates survive top-k then top-p, and which rows that settles.

    values: [m, width] best first, from logits [m, vocab]; top_k, top_p: [m].
    Returns keep [m, width] bool and resolved [m] bool (False: the cut may lie outside the window).
    """
    width = values.shape[1]
    positions = torch.arange(width, device=values.device).unsqueeze(0)  # [1, width]
    in_top_k = positions < top_k.unsqueeze(1)  # [m, width]
    values = values.masked_fill(~in_top_k, float("-inf"))
    all_in_window = top_k <= width  # [m]: the top-k mask leaves no mass outside the window
    log_norm = values.logsumexp(dim=-1)  # [m]
    if not bool(all_in_window.all()):
        log_norm = torch.where(all_in_window, log_norm, logits.logsumexp(dim=-1))
    probs = (values - log_norm.unsqueeze(1)).exp()  # [m, width]
    cumulative = probs.cumsum(dim=-1)  # [m, width]
    no_top_p = (top_p >= 1.0).unsqueeze(1)  # [m, 1]
    keep = in_top_k & (no_top_p | (cumulative - probs < top_p.unsqueeze(1)))  # [m, width]
    resolved = all_in_window | (cumulative[:, -1] >= top_p)  # [m]
    return keep, resolved
