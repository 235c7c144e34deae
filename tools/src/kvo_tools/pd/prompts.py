"""Prompts of a chosen length in characters, distinct per tag (test and bench helper).

A tag at the front keeps prompts apart in the prefix cache; the filler repeats to the length.
"""

from __future__ import annotations

DSA_TEXT = ("A lightning indexer picks the rows each query reads; decode keeps every row in host "
            "memory and copies in only the misses. ")
DENSE_TEXT = ("Prefill computes every layer once and hands it to decode; decode pulls each layer "
              "into its own cache blocks and answers. ")


def tagged_prompt(tag: str, length: int, text: str = DSA_TEXT) -> str:
    """``length`` characters: ``tag: `` then ``text`` repeated."""
    body = f"{tag}: " + text * (length // len(text) + 1)
    return body[:length]
