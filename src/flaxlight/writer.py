"""``BackgroundWriter``: one thread that runs file writes in order, off the training thread.

Jobs run in the order they were queued. A failed job is kept and raised on the caller's thread
at the next :meth:`~BackgroundWriter.raise_failure_as` or :meth:`~BackgroundWriter.flush`; the
jobs queued after it are dropped (so nothing deletes old files after a write failed). Jobs
queued as *throttled* wait until the writer's work stays under ``max_overhead`` of the wall
time (a job of ``d`` seconds is followed by ``d / max_overhead`` seconds without throttled
work; a throttled job that returns a number says that many of its seconds were a one-time
set-up, which the pause leaves out); a flush runs everything at once. A job not started yet can be withdrawn
(:meth:`~BackgroundWriter.withdraw`). The thread ends when the queue has been empty for
``idle_seconds`` (starting a thread per job would cost more than most jobs) and starts again
with the next job, so an idle writer holds no thread; jobs still queued when the interpreter
exits are run (unthrottled) before it ends, and an idle thread ends at once then. A *lazy* job
(a log record) is queued without waking the thread: it is written with the next job that wakes
it, at a flush, or within ``idle_seconds``.

Examples:
    >>> writer = BackgroundWriter("demo")
    >>> done = []
    >>> job = writer.submit(done.append, 1)
    >>> writer.flush(); done
    [1]
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Any, Callable, Iterable

__all__ = ["BackgroundWriter", "Job"]

_LIVE: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()
_exiting = threading.Event()  # the interpreter is exiting: idle threads end at once


class Job:
    """A queued call: ``fn(*args)`` with a ``tag`` (any value the caller uses to find it again)."""

    def __init__(self, fn: Callable, args: tuple, tag: Any, throttled: bool):
        self.fn, self.args, self.tag, self.throttled = fn, args, tag, throttled

    def __repr__(self) -> str:
        return f"Job({getattr(self.fn, '__name__', self.fn)}, tag={self.tag!r})"


class BackgroundWriter:
    """Run jobs in order on one background thread; see the module docstring."""

    idle_seconds = 1.0  # how long an idle thread waits for more work before it ends

    def __init__(self, name: str, max_overhead: float | None = None):
        self.name, self.max_overhead = name, max_overhead
        self._queue: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._thread: threading.Thread | None = None
        self._changed = threading.Condition()
        self._flushing = 0
        self._held_by_caller = 0  # while run_here runs the queue on its caller's thread, this one starts no job
        self._failure: BaseException | None = None
        self._quiet_until = 0.0  # throttled jobs wait until then (monotonic seconds)
        self.last_duration: float | None = None  # seconds the latest throttled job took (its set-up left out)
        _LIVE.add(self)

    # ------------------------------------------------------------------ the caller's side
    def submit(self, fn: Callable, *args: Any, tag: Any = None, throttled: bool = False, lazy: bool = False) -> Job:
        """Queue ``fn(*args)`` behind the jobs already queued. A ``lazy`` job does not wake the
        writer: it runs with the next job that does, at a flush, or at the latest
        ``idle_seconds`` later (many small jobs then cost the caller one thread wake-up)."""
        job = Job(fn, args, tag, throttled)
        with self._changed:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"flaxlight-{self.name}")
                self._thread.start()
            if not lazy:
                self._changed.notify_all()
        return job

    def pending(self) -> list[Job]:
        """The jobs queued and not started, oldest first."""
        with self._changed:
            return list(self._queue)

    def withdraw(self, jobs: Iterable[Job]) -> list[Job]:
        """Take ``jobs`` out of the queue if they have not started; returns those taken out."""
        wanted = {id(job) for job in jobs}
        with self._changed:
            taken = [job for job in self._queue if id(job) in wanted]
            self._queue = collections.deque(job for job in self._queue if id(job) not in wanted)
            return taken

    def insert_after(self, anchor: Job, jobs: list[Job]) -> bool:
        """Move ``jobs`` (queued already, or new) right behind ``anchor`` if it has not started."""
        with self._changed:
            rest = [job for job in self._queue if all(job is not j for j in jobs)]
            if all(job is not anchor for job in rest):
                return False
            at = next(i for i, job in enumerate(rest) if job is anchor) + 1
            self._queue = collections.deque(rest[:at] + list(jobs) + rest[at:])
            return True

    def hold_off(self, seconds: float) -> None:
        """Keep throttled jobs waiting for at least ``seconds`` from now (unless flushed)."""
        with self._changed:
            self._quiet_until = max(self._quiet_until, time.monotonic() + seconds)

    @property
    def busy(self) -> bool:
        """Whether a job is running or queued, or throttled work would have to wait now."""
        with self._changed:
            return bool(self._running or self._queue) or (
                self.max_overhead is not None and time.monotonic() < self._quiet_until)

    def wait_until(self, condition: Callable[[], bool]) -> None:
        """Block until ``condition()`` (checked whenever a job ends); throttling is lifted meanwhile."""
        with self._changed:
            self._flushing += 1
            self._changed.notify_all()
            try:
                while not condition() and (self._running or self._queue):
                    self._changed.wait()
            finally:
                self._flushing -= 1

    def wait_for(self, job: Job) -> None:
        """Block until ``job`` has run, or left the queue unrun (withdrawn, or dropped behind a
        failed job); from any thread. Throttling is lifted meanwhile, as by :meth:`wait_until`."""
        self.wait_until(lambda: self._running is not job and all(queued is not job for queued in self._queue))

    def flush_as(self, error: Callable[[BaseException], BaseException] | None = None) -> None:
        """Run every queued job now (throttling lifted); raise a job's failure as ``error(failure)``."""
        self.wait_until(lambda: False)
        self.raise_failure_as(error)

    def flush(self) -> None:
        """Run every queued job now (throttling lifted); raise if a job failed."""
        self.flush_as()

    def run_here(self) -> None:
        """What :meth:`flush` does, on the calling thread: once the job running (if any) has ended,
        the queued jobs run there, in order, the writer's thread starting none meanwhile, without
        waking it and waiting for it (two thread hand-offs: ~0.2 ms of each new best's save on the
        tiny MLP). Raises a failure, the writer's earlier one or a job's here (the jobs behind it
        are not run); interrupted (Ctrl-C), it leaves the job it was in and the rest to the writer's
        thread. For a writer without ``max_overhead``: the jobs' durations are not counted.

        Examples:
            >>> writer = BackgroundWriter("notes")
            >>> done = []
            >>> _ = writer.submit(done.append, "a", lazy=True)
            >>> writer.run_here()
            >>> done
            ['a']
        """
        self.raise_failure_as()
        with self._changed:
            self._held_by_caller += 1
        try:
            with self._changed:
                while self._running is not None:
                    self._changed.wait()
            while True:
                with self._changed:
                    if not self._queue:
                        return
                    job = self._queue.popleft()
                try:
                    job.fn(*job.args)
                except Exception:
                    with self._changed:
                        self._queue.clear()  # as after the writer's own failure: nothing behind it runs
                    raise
                except BaseException:  # an interrupt: the writer's thread runs the job again, then the rest
                    with self._changed:
                        self._queue.appendleft(job)
                    raise
        finally:
            with self._changed:
                self._held_by_caller -= 1
                self._changed.notify_all()

    def raise_failure_as(self, error: Callable[[BaseException], BaseException] | None = None) -> None:
        """Raise the failure of a job (once), if one failed, as ``error(failure)`` (default: the
        failure itself); the jobs queued behind it are dropped."""
        if self._failure is None:
            return
        self.wait_until(lambda: False)  # the jobs behind the failed one are dropped, not run
        with self._changed:
            exc, self._failure = self._failure, None
        if exc is not None:
            if error is None:
                raise exc
            raise error(exc) from exc

    # ------------------------------------------------------------------ the writer's side
    def _next_job(self) -> Job | None:
        with self._changed:
            idle_since = time.monotonic()
            while True:
                if not self._queue:
                    idle = time.monotonic() - idle_since
                    if idle < self.idle_seconds and not _exiting.is_set():
                        self._changed.wait(timeout=self.idle_seconds - idle)
                        continue
                    self._thread = None  # idle: the thread ends; the next submit starts one
                    self._changed.notify_all()
                    return None
                if self._held_by_caller:
                    self._changed.wait()
                    continue
                job = self._queue[0]
                wait = self._quiet_until - time.monotonic()
                if job.throttled and self.max_overhead is not None and wait > 0 and not self._flushing:
                    self._changed.wait(timeout=wait)
                    continue
                self._running = self._queue.popleft()
                return self._running

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            start, set_up = time.monotonic(), 0.0
            try:
                if self._failure is None:  # after a failure, the jobs behind it are dropped
                    result = job.fn(*job.args)
                    set_up = float(result) if isinstance(result, (int, float)) and not isinstance(result, bool) else 0.0
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._failure = exc
            finally:
                with self._changed:
                    if job.throttled:  # the pause follows the job's own work, not a one-time set-up
                        self.last_duration = max(time.monotonic() - start - set_up, 0.0)
                        if self.max_overhead:
                            self._quiet_until = start + set_up + self.last_duration / self.max_overhead
                    self._running = None
                    self._changed.notify_all()


def _finish_queued_jobs() -> None:
    """At interpreter exit, before its threads are joined: throttled jobs run at once, idle
    threads end."""
    _exiting.set()
    for writer in list(_LIVE):
        with writer._changed:
            writer._flushing += 1
            writer._changed.notify_all()


# Runs before the interpreter joins non-daemon threads (as concurrent.futures does); plain
# atexit as a fallback runs after that join (a throttled job then waits out its pause).
getattr(threading, "_register_atexit", atexit.register)(_finish_queued_jobs)
