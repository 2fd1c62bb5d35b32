"""The server's log: one JSON object per line, each an event (a request's arrival, first
token, end or error, a refusal, a self-test) with its fields."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("infersight.server")


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, event and the event's fields (a request's id
    through its life: arrival, end or error), for log collectors to parse."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                "event": record.getMessage(), **getattr(record, "fields", {})}  # fmt: skip
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})
