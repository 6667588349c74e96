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


def test_an_out_of_range_position_counts_one_position_in_the_singular():
    from llmtrace.errors import BadValue
    from llmtrace.run.explain import parse_positions
    with pytest.raises(BadValue) as e:
        parse_positions("99", 1)
    assert "the prompt has 1 position (0..0" in str(e.value)
    with pytest.raises(BadValue) as e:
        parse_positions("99", 3)
    assert "the prompt has 3 positions (0..2" in str(e.value)


def test_counts_are_worded_by_the_one_plural_helper():
    """A hand-made plural ("{n} token{'s' if n != 1 else ''}", or a second plural()) is how '1 positions' came back."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "llmtrace"
    hand_made = re.compile(r"""\{['"]s['"] if |\{['"]['"] if [^}]*== 1 else ['"]s['"]\}|^\s*def plural\(""")
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "units.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if hand_made.search(line)]
    assert not found, f"use llmtrace.units.plural: {found}"
