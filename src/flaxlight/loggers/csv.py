"""CSV logging: one ``metrics.csv`` with a row per log point and a column per metric."""

from __future__ import annotations

import csv
import os
from typing import Mapping

from flaxlight.loggers.base import Logger

__all__ = ["CSVLogger"]


class CSVLogger(Logger):
    """Writes ``<log_dir>/metrics.csv``; columns are ``step`` then metrics in order of appearance.

    When a new metric appears the file is rewritten with the wider header, so it always parses
    with a plain CSV reader (empty cells where a metric was not logged). Rows are buffered and
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
        """Reload ``metrics.csv`` and keep the rows up to ``step``; later rows are dropped."""
        self._reload(up_to=step)

    def start_run(self) -> None:
        """Rows read from a ``metrics.csv`` that ``overwrite=True`` then deleted are dropped (rows
        not written yet, such as a baseline test's before the run, stay)."""
        if self._on_disk and not os.path.isfile(self.path):
            self.columns, self.rows, self._written_rows, self._on_disk = ["step"], [], 0, False

    def continue_run(self) -> None:
        """Reload ``metrics.csv``: new rows are appended to every row it holds."""
        self._reload(up_to=None)

    def _reload(self, up_to: int | None) -> None:
        if not os.path.isfile(self.path):
            return
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or ["step"])
            rows = [  # a row cut short (a full disk) keeps the values it has; the cells it lacks read None
                {k: _parse(v) for k, v in row.items() if k is not None and v not in ("", None)}
                for row in reader
                if _step_of(row) is not None and (up_to is None or _step_of(row) <= up_to)
            ]
        self.columns, self.rows, self._on_disk = columns, rows, True
        with open(self.path, "rb") as f:  # a last line cut short (no newline) is rewritten whole, not appended to
            whole = f.seek(0, os.SEEK_END) == 0 or (f.seek(-1, os.SEEK_END) >= 0 and f.read(1) == b"\n")
        self._written_rows = len(rows) if up_to is None and whole else 0  # nothing dropped: the file stands
        if self._written_rows == 0:
            self.flush(force=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": int(step)}
        row.update(metrics)
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns.extend(new)
            self._written_rows = 0  # header changed: rewrite the whole file at the next flush
        self.rows.append(row)
        if len(self.rows) - self._written_rows >= self.flush_every_n_records:
            self.flush()

    def finalize(self, status: str) -> None:
        self.flush()

    def flush(self, force: bool = False) -> None:
        if self._written_rows == len(self.rows) and not force:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        mode = "a" if self._written_rows else "w"
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="")
            if mode == "w":
                writer.writeheader()
            writer.writerows(self.rows[self._written_rows :])
        self._written_rows, self._on_disk = len(self.rows), True


def _step_of(row: Mapping) -> int | None:
    try:
        return int(row.get("step") or "")
    except ValueError:
        return None


def _parse(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:  # a cell cut mid-number: kept as written
            return text
