"""Sizes as users write them and as Stowage prints them."""

import pytest

from stowage.engine.units import GiB, MiB, format_bytes, format_tokens, parse_size


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * GiB), ("512MiB", 512 * MiB), ("16GB", 16 * 10**9), ("1.5 GiB", 3 * GiB // 2),
    ("4096", 4096), ("8g", 8 * GiB), ("100mb", 100 * 10**6), ("2TiB", 2 * 1024 * GiB), (" 1KiB ", 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "12 parsecs", "1.2.3GB"])
def test_parse_size_refuses_with_an_example(text):
    with pytest.raises(ValueError, match="for example 24GiB"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(16 * GiB) == "16.0 GiB"
    assert format_bytes(int(9.16 * GiB)) == "9.2 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(-GiB // 2) == "-512.0 MiB"


def test_format_tokens():
    assert format_tokens(14336) == "14,336 tokens"
    assert format_tokens(1) == "1 token"
