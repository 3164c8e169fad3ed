"""Where the loop is and when it must look up: loop state, running log, events, signals, limits.

Small objects that answer questions and return values; the trainer acts on the answers.

Examples:
    >>> schedule = EventSchedule()
    >>> schedule.plan(step=0, intervals=[50, 200], max_steps=None)
    50
    >>> schedule.due(50, step=50, steps=1), schedule.due(200, step=50, steps=1)
    (True, False)
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Mapping

from flaxlight.data import is_iterator
from flaxlight.messages import logger as messages
from flaxlight.metrics import HostSnapshot, finite_now, to_host

__all__ = ["LoopState", "RunningLog", "EventSchedule", "SignalGuard", "Interrupted", "BatchLimits", "RunPlan",
           "RunSoFar", "NonfiniteTally", "limit_batches", "epoch_length", "loader_length", "warn_if_loader_ran_short"]


class RunningLog:
    """Interval means of the train metrics at log points, read one log point late.

    :meth:`mark` starts copying the sums at a log point and returns the previous point's
    ``(step, means, nonfinite)`` (a list, empty at the first point of an epoch), whose copy has
    had a whole log interval to arrive: the training thread rarely waits, and callbacks hear of
    each log point at the same moment in every run. :meth:`flush` returns the pending point now.

    Each point's wall time (``time.perf_counter()`` on the host, or ``clock``; no added device wait)
    is when its step was done, as far as the host can tell. A point still running when the next
    point flushes it (asynchronous dispatch: the device ran behind) is timed when reading its values
    returns. One found done then is timed at its mark (the host ran behind the device), unless the
    device may still have been on earlier steps at its mark: after a point whose read waited, it is
    timed at the device's pace after the point before (then the next one, until a point's time falls
    on its mark: the device has caught up), never before its mark nor after it was found done. The
    device's pace (seconds per step) is measured between two points whose reads both waited (the
    device worked through that interval); an estimate never changes it. Reads that do not wait show
    a device faster than the host, so the pace used is at most half the host's time per step, from
    the point before to when this one was found done (with no pace measured yet, that half: the
    point is timed halfway), and the times come back to the marks. :meth:`finished_at` answers it
    while the point is delivered: rates computed from it cover the steps they are labelled with, not
    the time the values took to arrive (timing such a point at its mark made its interval a few
    microseconds long, its rate 100-1000x too high; timing each one when found done made an epoch's
    last interval a step long).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flaxlight.metrics import accumulate, init_accumulator
        >>> log = RunningLog()
        >>> acc = accumulate(init_accumulator({"loss": jnp.float32(0)}), {"loss": jnp.float32(2.0)}, 4)
        >>> log.mark(1, acc)
        []
        >>> [(step, means) for step, means, _ in log.flush()], log.finished_at(1) is not None
        ([(1, {'train/loss_step': 2.0})], True)
    """

    def __init__(self, prefix: str = "train/", suffix: str = "_step", *, clock: Callable[[], float] | None = None):
        self.prefix, self.suffix = prefix, suffix
        self._clock = time.perf_counter if clock is None else clock  # seconds, the host's
        self.reset()

    def reset(self) -> None:
        """A new epoch: the sums start from zero again."""
        self.pending: collections.deque[tuple[int, HostSnapshot, float]] = collections.deque()
        self.last_sums: dict[str, float] = {}
        self.last_count = 0.0
        self._delivered: dict[int, float] = {}  # step -> wall time it was done, of the points last returned
        self._clear_timing()

    def _clear_timing(self) -> None:
        self._last: tuple[int, float, bool] | None = None  # (step, done, its read waited) of the newest point timed
        self._pace: float | None = None  # the device's seconds per step, between two points whose reads waited
        self._catch_up: float | None = None  # the pace the device is taken to catch up at (None: it is not behind)

    def mark(self, step: int, acc: dict | HostSnapshot, at: float | None = None) -> list[tuple[int, dict[str, float], int]]:
        """Start copying ``acc`` (or take its snapshot); return the previous log point's values. ``at``:
        when the loop reached ``step`` (a point noted earlier: :attr:`EventSchedule.notes`), else now."""
        arrived = self.flush(now=at)
        snapshot = acc if isinstance(acc, HostSnapshot) else HostSnapshot(acc)
        self.pending.append((step, snapshot, self._clock() if at is None else at))
        return arrived

    def would_wait(self) -> bool:
        """Whether :meth:`mark` or :meth:`flush` would wait now for a pending point's step (asks only)."""
        return not all(snapshot.ready() for _, snapshot, _ in self.pending)

    def flush(self, now: float | None = None) -> list[tuple[int, dict[str, float], int]]:
        """The pending log point's values, now (waits for its copy). ``now``: the time of the
        next point when it was noted earlier (a copy found done was done by then, unless the
        device was behind the point before: then, as without it, the time it is found done)."""
        arrived, finished = [], {}
        for step, snapshot, marked in self.pending:
            if snapshot.ready():  # done by now: at its mark, unless the device ran behind (see the class)
                seen = now if now is not None and (self._last is None or now > self._last[1]) else self._clock()
                done = self._caught_up(step, marked, seen)
                arrived.append(self._read(step, snapshot))
            else:  # it finishes as the read returns
                arrived.append(self._read(step, snapshot))
                done = self._waited(step, self._clock())
            finished[step] = done
        if finished:
            self._delivered = finished
        self.pending.clear()
        return arrived

    def _waited(self, step: int, done: float) -> float:
        """Note the point of ``step`` whose read waited until ``done``; return ``done``."""
        if self._last is not None and self._last[2] and step > self._last[0]:  # the device worked throughout
            self._pace = (done - self._last[1]) / (step - self._last[0])
        self._last, self._catch_up = (step, done, True), None
        return done

    def _caught_up(self, step: int, marked: float, seen: float) -> float:
        """When the point of ``step``, marked at ``marked`` and found done at ``seen``, was done:
        at its mark, or, while the device is behind, at its pace after the point before."""
        last = self._last
        if last is None or not (last[2] or self._catch_up is not None) or step <= last[0]:
            done = marked
        else:
            if self._catch_up is None:  # the first point found done after one whose read waited
                half = (seen - last[1]) / (2 * (step - last[0]))
                self._catch_up = half if self._pace is None else min(self._pace, half)
            done = min(seen, max(marked, last[1] + self._catch_up * (step - last[0])))
        if done <= marked:  # the device had caught up
            self._catch_up = None
        self._last = (step, done, False)
        return done

    def finished_at(self, step: int) -> float | None:
        """``time.perf_counter()`` when the log point at ``step`` was done (see the class), for
        the points the last :meth:`mark` / :meth:`flush` returned (None for another step)."""
        return self._delivered.get(step)

    def state_dict(self) -> dict:
        return {"last_sums": self.last_sums, "last_count": self.last_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending.clear()
        self._clear_timing()
        self.last_sums = dict(state.get("last_sums", {}))
        self.last_count = float(state.get("last_count", 0.0))

    def _read(self, step: int, snapshot: HostSnapshot) -> tuple[int, dict[str, float], int]:
        sums, count, nonfinite = snapshot.sums_and_count()
        examples = count - self.last_count
        means = {}
        if examples > 0:
            means = {f"{self.prefix}{name}{self.suffix}": (total - self.last_sums.get(name, 0.0)) / examples
                     for name, total in sums.items()}
            self.last_sums, self.last_count = sums, count
        return step, means, nonfinite


@dataclasses.dataclass
class LoopState:
    """Where the loop is: what a checkpoint must hold to continue exactly from here."""

    running_log: RunningLog = dataclasses.field(default_factory=RunningLog)
    epoch: int = 1
    phase: str = "epoch_end"  # "train" (mid-epoch), "val" (training done), "epoch_end"
    batch_index: int = 0
    acc: Any = None
    train_metrics: dict = dataclasses.field(default_factory=dict)
    validated: bool = False  # the epoch's validation ran (phase "val": the epoch is not over yet)
    validated_step: int | None = None  # the step of the last validation: never two at one step
    loader_position: Any = None  # after a resume mid-epoch: where a stateful loader continues
    cut: bool = False  # the epoch ended before its last batch (max_steps, stop()): a resume continues it
    owed_events: list = dataclasses.field(default_factory=list)  # this step's events not run yet ("log", "val", "callbacks")
    owed_steps: int = 1  # the updates those events cover (a fused block's)
    epochs_before: int = 0  # the model's training epochs before this run: the data order goes on from them
    resumed_epoch_length: int | None = None  # after a resume: the batches per epoch of the run resumed
    resumed_from: int | None = None  # after a resume: the checkpoint's step (the state, its random keys too, is its)

    @classmethod
    def fresh(cls, state: Any) -> "LoopState":
        """A new run's loop for the model in ``state`` (a ``TrainState``): its data epochs go on
        from the epochs the model has trained (``state.epoch``)."""
        epochs = getattr(state, "epoch", None)
        return cls(epochs_before=0 if epochs is None else int(to_host(epochs)))

    @property
    def model_epoch(self) -> int:
        """The epoch counted over the model's training (this run's ``epoch`` after the epochs it
        trained in earlier ``train_model`` calls): what ``set_epoch`` gets, so a second call on the
        same trainer goes on to new orders instead of replaying the first call's."""
        return self.epochs_before + self.epoch

    def take_loader_position(self) -> Any:
        """The resumed loader position, once (the epoch after it starts from the beginning)."""
        position, self.loader_position = self.loader_position, None
        return position

    def take_stream_skip(self) -> int:
        """After a resume, once: the batches the run's epochs before this one took (a stream, which
        is not restarted between epochs, passes over them; see ``Engine.feed``); else 0."""
        length, self.resumed_epoch_length = self.resumed_epoch_length, None
        return (self.epoch - 1) * (length or 0)

    def start_epoch(self) -> None:
        """A fresh epoch (not the rest of one interrupted mid-way)."""
        self.phase, self.batch_index, self.acc, self.validated, self.cut = "train", 0, None, False, False
        self.owed_events = []
        self.running_log.reset()


class NonfiniteTally:
    """Host copy of how many steps had a non-finite loss, as of ``checked_step``, and where the
    first was first seen: between two reads of the device count (log points, validations, epoch
    ends), so no step pays a host sync for it."""

    def __init__(self):
        self.steps, self.checked_step, self.before_epoch = 0, 0, 0
        self.epoch, self.epoch_start = None, None  # this run's epoch and the step it began after
        self.first_seen: tuple | None = None  # the first's (after step, by step, epoch, the epoch's start step)
        self.said = False  # a non-finite loss with a finite state was said (once a run)

    def start_epoch(self, epoch: int | None = None, step: int | None = None) -> None:
        self.before_epoch, self.epoch, self.epoch_start = self.steps, epoch, step

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the tally (plain JSON), so that a resumed run's messages name the
        run's first non-finite step, as an uninterrupted run's do."""
        return {"steps": self.steps, "before_epoch": self.before_epoch, "checked_step": self.checked_step,
                "epoch": self.epoch, "epoch_start": self.epoch_start,
                "first_seen": list(self.first_seen) if self.first_seen is not None else None}

    def load_state_dict(self, saved: Any, step: int) -> None:
        """Take the :meth:`state_dict` of the checkpoint ``step``; one written before it
        (``[steps, before_epoch]``) gives the counts only: a first non-finite step is then said to be
        between step 1 and ``step``.

        Examples:
            >>> tally = NonfiniteTally(); tally.load_state_dict([3, 1], step=16); (tally.steps, tally.where_first())
            (3, 'between steps 1 and 16')
        """
        if not isinstance(saved, dict):
            self.steps, self.before_epoch = (int(n) for n in saved)
            self.first_seen = (0, step, None, None) if self.steps else None
            return
        self.steps, self.before_epoch, self.checked_step = saved["steps"], saved["before_epoch"], saved["checked_step"]
        self.epoch, self.epoch_start = saved["epoch"], saved["epoch_start"]
        self.first_seen = tuple(saved["first_seen"]) if saved["first_seen"] is not None else None

    def note(self, step: int, count_in_epoch: int) -> None:
        steps = max(self.steps, self.before_epoch + count_in_epoch)
        if steps > 0 and self.steps == 0:
            self.first_seen = (min(self.checked_step, step - 1), step, self.epoch, self.epoch_start)
        self.checked_step, self.steps = step, steps

    def now(self, loop: "LoopState") -> int:
        """Non-finite steps so far, reading the epoch's device count now (only when saving)."""
        current = int(to_host(loop.acc["totals"]).nonfinite) if loop.acc is not None and loop.phase == "train" else 0
        return max(self.steps, self.before_epoch + current)

    def _seen(self, loop: "LoopState", step: int | None) -> int:
        """:meth:`now`, noting where the first was seen when this read is the first to find one."""
        nonfinite = self.now(loop)
        if nonfinite > 0 and self.steps == 0 and self.first_seen is None and step is not None:
            self.first_seen = (min(self.checked_step, step - 1), step, self.epoch, self.epoch_start)
        return nonfinite

    def where_first(self) -> str:
        """Where the first non-finite step was seen, for people: ``at step 6 (epoch 1, batch 6)`` or
        ``between steps 1 and 14 (epoch 1, batches 1-14)`` (the count is read at log points and epoch ends only)."""
        if self.first_seen is None:  # counted before a resume
            return f"at or before step {self.checked_step}"
        after, by, epoch, epoch_start = self.first_seen
        where = f"at step {by}" if by == after + 1 else f"between steps {after + 1} and {by}"
        if epoch is not None and epoch_start is not None and after >= epoch_start:
            first, last = after + 1 - epoch_start, by - epoch_start
            where += f" (epoch {epoch}, batch {last})" if first == last else f" (epoch {epoch}, batches {first}-{last})"
        elif epoch is not None:
            where += f" (epoch {epoch})"
        return where

    def damage(self, loop: "LoopState", state: Any, guard: str | None = None, step: int | None = None,
               finite: bool | None = None) -> str | None:
        """Why ``state`` must not be checkpointed now, or None: its parameters, optimizer state or batch
        statistics hold NaN/Inf (one small device read, at save time only; ``finite``: that read, made
        already with the checkpoint's copy). A non-finite loss with a finite state does not stop the
        save: without a ``NaNGuard`` (``guard``, its action, which says its own) a warning says it once
        per run, with the count, where the first was seen (up to ``step``) and the likely cause (a bad
        batch)."""
        parts = [] if finite else nonfinite_parts(state)
        if parts:
            nonfinite = self._seen(loop, step)
            loss = f"; the loss was NaN/Inf in {nonfinite} step(s), the first {self.where_first()}" if nonfinite else ""
            return (f"the {' and the '.join(parts)} hold NaN/Inf{loss}, so the model is damaged (the training "
                    f"diverged: lower the learning rate, clip gradients, or check the data)")
        if guard is None and not self.said:
            nonfinite = self._seen(loop, step)
            if nonfinite > 0:
                self.said = True
                warnings.warn(
                    f"The loss was NaN/Inf in {nonfinite} step(s) of this run, the first {self.where_first()}, "
                    f"but the parameters and the optimizer state stayed finite, so checkpoints are saved. A finite "
                    f"model with a NaN loss usually means a bad batch: check the data for labels out of range "
                    f"(a class index >= num_classes) or NaN/Inf inputs. Those steps' NaN shows in the train means; "
                    f"trainer.nonfinite_steps counts them. NaNGuard(action='skip') leaves such steps out, "
                    f"NaNGuard() stops at the first (set log_every_n_steps=1 to see its exact step).",
                    RuntimeWarning, stacklevel=3)
        return None


def nonfinite_parts(state: Any) -> list[str]:
    """Which of ``state``'s parameters, optimizer state and batch statistics hold NaN/Inf (empty: none):
    one jitted reduction, and one per part only when it found one.

    Examples:
        >>> import types, jax.numpy as jnp
        >>> nonfinite_parts(types.SimpleNamespace(params={"w": jnp.ones(2)}, opt_state=(jnp.array([jnp.nan]),)))
        ['optimizer state']
    """
    named = {"parameters": getattr(state, "params", state), "optimizer state": getattr(state, "opt_state", None),
             "batch statistics": getattr(state, "batch_stats", None)}
    if bool(finite_now(tuple(named.values()))):
        return []
    return [name for name, part in named.items() if not bool(finite_now(part))]


# What to tell a user whose run was interrupted, when the caller knows better than "resume it" (tune).
RESUME_ADVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("flaxlight_resume_advice", default=None)


class Interrupted(Exception):
    """Raised inside the loop after a SIGTERM/SIGINT, once the current step has finished."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum

    def explain(self, step: int, epoch: int, checkpoints: str, log_dir: str | None,
                saved: Iterable[int] | None = None, unsaved: str | None = None) -> str:
        """What happened, what is on disk and how to resume, for the user (:data:`RESUME_ADVICE`
        when set). ``saved``: the steps of the checkpoints on disk now (None: step ``step``'s
        among them); ``unsaved``: why ``save_model`` refused to save step ``step``.

        Examples:
            >>> said = Interrupted(15).explain(45, 3, "run/checkpoints", "run", saved=[19, 38], unsaved="a NaN loss")
            >>> said.splitlines()[1][:75]
            'SIGTERM received: stopped after step 45 (epoch 3). No checkpoint of step 45'
            >>> "step 38: a resume continues from there" in said
            True
        """
        stopped = f"\n{signal.Signals(self.signum).name} received: stopped after step {step} (epoch {epoch})"
        if log_dir is None:
            return f"{stopped}; fast_dev_run saves no checkpoint."
        advice = RESUME_ADVICE.get() or (
            f"To resume, call train_model(..., resume=True) on this trainer (or, in a new session, build the same "
            f"trainer with logger_params={{'log_dir': {log_dir!r}}} and call it)." if self.keeps_session() else
            f"To resume, build the same trainer with logger_params={{'log_dir': {log_dir!r}}} and call "
            f"train_model(..., resume=True).")
        saved = None if saved is None else sorted(saved)
        if saved is None or step in saved:
            return f"{stopped} and saved a checkpoint in {checkpoints}.\n{advice}"
        kept = (f"The newest checkpoint in {checkpoints} is step {saved[-1]}: a resume continues from there."
                if saved else f"No checkpoint is in {checkpoints}: a resume starts a new run, from the "
                                 f"trainer's state as your script builds it.")
        return f"{stopped}. No checkpoint of step {step} was saved: {unsaved or 'save_model wrote none'}. {kept}\n{advice}"

    def keeps_session(self) -> bool:
        """Whether the session goes on after this interrupt: a SIGINT (Ctrl-C, Jupyter's stop
        button) in an interactive interpreter (:func:`interactive_session`). A SIGTERM is a request
        to end the process, and a script ends with its exit status, as documented."""
        return self.signum == signal.SIGINT and interactive_session()

    def stop(self) -> None:
        """End ``train_model`` after the interrupt's checkpoint: ``KeyboardInterrupt`` where the session
        goes on (:meth:`keeps_session`: the trainer and every variable stay, as Keras leaves them), else
        ``SystemExit(128 + signal)``: exit status 130 (SIGINT) or 143 (SIGTERM)."""
        if self.keeps_session():
            raise KeyboardInterrupt(f"{signal.Signals(self.signum).name}: train_model stopped (see the message "
                                    f"above); train_model(..., resume=True) on this trainer continues the run")
        raise SystemExit(128 + self.signum)


def interactive_session() -> bool:
    """Whether Python runs interactively, where an exit would end the user's session and its
    variables: a REPL (``python``, ``python -i``, :mod:`code`'s console: ``sys.ps1`` or
    ``sys.flags.interactive``) or an IPython / Jupyter shell (one running, seen in ``sys.modules``:
    IPython is never imported here).

    Examples:
        >>> interactive_session() == (hasattr(sys, "ps1") or bool(sys.flags.interactive))  # no IPython shell here
        True
    """
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    try:
        return get_ipython is not None and get_ipython() is not None
    except Exception:  # noqa: BLE001 - a half-imported or replaced module: not a shell
        return False


class EventSchedule:
    """The next step at which the hot loop must look up (one comparison per step), decided here.

    The loop looks up at ``next_step``: it stops there for the trainer's events (``next_stop``),
    or, at a log point that no one needs on time (:meth:`plan`'s ``notes_every``), it only notes
    the point in :attr:`notes` (``(step, HostSnapshot of the metric sums, time.perf_counter())``)
    and goes on; the trainer delivers the notes at the next stop. :meth:`looks_up` makes one at
    the first note :attr:`max_delay` seconds after the last delivery (the loggers stay live), and
    at a note whose previous note's step is not done yet (the host is a log interval ahead of the
    device: the stop's reads wait for it, as a stop at each log point did, which bounds the steps
    queued). A stop costs a small model's loop more than its work (the host runs the trainer's
    Python while the device waits); a note costs a list append. An interrupt sets ``next_step``
    to 0, so the loop looks up after the step in flight.

    Examples:
        >>> schedule = EventSchedule()
        >>> schedule.plan(step=0, intervals=[200], max_steps=None, notes_every=50)
        50
        >>> from flaxlight.metrics import Totals
        >>> sums = {"totals": Totals.zeros(["loss"])}  # the step's metric sums
        >>> schedule.looks_up(50, 1, sums), [step for step, _, _ in schedule.notes], schedule.next_step
        (False, [50], 100)
    """

    max_delay = 1.0  # seconds between deliveries of noted log points, at most (then the loop stops)

    def __init__(self):
        self.next_step = self.next_stop = 0
        self.interrupt_signal: int | None = None
        self.notes: list[tuple[int, HostSnapshot, float]] = []
        self.notes_every: int | None = None
        self.delivered_at = time.perf_counter()
        self._taken_at: tuple[int, float] | None = None  # (step, time) of a note at the step of the stop it made

    def plan(self, step: int, intervals: Iterable[int | None], max_steps: int | None,
             notes_every: int | None = None) -> int:
        """Set and return the first step after ``step`` at which the loop looks up: a multiple of
        any interval (a stop) or of ``notes_every`` (a log point noted without a stop), or
        ``max_steps``."""
        intervals = [n for n in intervals if n]
        next_stop = min(((step // n + 1) * n for n in intervals), default=sys.maxsize)
        if max_steps is not None:
            next_stop = min(next_stop, max(max_steps, step + 1))
        self.next_stop, self.notes_every = next_stop, notes_every
        if not self.notes:  # the time to the next delivery counts from here (an epoch's start, a stop)
            self.delivered_at = time.perf_counter()
        self._plan_next(step)
        return self.next_step

    def _plan_next(self, step: int) -> None:
        every = self.notes_every
        next_note = (step // every + 1) * every if every else sys.maxsize
        self.next_step = min(self.next_stop, next_note)
        if self.interrupt_signal is not None:  # checked after: a signal handled while the line above ran keeps its 0
            self.next_step = 0

    def looks_up(self, step: int, steps: int, sums: Any) -> bool:
        """At ``next_step`` (``steps``: updates since the last look-up): True when the loop must
        stop; else the log point is noted (with the metric sums it reads later) and the next
        look-up planned. A note :attr:`max_delay` after the last delivery stops the loop."""
        if step >= self.next_stop or self.interrupt_signal is not None:
            return True
        now, notes = time.perf_counter(), self.notes
        notes.append((step, HostSnapshot(sums), now))  # only the sums' scalars kept; a copy started where one is needed
        self._plan_next(step)
        return now - self.delivered_at >= self.max_delay or (len(notes) > 1 and not notes[-2][1].ready())

    def take_notes(self, before: int | None = None) -> list[tuple[int, HostSnapshot, float]]:
        """The noted log points, oldest first (those before step ``before``: a note at that step
        is left to the stop there, which logs it: :meth:`noted_at` keeps its time)."""
        notes, self.notes = self.notes, []
        self.delivered_at = time.perf_counter()
        if before is None:
            return notes
        self._taken_at = next(((step, at) for step, _, at in notes if step == before), None)
        return [note for note in notes if note[0] < before]

    def noted_at(self, step: int) -> float | None:
        """When the loop reached log point ``step``, if it noted it before stopping there (else None: now)."""
        return self._taken_at[1] if self._taken_at is not None and self._taken_at[0] == step else None

    @staticmethod
    def due(every: int | None, step: int, steps: int = 1) -> bool:
        """Whether a multiple of ``every`` was reached by the last ``steps`` steps up to ``step``."""
        return bool(every) and step // every > (step - steps) // every

    def interrupt(self, signum: int) -> None:
        self.interrupt_signal, self.next_step = signum, 0

    def raise_if_interrupted(self) -> None:
        if self.interrupt_signal is not None:
            raise Interrupted(self.interrupt_signal)


class SignalGuard:
    """While training: SIGTERM/SIGINT tell the :class:`EventSchedule`, which the loop checks.

    A second SIGINT falls through to Python's default (KeyboardInterrupt) for an impatient user.
    Only the main thread can install handlers; elsewhere the guard does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, schedule: EventSchedule):
        self.schedule = schedule
        self.previous: dict = {}
        self.received: int | None = None  # a signal the loop did not act on (it came after its last check)

    def _handle(self, signum, frame) -> None:
        self.schedule.interrupt(signum)
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __enter__(self) -> "SignalGuard":
        self.schedule.interrupt_signal = None
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.received, self.schedule.interrupt_signal = self.schedule.interrupt_signal, None

    def exit_if_received(self) -> None:
        """``SystemExit(128 + signal)`` when a signal came after the loop's last check (during the
        final test or ``on_fit_end``): the run is complete and saved, and the process stops as asked
        (a SIGINT in an interactive session: ``KeyboardInterrupt``, see :meth:`Interrupted.stop`)."""
        if self.received is not None:
            Interrupted(self.received).stop()

    @staticmethod
    @contextlib.contextmanager
    def ignoring():
        """SIGTERM/SIGINT ignored inside the block (e.g. while the interrupt's checkpoint is
        written), then handled as before (main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SignalGuard.SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def limit_batches(available: int | None, limit: int | float | None, name: str,
                  loader_name: str = "the loader") -> int | None:
    """Batches to use given ``limit_*_batches`` (an int, or a fraction of ``available``)."""
    if limit is None:
        return available
    if isinstance(limit, float):
        if available is None and limit == 1.0:  # all of them, as without a limit (Lightning's meaning)
            return None
        if available is None:
            raise TypeError(f"{name}={limit} is a fraction, but {loader_name} has no len(); give a number of "
                            f"batches ({name}=N), or a loader with a __len__.")
        return max(1, int(available * limit))
    if available is not None and limit > available:
        warnings.warn(f"{name}={limit} is more than the loader's {available} batches; using {available}.",
                      RuntimeWarning, stacklevel=4)
        return available
    return limit


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """``limit_train_batches`` / ``limit_val_batches`` with ``fast_dev_run`` resolved once."""

    train: int | float | None = None
    val: int | float | None = None
    max_epochs: int | None = None  # fast_dev_run (True or N): 1
    validate_every_epoch: bool = False  # fast_dev_run: validate whatever check_val_every_n_epoch says

    @classmethod
    def from_options(cls, options) -> "BatchLimits":
        """``fast_dev_run=True``: 1 train and 1 validation batch, one epoch; ``fast_dev_run=N``: N
        of each (fewer where a loader has fewer, silently, as in Lightning)."""
        if options.fast_dev_run:
            batches = 1 if options.fast_dev_run is True else options.fast_dev_run
            return cls(train=batches, val=batches, max_epochs=1, validate_every_epoch=True)
        return cls(train=options.limit_train_batches, val=options.limit_val_batches)

    def train_batches(self, available: int | None) -> int | None:
        if self.max_epochs is not None and available is not None:  # fast_dev_run: as many as there are
            return min(available, self.train)
        return limit_batches(available, self.train, "limit_train_batches", "train_loader")

    def val_batches(self, available: int | None) -> int | None:
        if self.max_epochs is not None and available is not None:
            return min(available, self.val)
        return limit_batches(available, self.val, "limit_val_batches", "val_loader")


@dataclasses.dataclass(frozen=True)
class RunSoFar:
    """What a resumed run trained before its checkpoint: ``steps`` train steps (batches) since it
    began, ``epochs`` whole epochs and ``batches`` of the next one, in epochs of ``epoch_length``
    batches (None: not recorded) after the ``earlier`` ones, ``((batches, epoch length), ...)``
    trained at other lengths (a resume with another batch size), oldest first.

    Examples:
        >>> RunSoFar(steps=95, epochs=5, epoch_length=19).run_length(num_epochs=7, steps_per_epoch=38)
        (171, ((95, 19),))
        >>> RunSoFar(steps=95, epochs=5, epoch_length=19).run_length(num_epochs=7, steps_per_epoch=19)
        (133, ())
    """

    steps: int
    epochs: int
    batches: int = 0
    epoch_length: int | None = None
    earlier: tuple = ()

    def run_length(self, num_epochs: int, steps_per_epoch: int) -> tuple[int, tuple]:
        """``(train steps of the whole run, its earlier epoch lengths)`` when it trains to
        ``num_epochs`` in epochs of ``steps_per_epoch`` batches from here: the steps taken so far
        plus those left. A run whose epochs all had this length: ``num_epochs * steps_per_epoch``,
        as a run never interrupted (so is one with nothing left to train)."""
        left = (num_epochs - self.epochs) * steps_per_epoch - self.batches
        changed = self.epoch_length is not None and self.epoch_length != steps_per_epoch
        if left <= 0 or not (changed or self.earlier):
            return num_epochs * steps_per_epoch, ()
        earlier = self.earlier
        if changed:  # the epochs since the last change (or the start) had the other length
            earlier += ((self.steps - sum(batches for batches, _ in earlier), self.epoch_length),)
        return self.steps + left, earlier


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run's length: epochs, batches per epoch, and the steps the optimizer's schedule spans
    (``schedule_epochs * schedule_steps_per_epoch``: fitted to the steps ``max_steps`` leaves the
    run when it ends the run first), of which the first were trained in epochs of other lengths
    (``earlier``, see :class:`RunSoFar`)."""

    num_epochs: int
    steps_per_epoch: int
    schedule_epochs: int
    schedule_steps_per_epoch: int
    earlier: tuple = ()

    @classmethod
    def make(cls, train_loader, val_loader, *, num_epochs: int, steps_per_epoch: int | None,
             check_val_every_n_epoch: int | None, limits: BatchLimits, max_steps: int | None,
             val_check_interval: int | None = None, start_step: int = 0,
             so_far: RunSoFar | None = None) -> "RunPlan":
        """Check the requested length against the loaders and settings; a readable error if off.
        Under ``fast_dev_run`` the schedule still spans the requested run (one step of it runs).
        ``max_steps`` counts the model's steps and the run starts at ``start_step`` (a model loaded
        from a checkpoint, a second ``train_model`` call): ``max_steps - start_step`` of them run.
        ``so_far``: a resume's, what the run trained before its checkpoint: the schedule spans the
        steps taken so far plus those left (:meth:`RunSoFar.run_length`), also when the epochs
        left have another number of batches (another batch size) than those trained."""
        if max_steps is not None and max_steps > start_step:  # else nothing trains: the length as asked
            max_steps -= start_step
        requested_epochs, num_epochs = num_epochs, limits.max_epochs or num_epochs
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}.")
        if check_val_every_n_epoch is None and val_check_interval is None and val_loader is not None:
            raise ValueError("check_val_every_n_epoch=None validates only every val_check_interval steps, and "
                             "val_check_interval is not set: no validation would run. Set val_check_interval=N, "
                             "or check_val_every_n_epoch to an int.")
        epochs_validate = check_val_every_n_epoch is not None and check_val_every_n_epoch <= num_epochs
        steps_only = check_val_every_n_epoch is None and val_check_interval  # an int one: in its epochs only
        if val_loader is not None and not (epochs_validate or steps_only or limits.validate_every_epoch):
            raise ValueError(f"check_val_every_n_epoch={check_val_every_n_epoch} > num_epochs={num_epochs}: no "
                             f"validation would run (val_check_interval validates only within the epochs "
                             f"check_val_every_n_epoch names), so there would be no best model to test. Lower "
                             f"check_val_every_n_epoch, train longer, or set val_check_interval=N (steps) with "
                             f"check_val_every_n_epoch=None.")
        validations = (num_epochs // check_val_every_n_epoch if check_val_every_n_epoch else 0)
        if val_loader is not None and is_iterator(val_loader) and (validations > 1 or val_check_interval):
            raise ValueError("val_loader is an iterator (a generator?): it runs dry after the first validation. Give "
                             "something that starts a new pass at each iter(): a list of batches, an ArrayLoader, "
                             "or a class whose __iter__ makes the generator.")
        if val_loader is not None and isinstance(limits.val, float):  # checked now, not after an epoch
            limits.val_batches(safe_len(val_loader))
        if steps_per_epoch is None:
            steps_per_epoch = epoch_length(train_loader, limits, max_steps)
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int):
            raise TypeError(f"steps_per_epoch must be an int (batches per epoch), got {steps_per_epoch!r}.")
        if steps_per_epoch < 1:
            raise ValueError("train_loader yielded no batches (its len() is 0): check the dataset size, "
                             "batch_size and drop_last.")
        full_steps_per_epoch, steps_per_epoch = steps_per_epoch, limits.train_batches(steps_per_epoch)
        total = min(num_epochs * steps_per_epoch, max_steps or num_epochs * steps_per_epoch)
        if val_loader is not None and val_check_interval and val_check_interval > total and not epochs_validate \
                and not limits.validate_every_epoch:
            raise ValueError(f"val_check_interval={val_check_interval} steps is longer than the run ({total} steps), "
                             f"and check_val_every_n_epoch={check_val_every_n_epoch}: no validation would run. Lower "
                             f"val_check_interval, train longer, or set check_val_every_n_epoch.")
        if so_far is not None and val_loader is not None and not val_check_interval:
            _say_resumed_epochs_unvalidated(so_far.epochs, num_epochs, check_val_every_n_epoch, limits)
        if limits.max_epochs is not None and isinstance(requested_epochs, int) and requested_epochs >= 1:
            return cls(num_epochs, steps_per_epoch, requested_epochs, full_steps_per_epoch)
        run_steps, earlier = so_far.run_length(num_epochs, steps_per_epoch) if so_far else (num_epochs * steps_per_epoch, ())
        if max_steps is not None and max_steps < run_steps:
            return cls(num_epochs, steps_per_epoch, 1, max_steps, earlier)
        if run_steps != num_epochs * steps_per_epoch:
            return cls(num_epochs, steps_per_epoch, 1, run_steps, earlier)
        return cls(num_epochs, steps_per_epoch, num_epochs, steps_per_epoch, earlier)


def _say_resumed_epochs_unvalidated(done: int, num_epochs: int, every: int | None, limits: "BatchLimits") -> None:
    """A resume none of whose epochs left (``done`` + 1 to ``num_epochs``) ends with a validation
    (every ``every`` epochs) is told so: its best model stays the one validated before (a fresh run
    of ``num_epochs`` validates as that one does)."""
    if every is None or limits.validate_every_epoch or done >= num_epochs:
        return
    if any(epoch % every == 0 for epoch in range(done + 1, num_epochs + 1)):
        return
    span = f"epoch {num_epochs}" if done + 1 == num_epochs else f"epochs {done + 1}-{num_epochs}"
    messages.info(f"This resume trains {span}, and none is validated (check_val_every_n_epoch={every}): the run's "
                  f"best model stays the one validated before, which its test tests. To validate the last epoch, "
                  f"resume to num_epochs={(num_epochs // every + 1) * every}, or lower check_val_every_n_epoch.")


def epoch_stop(stop: int | None, batch_index: int, step: int, max_steps: int | None) -> int | None:
    """The batch index an epoch stops at: its end ``stop``, or where ``max_steps`` ends the run
    (so fused blocks never run past it: the last steps before it run single).

    Examples:
        >>> epoch_stop(22, batch_index=0, step=44, max_steps=50)
        6
    """
    if max_steps is None:
        return stop
    last = batch_index + max(max_steps - step, 1)
    return last if stop is None else min(stop, last)


def epoch_validation_due(epoch: int, every: int | None, limits: "BatchLimits") -> bool:
    """Whether ``epoch`` ends with a validation: every ``every`` epochs (None: never, step
    validation only), or every epoch under ``fast_dev_run``."""
    return (every is not None and epoch % every == 0) or limits.validate_every_epoch


def step_validation_due(epoch: int, batch_index: int, epoch_length: int | None, every: int | None,
                        limits: "BatchLimits") -> bool:
    """Whether a ``val_check_interval`` step reached after ``batch_index`` batches of ``epoch`` (of
    ``epoch_length``) validates. As in Lightning, only in the epochs that validate
    (``check_val_every_n_epoch=every``: every ``every``-th; None: every epoch, the interval alone
    decides), and not at the end of an epoch whose own validation follows (never twice at a step).

    Examples:
        >>> [step_validation_due(epoch, 10, 20, every=2, limits=BatchLimits()) for epoch in (1, 2)]
        [False, True]
        >>> step_validation_due(2, 20, 20, every=2, limits=BatchLimits())  # the epoch's validation does it
        False
    """
    if every is not None and epoch % every != 0 and not limits.validate_every_epoch:
        return False
    at_end = epoch_length is not None and batch_index >= epoch_length
    return not (at_end and epoch_validation_due(epoch, every, limits))


def epoch_length(train_loader, limits: BatchLimits, max_steps: int | None) -> int:
    """The batches per epoch when ``steps_per_epoch`` is not given: ``len(train_loader)``; for a
    loader without ``len()`` (a torch ``IterableDataset``'s, a generator) an int
    ``limit_train_batches`` (batches per epoch), else ``max_steps`` (the steps the run has left:
    one epoch of them, which a re-iterable loader ends early where its pass ends, the next epoch
    starting a new pass), else an error naming all four.

    Examples:
        >>> epoch_length(iter([]), BatchLimits(train=10), max_steps=None), epoch_length(iter([]), BatchLimits(), 30)
        (10, 30)
    """
    length = safe_len(train_loader)
    if length is not None:
        return length
    if isinstance(limits.train, float):  # 1.0: no limit (Lightning takes it for a stream); another fraction of
        if limits.train != 1.0:          # no len(): the error says so
            limits.train_batches(None)
    elif limits.train is not None:
        return limits.train
    if max_steps is not None:
        return max_steps
    return loader_length(train_loader)


def loader_length(loader, name: str = "train_loader") -> int:
    """``len(loader)``, or an error saying why it is needed and what to do."""
    try:
        return len(loader)
    except TypeError:
        raise TypeError(f"{name} has no len(), so the run's length, which sizes the learning-rate schedule, is "
                        f"unknown. Give it a __len__, or pass steps_per_epoch=N to train_model, or give the trainer "
                        f"max_steps=N (the run's length; an epoch then ends where a pass of the loader ends) or "
                        f"limit_train_batches=N (batches per epoch).") from None


def safe_len(loader) -> int | None:
    """``len(loader)``, or None when it has none."""
    try:
        return len(loader)
    except TypeError:
        return None


def warn_if_loader_ran_short(loop: LoopState, stop: int | None, step: int = 0, max_steps: int | None = None,
                             num_epochs: int | None = None, loader: Any = None) -> None:
    """Warn when the epoch ``loop`` has trained (``loop.batch_index`` batches, up to global
    ``step``) got fewer batches than the schedule was sized for (``stop``). An epoch of a
    ``loader`` without ``len()`` that was to end the run at ``max_steps`` (the schedule spans the
    run to there) may end early, where the loader's pass ends, when more epochs follow: a warning
    only when it is the run's last (``num_epochs``), which then ends before ``max_steps``."""
    batches = loop.batch_index
    if stop is None or batches >= stop:
        return
    if max_steps is not None and safe_len(loader) is None and step + stop - batches >= max_steps:
        if num_epochs is None or loop.epoch >= num_epochs:
            warnings.warn(f"train_loader ran out after {batches} batches in the run's last epoch (num_epochs="
                          f"{num_epochs}): the run ends at step {step}, before max_steps={max_steps}, for which the "
                          f"learning-rate schedule was sized. Raise num_epochs (an epoch ends where a pass of the "
                          f"loader ends), or lower max_steps.", RuntimeWarning, stacklevel=4)
        return
    warnings.warn(f"train_loader ran out after {batches} of the epoch's {stop} batches (steps_per_epoch, "
                  f"limit_train_batches or len()): the learning-rate schedule was sized for {stop} per epoch. Pass the "
                  f"loader's real number of batches as steps_per_epoch.", RuntimeWarning, stacklevel=4)
