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
import os
import sys
import warnings

__all__ = ["logger", "warn_at_user"]

logger = logging.getLogger("flaxlight")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _in_package(frame) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR)


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside flaxlight (the user's line that
    built the trainer or callback), however deep inside flaxlight the check runs.

    Examples:
        >>> warn_at_user("monitor='val/acc' with mode='min' keeps the lowest val/acc")  # doctest: +SKIP
    """
    frame, level = sys._getframe(1), 2
    while frame is not None and (_in_package(frame) or (  # a dataclass's generated __init__ called by flaxlight
            frame.f_code.co_filename == "<string>" and frame.f_back is not None and _in_package(frame.f_back))):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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
