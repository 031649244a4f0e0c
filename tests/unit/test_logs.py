"""The operator's log (`batchknee.logs.configure`, what `batchknee operator` runs): what an upstream
wrote reaches it as one bounded line, never as lines of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

LOGGING = textwrap.dedent(
    """
    import logging
    from kubernetes.client.exceptions import ApiException
    from batchknee import logs

    logs.configure(verbose=False)
    log = logging.getLogger("batchknee")
    forged = "\\n2026-12-03 12:00:00,000 INFO batchknee.reconcile: prod/llama: all is well (forged)\\n"
    page = "<html>" + "x" * 2_000_000 + "</html>"
    error = ApiException(status=500, reason="Internal Server Error")
    error.body = forged + page
    error.headers = {"Set-Cookie": "session=abc" + forged}
    log.warning("prod/llama: could not record event %s: %s", "Retuned", error)
    try:
        raise error
    except ApiException:
        log.exception("prod/llama: reconcile failed")
    # what aiohttp writes per request to kopf's health endpoint, User-Agent as the caller sent it
    logging.getLogger("aiohttp.access").info('10.0.0.9 "GET /healthz HTTP/1.1" 200 "agent-chosen"')
    log.info("prod/llama: a line of our own")
    """
)


def test_an_upstream_error_is_one_bounded_line_and_forges_none() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOGGING], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert not any("(forged)" in line and line.startswith("2026-12-03 12:00:00") for line in lines)
    assert max(len(line) for line in lines) <= 2100  # the prefix and LINE_LIMIT characters
    warning = [line for line in lines if "could not record event Retuned" in line]
    assert len(warning) == 1 and "(500)" in warning[0] and warning[0].endswith("…")
    # the traceback keeps its frames; the exception under them is one line
    start = lines.index(next(line for line in lines if line.endswith("prod/llama: reconcile failed")))
    assert lines[start + 1] == "Traceback (most recent call last):"
    assert lines[-2].startswith("kubernetes.client.exceptions.ApiException: (500)")
    assert lines[-1].endswith("INFO batchknee: prod/llama: a line of our own")
    assert not any("agent-chosen" in line for line in lines)  # anyone who reaches the port writes nothing
