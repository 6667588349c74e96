"""Grouped-query attention's grouping, without torch (the report draws it too): which query heads read each KV head."""


def gqa_groups(n_heads: int, n_kv_heads: int) -> list[list[int]]:
    """Query heads reading each KV head: head h uses KV head h // (H / Hkv), as repeat_kv (repeat_interleave) lays
    them out in model/transformer.py."""
    g = n_heads // n_kv_heads
    return [list(range(k * g, (k + 1) * g)) for k in range(n_kv_heads)]
