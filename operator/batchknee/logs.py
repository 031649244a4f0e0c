"""The operator's log lines: one line per record, bounded.

Messages and exceptions carry what upstreams wrote (an apiserver or webhook error, a Prometheus
answer, a pod's refusal): a newline in that text must not forge a line of the operator's log, and
a 2-MB error page must not become a 2-MB line. Tracebacks keep their frames (the operator's own
code); the exception's message below them is made one bounded line like any message."""

from __future__ import annotations

import logging
import traceback

LINE_LIMIT = 2000


def one_line(text: str, limit: int = LINE_LIMIT) -> str:
    flat = "".join(ch if ch.isprintable() else " " for ch in text)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class OneLineRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = one_line(record.getMessage()), None
        if record.exc_info and record.exc_info[1] is not None:
            kind, error, trace = record.exc_info
            frames = "".join(traceback.format_tb(trace))
            record.exc_text = (
                "Traceback (most recent call last):\n"
                + frames
                + one_line("".join(traceback.format_exception_only(kind, error)).strip())
            )
        return True


def configure(verbose: bool) -> None:
    """The operator's logging: level, format, and every line one bounded line."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OneLineRecords) for f in handler.filters):  # configured once
            handler.addFilter(OneLineRecords())
    # kopf's health endpoint (aiohttp) would log a line per request, path and User-Agent as sent:
    # anyone the network lets reach the port could fill the log with lines of their choosing
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
