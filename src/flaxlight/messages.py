"""The one channel for what flaxlight tells its user: the ``logging`` logger named ``flaxlight``.

Information (why training stopped, where a run resumed, where an interrupted run was saved)
goes to this logger at INFO; ``warnings.warn`` is kept for misuse. Out of the box the messages
appear on stderr as plain lines. To route them through your own logging set-up instead::

    import logging
    flaxlight_logger = logging.getLogger("flaxlight")
    flaxlight_logger.handlers.clear()
    flaxlight_logger.propagate = True

and ``logging.getLogger("flaxlight").setLevel(logging.WARNING)`` silences the information, set
before or after ``import flaxlight`` (the import sets INFO only on a logger with no level).

Examples:
    >>> from flaxlight.messages import logger
    >>> logger.info("Resumed from checkpoint %d.", 120)   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import sys

__all__ = ["logger"]

logger = logging.getLogger("flaxlight")


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a message comes (notebooks and test
    runners replace it after import)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


if not logger.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    if logger.level == logging.NOTSET:  # a level set before ``import flaxlight`` is kept
        logger.setLevel(logging.INFO)
    logger.propagate = False
