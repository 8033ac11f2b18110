"""How hubs and workers write their log (``REDPACKET_LOG_FORMAT``): ``text``, a line a record for people,
or ``json``, an object a line for a machine — ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger``, ``message``, ``process``, and while tracing the ``trace_id`` and ``span_id`` of the span the
record was written in (``server.tracing``); ``exception`` with its traceback, when there is one."""

from __future__ import annotations

import datetime
import json
import logging

from server import tracing

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        at = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, object] = {
            "time": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        ids = tracing.current_ids()
        if ids is not None:
            line["trace_id"], line["span_id"] = ids
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def use(form: str) -> None:
    """Every handler of the root logger writes ``form`` (``text`` or ``json``) from now on."""
    formatter = JsonLines() if form == "json" else logging.Formatter(TEXT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
