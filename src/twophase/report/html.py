"""The report: PNGs, a trace and one self-contained HTML page (figures embedded as base64)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

from twophase.report.plots import plot_gantt, plot_latency_cdfs, plot_step_mix
from twophase.report.report import RunRecords
from twophase.report.trace import write_trace

# Marks <body data-figures-loaded="N"> once every image has decoded: lets a headless browser test see that
# the figures rendered (and that the page's one script ran without error).
LOAD_CHECK_SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (im) { return im.complete && im.naturalWidth > 0; }).length;
  document.body.setAttribute('data-figures-loaded', String(ok));
  document.body.setAttribute('data-figures-total', String(imgs.length));
});
</script>"""

STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1200px}table{border-collapse:collapse;margin:0.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}img{max-width:100%}"""


def latency_table(latencies: dict[str, list[float]]) -> list[list[str]]:
    """Rows: metric, count, mean, p50, p90, p99, max (milliseconds)."""
    rows = [["metric", "count", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms"]]
    for key in ("ttft", "tpot", "itl"):
        values = np.asarray(latencies.get(key, []), dtype=float) * 1000  # [N]
        if not len(values):
            rows.append([key.upper(), "0", "", "", "", "", ""])
            continue
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        rows.append([key.upper(), str(len(values))] + [f"{v:.2f}" for v in (values.mean(), p50, p90, p99, values.max())])
    return rows


def step_table(records: RunRecords) -> list[list[str]]:
    """Rows: phase, steps, prompt tokens, decode tokens, total and mean step time."""
    rows = [["phase", "steps", "prompt tokens", "decode tokens", "total s", "mean ms"]]
    for phase in ("prefill", "mixed", "decode"):
        steps = [s for s in records.steps if s.phase == phase]
        total = sum(s.duration for s in steps)
        rows.append([phase, str(len(steps)), str(sum(s.num_prompt_tokens for s in steps)),
                     str(sum(s.num_decode_tokens for s in steps)), f"{total:.3f}",
                     f"{1000 * total / len(steps):.2f}" if steps else ""])  # fmt: skip
    return rows


def _table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(title: str, images: dict[str, Path], tables: dict[str, list[list[str]]], links: dict[str, str]) -> str:
    """A standalone page: summary tables, then each PNG embedded as a data URI."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]  # fmt: skip
    for caption, rows in tables.items():
        parts.append(f"<h2>{html.escape(caption)}</h2>{_table(rows)}")
    for caption, path in images.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        parts.append(f"<figure><figcaption><h2>{html.escape(caption)}</h2></figcaption>"
                     f"<img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'></figure>")  # fmt: skip
    if links:
        items = "".join(f"<li><a href='{html.escape(href)}'>{html.escape(text)}</a></li>" for text, href in links.items())
        parts.append(f"<h2>files</h2><ul>{items}</ul>")
    parts.append(LOAD_CHECK_SCRIPT + "</body></html>")
    return "\n".join(parts)


def write_report(records: RunRecords, out_dir: str | Path, title: str = "twophase run") -> dict[str, Path]:
    """Write every figure the records allow, the trace, and index.html; returns name → path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    images: dict[str, Path] = {}
    if records.has_timelines:
        images["request Gantt chart"] = paths["gantt"] = plot_gantt(records, out / "gantt.png")
        images["step mix"] = paths["step_mix"] = plot_step_mix(records, out / "step_mix.png")
        paths["trace"] = write_trace(records, out / "trace.json")
    latencies = records.latencies()
    images["latency CDFs"] = paths["latency_cdf"] = plot_latency_cdfs(latencies, out / "latency_cdf.png")
    tables = {"latency": latency_table(latencies)}
    if records.steps:
        tables["engine steps"] = step_table(records)
    links = {"Perfetto / Chrome trace (trace.json)": "trace.json"} if "trace" in paths else {}
    page = out / "index.html"
    page.write_text(render_html(title, images, tables, links))
    paths["html"] = page
    return paths
