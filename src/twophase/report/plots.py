"""PNG figures of a run: request Gantt chart, step mix over time, latency CDFs (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from twophase.report.report import RequestRecord, RunRecords  # noqa: E402

PHASE_COLORS = {"queue": "#b0b0b0", "prefill": "#f28e2b", "decode": "#59a14f", "waiting": "#e15759",
                "mixed": "#4e79a7", "remote_prefill": "#edc948", "transfer": "#b07aa1"}  # fmt: skip
LEGEND = {"queue": "queue", "remote_prefill": "remote prefill (P/D)", "transfer": "KV transfer (P/D)",
          "prefill": "prefill chunk", "decode": "decode step", "waiting": "runnable, waiting"}


def request_segments(request: RequestRecord, t0: float) -> dict[str, list[tuple[float, float]]]:
    """(start, width) segments in seconds since ``t0``: queue, each prefill chunk, each decode step, and the
    runnable-but-waiting gaps between them (interference, preemption); with P/D disaggregation also the remote
    prefill leg (just before arrival here) and the KV transfer."""
    tl = request.timeline
    segments: dict[str, list[tuple[float, float]]] = {"queue": [], "prefill": [], "decode": [], "waiting": []}
    if tl.remote_prefill_time:
        segments["remote_prefill"] = [(tl.arrival_time - tl.remote_prefill_time - t0, tl.remote_prefill_time)]
    if not tl.scheduled:
        end = tl.finish_time if tl.finish_time is not None else tl.arrival_time
        segments["queue"].append((tl.arrival_time - t0, end - tl.arrival_time))
        return segments
    queue_end = tl.kv_transfer_start if tl.kv_transfer_start is not None else tl.scheduled[0].time
    segments["queue"].append((tl.arrival_time - t0, queue_end - tl.arrival_time))
    if tl.kv_transfer_start is not None and tl.kv_transfer_end is not None:
        segments["transfer"] = [(tl.kv_transfer_start - t0, tl.kv_transfer_end - tl.kv_transfer_start)]
        if tl.scheduled[0].time > tl.kv_transfer_end:
            segments["waiting"].append((tl.kv_transfer_end - t0, tl.scheduled[0].time - tl.kv_transfer_end))
    cursor = tl.scheduled[0].time
    for event in tl.scheduled:
        end = event.end_time if event.end_time is not None else event.time
        if event.time > cursor:
            segments["waiting"].append((cursor - t0, event.time - cursor))
        segments["prefill" if event.is_prompt else "decode"].append((event.time - t0, end - event.time))
        cursor = max(cursor, end)
    last = tl.token_times[-1] if tl.token_times else tl.finish_time
    if last is not None and last > cursor:
        segments["waiting"].append((cursor - t0, last - cursor))
    return segments


def plot_gantt(records: RunRecords, path: str | Path) -> Path:
    """One row per request, arrival order: queue / prefill chunks / decode / runnable-but-waiting."""
    t0 = records.start_time()
    requests = sorted(records.requests, key=lambda r: r.timeline.arrival_time)
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.28 * len(requests) + 1.5)))
    for row, request in enumerate(requests):
        for phase, segs in request_segments(request, t0).items():
            if segs:
                ax.broken_barh(segs, (row - 0.4, 0.8), facecolors=PHASE_COLORS[phase], edgecolor="none")
    ax.set_yticks(range(len(requests)), [r.request_id for r in requests], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="time since start (s)", title="requests: queue / prefill / decode / runnable but waiting")
    has_pd = any(r.timeline.kv_transfer_start is not None or r.timeline.remote_prefill_time for r in requests)
    shown = [p for p in LEGEND if has_pd or p not in ("remote_prefill", "transfer")]
    handles = [plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS[p]) for p in shown]
    ax.legend(handles, [LEGEND[p] for p in shown], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def plot_step_mix(records: RunRecords, path: str | Path) -> Path:
    """Per step: prompt vs decode tokens, step duration by phase, KV cache usage and queue length."""
    t0 = records.start_time()
    steps = records.steps
    start = np.array([s.start_time - t0 for s in steps])  # [S]
    width = np.array([s.duration for s in steps])  # [S]
    prompt = np.array([s.num_prompt_tokens for s in steps])  # [S]
    decode = np.array([s.num_decode_tokens for s in steps])  # [S]
    fig, (ax_tok, ax_dur, ax_kv) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    ax_tok.bar(start, prompt, width=width, align="edge", color=PHASE_COLORS["prefill"], label="prompt tokens")
    ax_tok.bar(start, decode, width=width, bottom=prompt, align="edge", color=PHASE_COLORS["decode"], label="decode tokens")
    ax_tok.set(ylabel="tokens / step", title="step mix over time")
    ax_tok.legend(fontsize=8)
    for phase in ("prefill", "decode", "mixed"):
        sel = [i for i, s in enumerate(steps) if s.phase == phase]
        ax_dur.scatter(start[sel], width[sel] * 1000, s=8, color=PHASE_COLORS[phase], label=phase)
    ax_dur.set(ylabel="step duration (ms)")
    ax_dur.legend(fontsize=8)
    usage = [100 * s.num_blocks_in_use / s.num_blocks_total if s.num_blocks_total else 0 for s in steps]
    ax_kv.step(start, usage, where="post", color="#4e79a7", label="KV blocks in use (%)")
    ax_kv.set(ylabel="KV usage (%)", xlabel="time since start (s)")
    ax_wait = ax_kv.twinx()
    ax_wait.step(start, [s.num_waiting for s in steps], where="post", color="#e15759", alpha=0.7, label="waiting")
    ax_wait.set_ylabel("waiting requests")
    for ax in (ax_tok, ax_dur, ax_kv):
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_latency_cdfs(latencies: dict[str, list[float]], path: str | Path) -> Path:
    """Empirical CDFs of TTFT, TPOT and ITL (milliseconds), with mean / p50 / p99 in each title."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "itl")):
        values = np.asarray(latencies.get(key, []), dtype=float) * 1000  # [N] ms
        if len(values):
            ax.ecdf(values)
            p50, p99 = np.percentile(values, [50, 99])
            ax.set_title(f"{key.upper()}  mean {values.mean():.1f}  p50 {p50:.1f}  p99 {p99:.1f} ms", fontsize=9)
        else:
            ax.set_title(f"{key.upper()}: no samples", fontsize=9)
        ax.set(xlabel=f"{key.upper()} (ms)", ylabel="fraction ≤ x")
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
