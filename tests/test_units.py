"""The one byte formatter: three significant figures in binary units, everywhere a size is shown."""

import pytest

from llmtrace.units import human_bytes


@pytest.mark.parametrize("n, text", [
    (None, "—"), (0, "0 B"), (612, "612 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (11.3 * 2**20, "11.3 MiB"), (513 * 2**20, "513 MiB"), (1023.99 * 2**20, "1.00 GiB"), (1.234 * 2**30, "1.23 GiB"),
    (5 * 2**40, "5.00 TiB"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("n, word, irregular, text", [
    (0, "position", None, "0 positions"), (1, "position", None, "1 position"), (3, "position", None, "3 positions"),
    (1024, "token", None, "1,024 tokens"), (1, "index", "indices", "1 index"), (2, "index", "indices", "2 indices"),
])
def test_plural(n, word, irregular, text):
    from llmtrace.units import plural
    assert plural(n, word, plural=irregular) == text
