"""parse_size and format_bytes: what operators type, what people read."""

from __future__ import annotations

import pytest

from kvcached_core import SizeError, format_bytes, parse_size

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


@pytest.mark.parametrize(("text", "expected"), [
    ("0B", 0), ("100 B", 100), ("100b", 100), ("100B", 100), (" 2 k ", 2 * KiB), ("2K", 2 * KiB),
    ("512MiB", 512 * MiB), ("512mib", 512 * MiB), ("512M", 512 * MiB), ("512MB", 512 * 1000**2),
    ("4G", 4 * GiB), ("4g", 4 * GiB), ("4GiB", 4 * GiB), ("4GB", 4 * 1000**3), ("1.5GiB", 3 * GiB // 2),
    (".5G", GiB // 2), ("2T", 2 * TiB), ("2TB", 2 * 1000**4), ("3KB", 3000), ("3KiB", 3 * KiB),
])
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "total", "expected"), [
    ("30%", 1000, 300), ("100%", 1000, 1000), (" 12.5 % ", 8 * GiB, GiB), ("0.1%", 10_000, 10),
])
def test_parse_size_percent(text, total, expected):
    assert parse_size(text, percent_of=total) == expected


@pytest.mark.parametrize("word", ["none", "None", "NONE", "unlimited", "off", " off "])
def test_parse_size_none_words(word):
    assert parse_size(word, allow_none=True) is None
    with pytest.raises(SizeError, match="not a size here"):
        parse_size(word)


@pytest.mark.parametrize(("text", "kwargs", "message"), [
    ("", {}, "empty size"), ("   ", {}, "empty size"), ("-1", {}, "cannot be negative"),
    ("4", {}, r"^4 what\? 4GiB, 4MiB; 4B for bytes$"), ("0", {}, "0 what"), ("1.5", {}, r"^1.5 what\? 1.5GiB, 1.5MiB$"),
    (" 64 ", {"percent_of": 100}, "64 what"),
    ("-4G", {}, "cannot be negative"), ("abc", {}, "is not a size"), ("1.5.3G", {}, "is not a size"),
    ("5XB", {}, "unknown unit"), ("4 gigs", {}, "unknown unit 'gigs'"), ("1e9", {}, "is not a size"),
    ("30%", {}, "needs a known total"), ("0%", {"percent_of": 100}, "above 0 and at most 100"),
    ("101%", {"percent_of": 100}, "above 0 and at most 100"), ("%", {"percent_of": 100}, "is not a size"),
])
def test_parse_size_rejects_with_a_reason(text, kwargs, message):
    with pytest.raises(SizeError, match=message):
        parse_size(text, **kwargs)


def test_parse_size_rejects_non_strings():
    with pytest.raises(SizeError):
        parse_size(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "text"), [
    (None, "-"), (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (MiB, "1.0 MiB"), (MiB - 1, "1.0 MiB"), (1536 * MiB, "1.5 GiB"), (GiB - 1, "1.0 GiB"),
    (5 * TiB, "5.0 TiB"), (1024 * TiB, "1024.0 TiB"), (-1536, "-1.5 KiB"), (144 * MiB, "144.0 MiB"),
    (2.5 * KiB, "2.5 KiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_bytes_precision():
    assert format_bytes(1234567, precision=2) == "1.18 MiB"
    assert format_bytes(1234567, precision=0) == "1 MiB"


@pytest.mark.parametrize("n", [0, 1, 1023, KiB, 3 * MiB, 7 * GiB, 2 * TiB])
def test_format_then_parse_round_trips_exact_binary_sizes(n):
    text = format_bytes(n).replace(" ", "")
    assert parse_size(text) == n
