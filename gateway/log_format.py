"""Cadenza's logging set up once by `cadenza serve`: `--log-level`, and `--log-format text`
(one readable line per record) or `json` (one JSON object per line, for Loki, Elasticsearch or
CloudWatch: time, level, logger, message, and a record's structured `fields`, such as the
request log's id, token counts, TTFT and finish reason)."""

from __future__ import annotations

import datetime
import json
import logging

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger at `level` writing to stderr in `log_format`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
