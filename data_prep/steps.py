"""datatrove pipeline steps of our own: cleaning filters and the split selector."""

from __future__ import annotations

from datatrove.data import Document
from datatrove.pipeline.filters.base_filter import BaseFilter

from data_prep.split import split_of


class MinCharsFilter(BaseFilter):
    """Drop empty, whitespace-only and too-short documents (counted in datatrove's stats)."""

    name = "📏 min chars"

    def __init__(self, min_chars: int):
        super().__init__()
        self.min_chars = min_chars

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        n = len(doc.text.strip()) if isinstance(doc.text, str) else 0
        if n == 0:
            return False, "empty"
        return (True if n >= self.min_chars else (False, "too_short"))


class SplitSelector(BaseFilter):
    """Keep the documents of one split (train/valid), chosen by a hash of the text."""

    name = "🔀 split"

    def __init__(self, split: str, valid_fraction: float, salt: int):
        super().__init__()
        self.split, self.valid_fraction, self.salt = split, valid_fraction, salt

    def filter(self, doc: Document) -> bool:
        return split_of(doc.text, self.valid_fraction, self.salt) == self.split
