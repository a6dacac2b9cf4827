"""The engine for servers: the step loop runs in a background thread; each request gets an async stream.

Requests are validated on the caller's side (``LLMEngine.make_request`` touches no state), then handed to the
loop thread, which alone mutates the engine. Outputs travel back through ``loop.call_soon_threadsafe``, one call a
step.
The loop never spins: with nothing to run, or after a step that scheduled nothing, it sleeps on an event that
every command (add, abort, call, shutdown) sets.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, TypeVar

from twophase.engine.llm_engine import LLMEngine
from twophase.outputs import EngineStats, RequestOutput, StepRecord
from twophase.request import Request
from twophase.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


def build_off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` (an engine's construction) on a thread that ends when it returns, its exception re-raised here.

    OpenMP keeps a team of worker threads for every thread that opened a parallel region, for as long as that
    thread lives. Built on the main thread, an engine leaves the main thread's team behind when the step loop opens
    its own; libgomp then counts more threads than CPUs and its workers sleep after ~100 spins, so every parallel
    region of a step pays a futex wake-up. Measured on 2 cores: a small GEMM (8 x 576 @ 576 x 3,072) took 155 us on
    the thread that built everything and 268 us on a second thread after it, 160 us after a finished helper thread.
    """
    result: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            result["value"] = build()
        except BaseException as exc:  # noqa: BLE001 — re-raised on the caller's thread
            result["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name="twophase-build")
    thread.start()
    try:
        done.wait()
    except KeyboardInterrupt:  # a build cannot stop midway: let it finish, then stop. (An interrupted Thread.join
        done.wait()  # marks the thread stopped while it runs: the process then exited under it and aborted.)
        raise
    finally:
        thread.join()  # gone, and its OpenMP team with it, before the caller opens parallel regions
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


class EngineDeadError(RuntimeError):
    """The step loop stopped on an internal error; the server should report 500 and restart."""


class StatLogger(Protocol):
    """Receives every step's record, the outputs that finished in it, and a stats snapshot (loop thread)."""

    def record(self, step: StepRecord | None, finished: list[RequestOutput], stats: EngineStats) -> None: ...


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class AsyncLLM:
    """Owns an LLMEngine and its step-loop thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stat_loggers: list[StatLogger] = []
        self._beat_time = time.monotonic()  # when the loop last started an iteration
        self._parked = False  # True while the loop sleeps on _wakeup with nothing to do
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._num_pending = 0  # accepted, not yet in the scheduler's queue (guarded by _pending_lock)
        self._pending_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="twophase-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the step loop (and stop it, with an error, if a tensor-parallel worker exits)."""
        self._thread.start()
        self.engine.watch_workers(lambda exc: self.call_in_loop(_raiser(exc)))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (in-flight requests are aborted) and join the thread."""
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and healthy."""
        return self._thread.is_alive() and self._error is None

    @property
    def last_loop_time(self) -> float:
        """The loop's heartbeat: the start of its current iteration, or now while it sleeps idle (a parked loop
        wakes on the next command, so it is not stale)."""
        return time.monotonic() if self._parked else self._beat_time

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._streams)

    # ---- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        detokenize: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step for this request. Validation errors raise before the first yield;
        leaving the iterator early (client gone) aborts the request."""
        request = self.make_request(prompt, params, request_id, cache_salt)
        async for output in self.stream_outputs(request_id, self.submit(request, detokenize)):
            yield output

    async def stream_outputs(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield a submitted request's outputs until it finishes (re-raising engine errors); leaving early
        (client gone, task cancelled) aborts the request."""
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def make_request(
        self, prompt, params: SamplingParams, request_id: str, cache_salt: str | None = None, num_ahead: int = 0
    ) -> Request:
        """Validate (raises InvalidRequestError / QueueFullError) without queuing. ``num_ahead``: requests of the
        same call validated before this one and not yet submitted."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        return self.engine.make_request(prompt, params, request_id, cache_salt, num_ahead=self._num_pending + num_ahead)

    def submit(self, request: Request, detokenize: bool = True) -> asyncio.Queue:
        """Hand a validated request to the loop; returns the queue its outputs arrive on."""
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        with self._pending_lock:
            self._num_pending += 1
        self._commands.put(("add", (request, detokenize)))
        self._wakeup.set()
        return stream.queue

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its blocks are freed at the loop's next iteration."""
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def call_in_loop(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run ``fn(engine)`` on the loop thread between steps (e.g. a prefix-cache reset)."""
        self._commands.put(("call", fn))
        self._wakeup.set()

    # ---- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat_time = time.monotonic()
                self._apply_commands()
                if not self.engine.has_unfinished_requests() or not self._step_once():
                    if not self.engine.idle_work():  # else: check for commands again after a short piece
                        self._sleep_until_woken()
            self._abort_all()
        except BaseException as exc:  # noqa: BLE001 — surfaced to every waiting stream
            logger.exception("engine loop failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"engine loop failed: {exc!r}"))

    def _sleep_until_woken(self) -> None:
        """Block (no timeout, no polling) until a command or shutdown sets the wakeup event."""
        self._parked = True
        self._wakeup.wait()
        self._wakeup.clear()  # commands put before this are applied next iteration
        self._parked = False

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._emit_abort(arg)
            else:
                arg(self.engine)

    def _add(self, request: Request, detokenize: bool) -> None:
        try:
            if request.request_id in self._streams:  # else: aborted before it reached the loop
                self.engine.enqueue(request, detokenize=detokenize)
        except Exception as exc:  # noqa: BLE001 — reported on the request's own stream
            self._deliver([(request.request_id, exc)])
        finally:
            with self._pending_lock:
                self._num_pending -= 1  # only now is it counted in the waiting queue

    def _emit_abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver([(request_id, output)])
            self._log(None, [output])

    def _step_once(self) -> bool:
        """Run one engine step and deliver its outputs; False when the step scheduled nothing (no record)."""
        previous = self._last_record()
        outputs = self.engine.step()
        self._deliver([(output.request_id, output) for output in outputs])
        step = self._last_record()
        step = step if step is not previous else None  # identity: the record ring is bounded
        self._log(step, [o for o in outputs if o.finished])
        return step is not None or bool(outputs)

    def _last_record(self) -> StepRecord | None:
        records = self.engine.step_records
        return records[-1] if records else None

    def _log(self, step: StepRecord | None, finished: list[RequestOutput]) -> None:
        if self.stat_loggers:
            stats = self.engine.stats()
            for logger in self.stat_loggers:
                logger.record(step, finished, stats)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Put each (request id, output or error) on its stream, one ``call_soon_threadsafe`` per event loop for the
        lot: a step's outputs wake the server's loop once, not once a request. (32 wake-ups a step had the loop
        thread preempt the step thread that woke it ~14 times a step: ~300 involuntary switches a second.)"""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or getattr(item, "finished", False):
                self._streams.pop(request_id, None)
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._emit_abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        self._deliver([(request_id, exc) for request_id in list(self._streams)])


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    """On an event loop: each item onto its queue, in order."""
    for stream_queue, item in batch:
        stream_queue.put_nowait(item)


def _raiser(exc: BaseException) -> Callable[[LLMEngine], None]:
    """A loop command that fails the loop with ``exc``."""

    def fail(engine: LLMEngine) -> None:
        raise exc

    return fail
