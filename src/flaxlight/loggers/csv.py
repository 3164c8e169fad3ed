"""CSV logging: one ``metrics.csv`` with a row per log point and a column per metric."""

from __future__ import annotations

import csv
import os
from typing import Mapping

from flaxlight.loggers.base import Logger

__all__ = ["CSVLogger", "LoggedStep", "POSITION_COLUMN", "epoch_logged_at", "rows_logged_ahead"]

#: The column of the rows logged with a step of their own: the trainer's ``global_step`` then.
POSITION_COLUMN = "trainer/global_step"


class LoggedStep(int):
    """A step given to ``trainer.log_metrics(..., step=...)`` beyond the trainer's ``global_step``
    (samples seen, say): an ``int`` for every logger, carrying the ``global_step`` it was logged
    at, the training position a resume compares with its checkpoint's step.

    Examples:
        >>> step = LoggedStep(256, global_step=8)
        >>> step + 0, step.global_step
        (256, 8)
    """

    global_step: int

    def __new__(cls, step: int, global_step: int) -> "LoggedStep":
        made = super().__new__(cls, int(step))
        made.global_step = int(global_step)
        return made

    def __reduce__(self):
        return LoggedStep, (int(self), self.global_step)


class CSVLogger(Logger):
    """Writes ``<log_dir>/metrics.csv``; columns are ``step`` then metrics in order of appearance.

    A row logged with a step of its own (``trainer.log_metrics(..., step=n)``, ``n`` beyond the
    trainer's ``global_step``, a :class:`LoggedStep`) also holds that ``global_step`` in the column
    ``trainer/global_step`` (empty in the other rows; there only once such a row is logged): a
    resume keeps the rows logged up to its checkpoint's step by when they were logged, whatever
    their own step.

    When a new metric appears the file is rewritten with the wider header, so it always parses
    with a plain CSV reader (empty cells where a metric was not logged); the rewrite starts from
    what the file holds then and replaces it atomically (a temporary file, then ``os.replace``). Rows are buffered and
    written by :meth:`flush` (the trainer flushes at every epoch end and checkpoint) and
    :meth:`finalize`, or once ``flush_every_n_records`` rows are waiting.

    The trainer always writes its run's ``metrics.csv``: a ``CSVLogger`` on that file given in
    ``loggers=[...]`` takes the place of the built-in one (one writer per file, no duplicated rows).
    ``log_dir`` is one folder: Lightning's ``save_dir``/``name``/``version`` layout is the
    trainer's (``logger_params``: ``base_log_dir/<Model>/version_N``).

    Examples:
        >>> logger = CSVLogger("/tmp/run")                 # doctest: +SKIP
        >>> logger.log_metrics({"train/loss": 0.5}, step=10)  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike, filename: str = "metrics.csv", flush_every_n_records: int = 100):
        self.flush_every_n_records = flush_every_n_records
        self.log_dir = os.fspath(log_dir)
        self.path = os.path.join(self.log_dir, filename)
        self.columns: list[str] = ["step"]
        self.rows: list[dict] = []
        self._written_rows = 0
        self._on_disk = False  # the rows were read from or written to the file

    @property
    def save_dir(self) -> str:
        """The folder this logger writes into (its ``log_dir``)."""
        return self.log_dir

    def resume_from_step(self, step: int) -> None:
        """Reload ``metrics.csv`` and keep the rows logged up to ``step`` (by their
        ``trainer/global_step``, else their step); those logged later are dropped."""
        self._reload(up_to=step)

    def start_run(self) -> None:
        """Rows read from a ``metrics.csv`` that ``overwrite=True`` then deleted are dropped (rows
        not written yet, such as a baseline test's before the run, stay)."""
        if self._on_disk and not os.path.isfile(self.path):
            self.columns, self.rows, self._written_rows, self._on_disk = ["step"], [], 0, False

    def continue_run(self) -> None:
        """Read ``metrics.csv``: new rows are added to every row it holds (nothing is written now)."""
        self._reload(up_to=None)

    def _reload(self, up_to: int | None) -> None:
        """Take the file's rows; with ``up_to``, the later ones are dropped from it too (a resumed
        run's lock is held). Without, nothing is written: a last line cut short is mended at the
        next :meth:`flush`, which re-reads the file."""
        if not os.path.isfile(self.path):
            return
        self.columns, self.rows = _read(self.path, up_to)
        self._written_rows, self._on_disk = len(self.rows), True
        if up_to is not None:
            self._rewrite(self.columns, self.rows)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": int(step)}
        row.update(metrics)
        if isinstance(step, LoggedStep):  # logged at another training position than its step says
            row[POSITION_COLUMN] = step.global_step
        self.columns.extend(key for key in row if key not in self.columns)
        self.rows.append(row)
        if len(self.rows) - self._written_rows >= self.flush_every_n_records:
            self.flush()

    def finalize(self, status: str) -> None:
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Write the rows logged since the last flush. They are appended while the file's header
        names every column they have; otherwise the file is rewritten with a wider header, from
        what it holds now (rows another writer added since are kept) plus the new rows, into a
        temporary file that then replaces it: an exit at any moment leaves the old or the new file."""
        if self._written_rows == len(self.rows) and not force:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        new_rows = self.rows[self._written_rows:]
        header = _header(self.path) if self._on_disk else None  # a file this logger never read is replaced
        if header is not None and set(self.columns) <= set(header):
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=header, restval="").writerows(new_rows)
            self.columns = header
        else:
            columns, rows = list(self.columns), list(self.rows)
            if self._on_disk and _holds_rows(self.path):  # what the file holds now, not what was read before
                columns, rows = _read(self.path, None)
                columns += [key for key in self.columns if key not in columns]
                rows += new_rows
            self._rewrite(columns, rows)
            self.columns, self.rows = columns, rows
        self._written_rows, self._on_disk = len(self.rows), True

    def _rewrite(self, columns: list[str], rows: list[dict]) -> None:
        """``metrics.csv`` replaced at once (a temporary file, then ``os.replace``)."""
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, restval="")
                writer.writeheader()
                writer.writerows(rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise


def _header(path: str) -> list[str] | None:
    """The columns of the CSV file at ``path``; None when it is missing, empty or its last line is
    cut short (no newline: a row appended now would join it)."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return None
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                return None
            f.seek(0)
            first = f.readline().decode("utf-8").rstrip("\r\n")
    except FileNotFoundError:
        return None
    return next(csv.reader([first]), None) or None


def _holds_rows(path: str) -> bool:
    """Whether the file at ``path`` holds a header line (it may hold rows)."""
    try:
        return os.path.getsize(path) > 0
    except FileNotFoundError:
        return False


def _read(path: str, up_to: int | None) -> tuple[list[str], list[dict]]:
    """``(columns, rows)`` of the CSV file at ``path``: the rows logged up to step ``up_to`` (their
    ``trainer/global_step``, else their step; all for None)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or ["step"])
        rows = [  # a row cut short (a full disk) keeps the values it has; the cells it lacks read None
            {k: _parse(v) for k, v in row.items() if k is not None and v not in ("", None)}
            for row in reader
            if _step_of(row) is not None and (up_to is None or _step_of(row, POSITION_COLUMN) <= up_to)
        ]
    return columns, rows


def rows_logged_ahead(path: str | os.PathLike, step: int) -> list[tuple[int, dict[str, float]]]:
    """``[(row's step, its numbers)]`` of the ``metrics.csv`` at ``path`` logged by step ``step``
    with a later step of their own (:class:`LoggedStep`): what a purge from ``step + 1`` on would
    hide although the checkpoint at ``step`` came after it (none without the file).

    Examples:
        >>> rows_logged_ahead("runs/no_such_run/metrics.csv", 13)
        []
    """
    if not os.path.isfile(path):
        return []
    ahead = []
    for row in _read(os.fspath(path), up_to=step)[1]:
        if (_step_of(row) or 0) > step:
            numbers = {key: float(value) for key, value in row.items()
                       if key not in ("step", POSITION_COLUMN) and isinstance(value, (int, float))}
            ahead.append((_step_of(row), numbers))
    return ahead


def epoch_logged_at(path: str | os.PathLike, step: int) -> float | None:
    """The ``epoch`` a row of the ``metrics.csv`` at ``path`` logged at ``step`` (an epoch's train
    record, whose validation a resume from that step logs with it again); None without one.

    Examples:
        >>> epoch_logged_at("runs/no_such_run/metrics.csv", 16) is None
        True
    """
    if not os.path.isfile(path):
        return None
    for row in reversed(_read(os.fspath(path), up_to=step)[1]):
        if _step_of(row) == step and isinstance(row.get("epoch"), (int, float)) and not isinstance(row["epoch"], bool):
            return float(row["epoch"])
    return None


def _step_of(row: Mapping, column: str = "step") -> int | None:
    """The row's ``column`` as an int (``trainer/global_step`` empty or cut short: its step); None
    if neither is one."""
    for key in (column, "step"):
        value = row.get(key)
        if isinstance(value, int) and not isinstance(value, bool):  # a parsed row (0 is a step too)
            return value
        try:
            return int(value or "")
        except (TypeError, ValueError):
            continue
    return None


def _parse(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:  # a cell cut mid-number: kept as written
            return text
