"""What of a Prometheus URL or answer may reach status, Events and logs."""

from __future__ import annotations

from batchknee.adapters.observing import RoutedObserver, redact_url
from batchknee.adapters.prometheus import ERROR_BODY_BYTES, EXCERPT_CHARS, excerpt


def test_credentials_and_query_never_shown() -> None:
    assert redact_url("https://user:s3cret@prom.example:9090/prom/") == "https://prom.example:9090/prom/"
    assert redact_url("http://token@10.0.0.1:9090") == "http://10.0.0.1:9090"
    assert redact_url("http://prom:9090/api?token=abc#x") == "http://prom:9090/api"
    assert redact_url("http://[::1]:9090") == "http://[::1]:9090"
    assert redact_url("http://[bad") == "<unparseable URL>"


def test_an_html_error_page_becomes_one_short_line() -> None:
    page = (
        "<!DOCTYPE html><html><head><style>body{color:red}</style><script>var x=1;</script>"
        "<title>502 Bad Gateway</title></head><body>\n<h1>Bad\tGateway</h1>\r\n\x1b[31m"
        + "<p>"
        + "internal detail " * 400
        + "</p></body></html>"
    )
    text = excerpt(page.encode())
    assert text.startswith("502 Bad Gateway Bad Gateway")
    assert len(text) <= EXCERPT_CHARS
    assert text.endswith("…")
    assert all(ch.isprintable() for ch in text)
    assert "color:red" not in text and "var x" not in text and "<" not in text


def test_scripts_and_tags_are_stripped_up_to_their_closing_only() -> None:
    """Each script or style goes up to its own closing tag (any case, spaces before `>`); an
    unclosed one, and a `<` that opens no tag, stay as text."""
    assert excerpt("<SCRIPT>a</script >b<style type=x>c</STYLE>d<script>e") == "b d e"
    assert excerpt("<p>1 <b>2</b> < 3 <i>4") == "1 2 < 3 4"
    assert excerpt("<a <b>c") == "<a c"
    assert excerpt('<div class="x" onclick="if(a<b)go(\'>\')">Error 522</div>') == "Error 522"
    assert excerpt("<" * 100) == "<" * 100


def test_prometheus_json_errors_keep_their_message() -> None:
    body = b'{"status":"error","errorType":"bad_data","error":"parse error at char 3:\\nunexpected"}'
    assert excerpt(body) == "bad_data: parse error at char 3: unexpected"


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert excerpt(b"\xff\xfeoops\x00") == "\ufffd\ufffdoops"


def test_the_admin_allow_list() -> None:
    router = RoutedObserver(object(), "http://127.0.0.1:9090", ["http://prom-a:9090/", "http://prom-b:9090"])  # type: ignore[arg-type]
    assert router.allows("http://prom-a:9090")
    assert router.allows("http://127.0.0.1:9090/")  # the default is always allowed
    assert router.allows(None)
    refusal = router.refusal("http://admin:pw@metadata.internal/")
    assert refusal is not None
    assert "http://metadata.internal/" in refusal and "pw" not in refusal
    assert not router.allows("http://prom-a:9090/api/v1/query?x=")  # exactly the URL, nothing under it
    assert not router.allows("http://x@prom-a:9090")
    by_default = RoutedObserver(object(), "http://127.0.0.1:9090")  # type: ignore[arg-type]
    assert by_default.refusal("http://metadata.internal/") is not None  # none but the default
    assert by_default.allows("http://127.0.0.1:9090") and by_default.allows(None)
    open_router = RoutedObserver(object(), "http://127.0.0.1:9090", ["*"])  # type: ignore[arg-type]
    assert open_router.refusal("http://anything:1") is None
    for hostless in ("http://[oops", "http://", "https://:9090/"):  # even with `*`: nothing to fetch
        refused = open_router.refusal(hostless)
        assert refused is not None and "is not a URL with a host" in refused, hostless


def test_an_echoed_request_shows_no_credential() -> None:
    echoed = (
        b"400 bad request; you sent:\nPOST /api/v1/query\nAuthorization: Basic cmVhZGVyOnMzY3IzdC10b2tlbg==\n"
        b"Cookie: session=abc123\nX-Debug: token=eyJhbGciOi url=http://reader:s3cr3t-token@prom:9090"
    )
    text = excerpt(
        echoed, limit=1000, secrets=("cmVhZGVyOnMzY3IzdC10b2tlbg==", "reader:s3cr3t-token", "s3cr3t-token")
    )
    assert (
        "cmVhZGVy" not in text and "s3cr3t" not in text and "abc123" not in text and "eyJhbGciOi" not in text
    )
    assert "Authorization: ***" in text and "Cookie: ***" in text and "token=***" in text


def test_only_the_head_of_an_answer_is_read() -> None:
    """Tag stripping backtracks: on a whole 64-MiB answer it held the interpreter for minutes; on
    its 8-KiB head it costs what a small page costs."""
    text = excerpt(b"x" * ERROR_BODY_BYTES + b" TAIL", limit=10 * ERROR_BODY_BYTES)
    assert "TAIL" not in text and len(text) == ERROR_BODY_BYTES
    assert excerpt(b"[" * 100_000).startswith("[[[")  # JSON too deep to parse is text, not a crash


def test_a_secret_cut_in_two_by_the_bytes_read_is_masked_too() -> None:
    """An error answer is read to its first 8 KiB: an echoed token straddling that edge leaves its
    head in the excerpt, which the whole-token mask does not find."""
    token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0iLCJleHAiOjE3MDB9.c2lnbmF0dXJl"
    for cut in (8, 30, len(token) - 1):
        body = (" " * (ERROR_BODY_BYTES - 6 - cut) + "echo: " + token).encode()[:ERROR_BODY_BYTES]
        assert excerpt(body, secrets=[token]) == "echo: ***"
    # a whole secret at the cut whose tail repeats its head: not only the repeat is masked
    for secret in ("abcd-abcd", "hunter2hunter2"):
        body = (" " * (ERROR_BODY_BYTES - 6 - len(secret)) + "echo: " + secret).encode()
        assert excerpt(body, secrets=[secret]) == "echo: ***"
    # an answer that ends where it ends: nothing was cut, nothing more is masked
    assert excerpt(b"echo: eyJhbGciOi", secrets=[token]) == "echo: eyJhbGciOi"


def test_a_secret_is_masked_however_an_answer_writes_it() -> None:
    """A secret inside a longer one (a tenant that starts an API key) must not leave the longer
    one's rest; an answer may write it escaped as HTML, JSON or a URL does, or split by tags."""
    key, tenant = "team-a-9f8e7d6c5b", "team-a"
    assert excerpt(b"tenant team-a, key team-a-9f8e7d6c5b", secrets=[tenant, key]) == "tenant ***, key ***"
    assert excerpt(b"<p>v=ab<cd>ef9f8e7d6c5b</p>", secrets=["ab<cd>ef9f8e7d6c5b"]) == "v=***"
    assert excerpt(b"v=k&amp;y12345 q=k%26y12345", secrets=["k&y12345"]) == "v=*** q=***"
    assert excerpt(b'{"x": "k\\"y\\\\99"}', secrets=['k"y\\99']) == '{"x": "***"}'
    assert excerpt(b'{"error": "bad k\\u0026y12345", "errorType": "bad_data"}', secrets=["k&y12345"]) == (
        "bad_data: bad ***"
    )
    # as Go's encoders write it (a Mimir or a proxy in Go): JSON escapes &, < and >; HTML ' and "
    secret = "k&y'1234\"5"
    assert (
        excerpt(b'{"message":"denied for k\\u0026y\'1234\\"5"}', secrets=[secret])
        == '{"message":"denied for ***"}'
    )
    assert excerpt(b"<p>k&amp;y&#39;1234&#34;5</p>", secrets=[secret]) == "***"
    assert excerpt(b"q=a+b+c+d", secrets=["a b c d"]) == "q=***"  # as a form writes it
    # a secret that is also a word of Prometheus's error answer does not spoil its reading
    answer = b'{"status":"error","errorType":"bad_data","error":"query timed out"}'
    assert excerpt(answer, secrets=["error"]) == "bad_data: query timed out"
