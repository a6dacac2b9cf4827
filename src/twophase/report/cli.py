"""`twophase report SOURCE` and `twophase estimate` (registered by the main CLI through ``register``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers) -> None:
    """Add `report` and `estimate` to the top-level commands."""
    from twophase.bench.estimate import register_estimate

    p = subparsers.add_parser("report", help="pictures, trace and HTML page of a run's records")
    p.add_argument("source", help="records JSON file, a server's /v1/records URL, or a bench serve result JSON")
    p.add_argument("--output-dir", "-o", default="twophase-report")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_report)
    register_estimate(subparsers)


def cmd_report(args: argparse.Namespace) -> int:
    """twophase report: write PNGs, trace.json and index.html; keep a copy of records fetched from a URL."""
    from twophase.report.html import write_report
    from twophase.report.report import fetch_json, records_from_json

    data = fetch_json(args.source)
    records = records_from_json(data)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if str(args.source).startswith(("http://", "https://")):
        (out / "records.json").write_text(json.dumps(data))
    paths = write_report(records, out, title=args.title or f"twophase report: {Path(str(args.source)).name}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
