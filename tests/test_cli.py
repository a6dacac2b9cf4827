"""`twophase generate` and `twophase chat` as a user runs them (a real subprocess on the tiny model)."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "twophase.cli", *args], input=stdin, capture_output=True, text=True, timeout=180
    )


def test_generate_streams_text_then_phase_summary(tiny_llama_dir):
    result = run_cli("generate", "--model", str(tiny_llama_dir), "--temperature", "0", "--max-tokens", "8", "hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # the generated text
    summary = [line for line in result.stderr.splitlines() if line.startswith("[prompt")]
    assert len(summary) == 1
    assert "cached 0" in summary[0] and "TTFT" in summary[0] and "tok/s" in summary[0] and "finish" in summary[0]


def test_generate_raw_and_templated_prompts_differ(tiny_llama_dir):
    base = ["generate", "--model", str(tiny_llama_dir), "--temperature", "0", "--max-tokens", "4", "hello"]
    templated, raw = run_cli(*base), run_cli(*base, "--raw")
    assert templated.returncode == raw.returncode == 0
    prompt_len = [int(r.stderr.split("[prompt ")[1].split(" ")[0]) for r in (templated, raw)]
    assert prompt_len[0] > prompt_len[1]  # the chat template adds its role markers


def test_chat_keeps_the_conversation(tiny_llama_dir):
    result = run_cli("chat", "--model", str(tiny_llama_dir), "--temperature", "0", "--max-tokens", "4",
                     stdin="hello\nand again\n\n")  # fmt: skip
    assert result.returncode == 0, result.stderr
    summaries = [line for line in result.stderr.splitlines() if line.startswith("[prompt")]
    assert len(summaries) == 2
    first, second = (int(s.split("[prompt ")[1].split(" ")[0]) for s in summaries)
    assert second > first  # the second turn carries the first turn and its reply


def test_a_command_imports_only_the_modules_it_needs():
    """generate/chat/pull register none of the other command modules (the bench client's imports alone cost ~0.3 s
    of start-up); a module's own commands get it; help and typos get every command."""
    script = (
        "import sys\n"
        "from twophase.cli import build_parser\n"
        "build_parser(['generate', 'hi'])\n"
        "assert 'twophase.bench.cli' not in sys.modules and 'httpx' not in sys.modules, 'generate imported bench'\n"
        "build_parser(['calibrate', '--help'])\n"
        "assert 'twophase.sim.cli' in sys.modules and 'twophase.server.cli' not in sys.modules\n"
        "names = build_parser(['--help'])._subparsers._group_actions[0].choices\n"
        "assert {'serve', 'proxy', 'bench', 'estimate', 'report', 'sim', 'calibrate'} <= set(names), names\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_start_up_runs_without_the_collector_and_leaves_it_on(tiny_llama_dir):
    """Importing and building the engine make no collector pass (each walks every object start-up made); afterwards
    the collector is on again, with start-up's objects frozen out of its passes."""
    script = (
        "import gc, sys\n"
        "from twophase import cli\n"
        "passes = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and passes.append(info['generation']))\n"
        "with cli.collector_paused(freeze=True):  # as the console entry point runs a command\n"
        "    args = cli.build_parser(['generate', 'hi']).parse_args(['generate', '--model', sys.argv[1], 'hi'])\n"
        "    args.own_process = True\n"
        "    llm = cli.load_llm(args)\n"
        "    assert not gc.isenabled()\n"
        "assert passes == [], passes\n"
        "assert gc.isenabled() and gc.get_freeze_count() > 10000, gc.get_freeze_count()\n"
        "gc.collect()\n"
        "assert passes[-1] == 2, passes\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tiny_llama_dir)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_one_shot_commands_exit_fast_only_when_nothing_is_left_running():
    """The early exit skips the interpreter's teardown; it must not cut off a thread that is still working."""
    import threading

    from twophase.cli import _nothing_left_running

    release = threading.Event()
    worker = threading.Thread(target=release.wait)  # a non-daemon thread, as a writer would be
    worker.start()
    try:
        assert not _nothing_left_running()
    finally:
        release.set()
        worker.join()
    assert _nothing_left_running()


def test_a_failing_one_shot_command_still_prints_its_error_and_status(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "hello")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("twophase: error:")
