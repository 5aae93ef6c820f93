"""hivemind logs some conditions at ERROR, with a traceback, that the swarm handles itself (a round
nobody joined, a request whose sender died). Those records are demoted to DEBUG here, not dropped:
a peer run with debug logging still shows them, and nobody else sees a traceback for a normal event."""

from __future__ import annotations

import logging
from typing import Callable


class DemoteHandled(logging.Filter):
    """Demotes to DEBUG each record for which `handled(record, its exception or None)` is true."""

    def __init__(self, handled: Callable[[logging.LogRecord, BaseException | None], bool]) -> None:
        super().__init__()
        self.handled = handled

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and self.handled(record, record.exc_info[1] if record.exc_info else None):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
                return False  # the logger let it through as an ERROR; as DEBUG it would not have been
        return True
