"""llama.cpp peer: build from the tree vendored in the llama-cpp-python sdist, GGUF precision variants, benches, server.

Everything lives under ``$TWOPHASE_HOME/peers/llama.cpp/``: the sdist, its unpacked tree, ``build/bin/`` and
``models/`` (the F32 / BF16 / Q8_0 / Q4_0 / Q4_1 variants made with llama-quantize from the model's GGUF file, which
itself serves for the precision it stores).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from peers.common import HOST, Server, ServerError, Workload, free_port, last_line, log, median, peers_home

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendor/llama.cpp we build
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
THREADS = 2
QUANTIZE_TYPE = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}  # llama-quantize's names
PRECISIONS = tuple(QUANTIZE_TYPE)


def home() -> Path:
    path = peers_home() / "llama.cpp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def binary(name: str) -> Path:
    return home() / "build" / "bin" / name


def installed() -> bool:
    return all(binary(t).is_file() for t in TARGETS)


def missing_reason() -> str:
    return f"not built (run with --install; needs {', '.join(t for t in TARGETS if not binary(t).is_file())})"


def install() -> None:
    """pip download the sdist, unpack, cmake configure + build the four tools with -j2 (tens of minutes on 2 cores)."""
    root = home()
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        log(f"downloading the llama-cpp-python {VERSION} sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(root)], check=True)
    tree = root / f"llama_cpp_python-{VERSION}"
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    build = root / "build"
    configure = ["cmake", "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), "-DGGML_NATIVE=ON",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    start = time.monotonic()
    subprocess.run(configure, check=True)
    subprocess.run(["cmake", "--build", str(build), "-j2", "--target", *TARGETS], check=True)
    log(f"llama.cpp built in {time.monotonic() - start:.0f}s")


def stored_precision(source: Path) -> str | None:
    """The precision a GGUF file stores (its ``general.file_type``, gguf's ``LlamaFileType``: ALL_F32, MOSTLY_Q4_0,
    ...), None where it is none of ``PRECISIONS``."""
    from gguf import LlamaFileType

    from twophase.loader.gguf_reader import gguf_field, open_gguf

    try:
        name = LlamaFileType(gguf_field(open_gguf(source), "general.file_type")).name
    except ValueError:  # absent or unknown
        return None
    precision = name.split("_", 1)[1].lower()
    return precision if precision in PRECISIONS else None


def variant(source: Path, precision: str) -> Path:
    """The GGUF file of ``precision``: ``source`` itself where it stores that precision (the store's Q4_1 file for
    q4_1), else made from it with llama-quantize once."""
    if stored_precision(source) == precision:
        return source
    out = home() / "models" / f"{source.stem.rsplit('.', 1)[0]}.{QUANTIZE_TYPE[precision]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        log(f"llama-quantize --allow-requantize {source.name} -> {out.name}")
        proc = subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(source), str(tmp),
                               QUANTIZE_TYPE[precision], str(THREADS)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize {precision} failed: {proc.stderr.strip().splitlines()[-1:]}")
        tmp.rename(out)
    return out


def bench_pp_tg(model: Path, pp: int, tg: int, repeats: int) -> dict[str, float]:
    """llama-bench ``-p pp -n tg -r repeats``: medians of its per-repeat samples (tok/s)."""
    proc = subprocess.run([str(binary("llama-bench")), "-m", str(model), "-t", str(THREADS), "-p", str(pp),
                           "-n", str(tg), "-r", str(repeats), "-o", "json"], capture_output=True, text=True, check=True)
    out: dict = {}
    for test in json.loads(proc.stdout):
        key = "pp" if test["n_prompt"] and not test["n_gen"] else "tg"
        out[key] = median(test["samples_ts"])
        out.setdefault("runs", {})[key] = test["samples_ts"]
    return out


def bench_batched(model: Path, npp: int, ntg: int, npl: int, repeats: int) -> dict:
    """llama-batched-bench ``-npp -ntg -npl`` (prompts not shared), ``repeats`` runs: median S_TG and S_PP."""
    ctx = npl * (npp + ntg) + 256
    stg, spp = [], []
    for _ in range(repeats):
        proc = subprocess.run([str(binary("llama-batched-bench")), "-m", str(model), "-t", str(THREADS), "-tb",
                               str(THREADS), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg",
                               str(ntg), "-npl", str(npl), "--output-format", "jsonl"],
                              capture_output=True, text=True, check=True)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        stg.append(rows[-1]["speed_tg"])
        spp.append(rows[-1]["speed_pp"])
    return {"batch": median(stg), "batch_pp": median(spp), "runs": {"batch": stg, "batch_pp": spp}}


def server(model: Path, workload: Workload) -> Server:
    """llama-server (continuous batching, one slot per concurrent request of ``workload``) on a free loopback port."""
    port = free_port()
    slot_ctx = workload.input_len * 2 + workload.output_len + 64  # random lengths may exceed the nominal input
    argv = [str(binary("llama-server")), "-m", str(model), "--host", HOST, "--port", str(port),
            "-t", str(THREADS), "-tb", str(THREADS), "-np", str(workload.concurrency),
            "-c", str(slot_ctx * workload.concurrency), "--alias", "model", "--no-webui"]
    return Server("llama-server", argv, port)


def guarded(row: str, precision: str, failed: dict, run: Callable[[], dict]) -> dict:
    """``run()``, or {} with the reason kept in ``failed`` when the tool fails (e.g. a build whose batched path
    uses instructions this CPU refuses: the other rows still count)."""
    try:
        return run()
    except (subprocess.CalledProcessError, ServerError, RuntimeError) as exc:
        if isinstance(exc, subprocess.CalledProcessError):
            code = exc.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            reason = f"{Path(str(exc.cmd[0])).name} {how}"
        else:
            reason = last_line(exc)
        log(f"llama.cpp {precision} {row} failed: {reason}")
        failed[row] = reason
        return {}


def bench(source: Path, precision: str, shapes: dict, repeats: int) -> dict:
    """Every llama-bench / llama-batched-bench row for one precision, each on its own (a row whose tool fails is left
    out, its reason in ``failed_rows``); S1's server is ``server``."""
    model = variant(source, precision)
    failed: dict[str, str] = {}
    out: dict = {"runs": {}, "weight_bytes": model.stat().st_size, "file": model.name}
    log(f"llama.cpp {precision}: llama-bench tg{shapes['tg']}, then pp{shapes['pp']}")
    for row, (pp, tg) in {"tg": (0, shapes["tg"]), "pp": (shapes["pp"], 0)}.items():
        got = guarded(row, precision, failed, lambda: bench_pp_tg(model, pp, tg, repeats))
        out["runs"].update(got.pop("runs", {}))
        out.update(got)
    log(f"llama.cpp {precision}: llama-batched-bench npp {shapes['npp']} ntg {shapes['ntg']} npl {shapes['npl']}")
    batched = guarded("batch", precision, failed,
                      lambda: bench_batched(model, shapes["npp"], shapes["ntg"], shapes["npl"], repeats))
    out["runs"].update(batched.pop("runs", {}))
    out.update(batched)
    log(f"  llama.cpp {precision}: " + ", ".join(f"{k} {out[k]:.1f}" for k in ("tg", "pp", "batch") if k in out))
    if failed:
        out["failed_rows"] = failed
    return out
