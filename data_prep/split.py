"""Deterministic train/validation/test assignment by document content.

The split of a document depends only on its text and a salt, so it is the same across reruns, worker
counts and input orderings.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "valid", "test")


def split_of(text: str, valid_fraction: float, salt: int = 0, test_fraction: float = 0.0) -> str:
    digest = hashlib.blake2b(f"{salt}\x00{text}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64  # uniform in [0, 1)
    if u < valid_fraction:
        return "valid"
    if u < valid_fraction + test_fraction:
        return "test"
    return "train"
