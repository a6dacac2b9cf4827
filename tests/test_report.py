"""`twophase report` from a real tiny offline engine run: PNGs, a Perfetto trace, an HTML page that renders."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading

import pytest

from prerequisites import missing
from tiny_models import write_tiny_llama
from twophase.cli import main
from twophase.metrics.timeline import request_metrics
from twophase.report.html import write_report
from twophase.report.plots import request_segments
from twophase.report.report import RequestRecord, load_records, record_engine_run, records_from_json
from twophase.request import RequestTimeline, ScheduledEvent
from twophase.sampling_params import SamplingParams

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Records and outputs of 5 requests through a chunked-prefill tiny engine (mixed steps, queueing)."""
    from twophase.engine.llm import LLM

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny"))
    llm = LLM(str(model_dir), progress=False, max_num_batched_tokens=32, num_blocks=64)
    prompts = [[5 + i] * (10 + 9 * i) for i in range(5)]
    records = record_engine_run(llm, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return json.loads(json.dumps(records))  # exactly what a file or /v1/records carries


def test_records_schema_round_trips_into_the_same_metrics(run):
    assert run["schema"] == "twophase.records.v1"
    assert set(run["steps"][0]) >= {"step_id", "start_time", "duration", "num_prompt_tokens", "num_decode_tokens",
                                    "num_requests", "num_blocks_in_use", "num_blocks_total"}  # fmt: skip
    assert len(run["requests"]) == 5 and all(len(r["token_times"]) == 6 for r in run["requests"])
    assert {"mixed", "decode"} <= {("mixed" if s["num_prompt_tokens"] and s["num_decode_tokens"] else
                                    "decode" if s["num_decode_tokens"] else "prefill") for s in run["steps"]}  # fmt: skip
    records = records_from_json(run)
    lat = records.latencies()
    assert len(lat["ttft"]) == 5 and len(lat["tpot"]) == 5 and len(lat["itl"]) == 25
    assert lat["ttft"][0] == request_metrics(records.requests[0].timeline).ttft


def test_report_writes_figures_and_a_perfetto_trace(run, tmp_path):
    paths = write_report(records_from_json(run), tmp_path)
    for name in ("gantt", "step_mix", "latency_cdf"):
        assert paths[name].read_bytes()[:8] == PNG_MAGIC
    trace = json.loads(paths["trace"].read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all({"ph", "ts", "dur", "pid", "tid", "name", "cat"} <= set(e) for e in complete)
    steps = [e for e in complete if e["cat"] == "step"]
    assert len(steps) == len(run["steps"]) and {e["name"] for e in steps} <= {"prefill", "decode", "mixed"}
    request_tids = {e["tid"] for e in complete if e["cat"] == "request"}
    assert len(request_tids) == 5
    assert {e["name"] for e in complete if e["cat"] == "request"} >= {"prefill", "decode"}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert set(names) >= {r["request_id"] for r in run["requests"]}


def test_gantt_segments_of_a_hand_made_timeline():
    tl = RequestTimeline(arrival_time=10.0, token_times=[10.6, 10.8], finish_time=10.8)
    tl.scheduled = [ScheduledEvent(10.1, 32, True, 10.3), ScheduledEvent(10.4, 8, True, 10.6),
                    ScheduledEvent(10.7, 1, False, 10.8)]  # fmt: skip
    segs = request_segments(RequestRecord("r", tl), t0=10.0)
    rounded = {k: [(round(a, 6), round(b, 6)) for a, b in v] for k, v in segs.items()}
    assert rounded == {"queue": [(0.0, 0.1)], "prefill": [(0.1, 0.2), (0.4, 0.2)], "decode": [(0.7, 0.1)],
                       "waiting": [(0.3, 0.1), (0.6, 0.1)]}  # fmt: skip


def test_bench_serve_result_gives_cdfs_only(tmp_path):
    result = {"ttfts": [0.1, 0.2, 0.0], "itls": [[0.01, 0.03], [0.02], []], "errors": ["", "", "timeout"]}
    records = records_from_json(result)
    assert records.source_kind == "bench-serve" and not records.has_timelines
    assert records.latencies() == {"ttft": [0.1, 0.2], "tpot": [0.02, 0.02], "itl": [0.01, 0.03, 0.02]}
    paths = write_report(records, tmp_path)
    assert set(paths) == {"latency_cdf", "html"}


def test_report_cli_from_a_file_and_from_a_records_url(run, tmp_path, capsys):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(run))
    assert main(["report", str(path), "-o", str(tmp_path / "from_file")]) == 0
    assert (tmp_path / "from_file" / "index.html").exists()
    body = json.dumps(run).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/records"
        assert len(load_records(url).requests) == 5
        assert main(["report", url, "-o", str(tmp_path / "from_url")]) == 0
        assert (tmp_path / "from_url" / "records.json").exists() and (tmp_path / "from_url" / "gantt.png").exists()
    finally:
        server.shutdown()


@pytest.fixture
def chromium() -> str:
    """Debian's headless-capable Chromium (skips when absent; fails under CI, whose .ci/run installs it)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("needs Debian's chromium (apt-get install -y chromium)")
    return path


def test_html_page_renders_in_headless_chromium(run, tmp_path, chromium):
    page = write_report(records_from_json(run), tmp_path / "report")["html"]
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = re.search(r"<body[^>]*>", proc.stdout).group(0)
    assert 'data-figures-loaded="3"' in body and 'data-figures-total="3"' in body  # the script ran, images decoded
    assert "Uncaught" not in proc.stderr and ":CONSOLE" not in proc.stderr
    assert "request Gantt chart" in proc.stdout and "TTFT" in proc.stdout
