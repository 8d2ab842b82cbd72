"""The bounds a value must keep to be stored in a segment, shared by the segment layout, the settings and the
size parser: the priorities a controller may set, the largest limit, the endpoint's length and form.

It imports nothing of this package, so every floor above can read it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

PRIORITY_MIN, PRIORITY_MAX = -1000, 1000  # the priorities a controller may set (readers take others as forged)
MAX_LIMIT_BYTES = 2**63 - 1  # the CONTROL block's limit is an int64: no larger limit (or size) can be stored
ENDPOINT_MAX = 104  # the bytes of the URL the ENDPOINT block holds


def endpoint_problem(url: object) -> str | None:
    """Why ``url`` cannot be a published endpoint (the segment's ``ENDPOINT`` block); None when it can."""
    if not isinstance(url, str) or not url:
        return f"an endpoint is a URL such as http://127.0.0.1:8000, not {url!r}"
    if not url.isascii() or not url.isprintable() or " " in url:
        return f"endpoint {printable(url)!r}: only printable ASCII, no spaces"
    if len(url) > ENDPOINT_MAX:
        return f"endpoint of {len(url)} characters: a segment holds at most {ENDPOINT_MAX}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"endpoint {url!r}: {exc}"
    if parts.scheme not in ("http", "https"):
        return f"endpoint {url!r}: the scheme must be http or https"
    if not parts.hostname or port is None or port == 0:
        return f"endpoint {url!r}: it must name a host and a port (http://HOST:PORT)"
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return f"endpoint {url!r}: no user, query or fragment"
    return None

def printable(text: str) -> str:
    """``text`` with every control, format and line-separator character (ESC, BEL, DEL, C1, bidi
    overrides, ...) replaced by ``?``: strings from segment files and file names reach terminals."""
    if text.isprintable():  # the common case, one C loop (a plain space counts as printable)
        return text
    return "".join(c if c.isprintable() else "?" for c in text)
