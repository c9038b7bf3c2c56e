"""Re-read every written shard and check it: index against binary, token ids against the vocabulary,
counts against the manifest. A failure names the file and says what to do."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from difflm.errors import UserError
from difflm.manifest import DataManifest, loss_mask_prefix

_HEADER = b"MMIDIDX\x00\x00"
_DTYPES = {8: np.uint16, 4: np.int32, 1: np.uint8}  # megatron's dtype codes: tokens as datatrove writes them, masks


class DataVerificationError(UserError, RuntimeError):
    """A written shard does not match its manifest: prep it again."""


def read_index(idx_path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, byte pointers, document indices) of a Megatron .idx file."""
    raw = idx_path.read_bytes()
    if raw[:9] != _HEADER:
        raise DataVerificationError(f"{idx_path}: not a Megatron index (bad header)")
    (version,) = struct.unpack("<Q", raw[9:17])
    code = raw[17]
    if version != 1 or code not in _DTYPES:
        raise DataVerificationError(f"{idx_path}: unsupported index version {version} / dtype code {code}")
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    off = 34
    lengths = np.frombuffer(raw, np.int32, n_seq, off)
    off += 4 * n_seq
    pointers = np.frombuffer(raw, np.int64, n_seq, off)
    off += 8 * n_seq
    docs = np.frombuffer(raw, np.int64, n_doc, off)
    if off + 8 * n_doc != len(raw):
        raise DataVerificationError(f"{idx_path}: index size does not match its counts (truncated or padded)")
    return np.dtype(_DTYPES[code]), lengths, pointers, docs


def verify_shard(prefix: str, vocab_size: int, mask_id: int | None = None) -> tuple[int, int]:
    """Check one .bin/.idx pair, and that the clean tokens never hold the mask id; returns (documents, tokens)."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if not idx.exists() or not bin_.exists():
        raise DataVerificationError(f"{prefix}: .idx or .bin missing")
    dtype, lengths, pointers, docs = read_index(idx)
    expected_pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64))]) * dtype.itemsize
    if len(lengths) and not np.array_equal(pointers, expected_pointers):
        raise DataVerificationError(f"{idx}: sequence pointers are inconsistent with the lengths")
    if not (len(docs) == len(lengths) + 1 and docs[0] == 0 and np.all(np.diff(docs) == 1)):
        raise DataVerificationError(f"{idx}: document indices are not one per sequence")
    n_tokens = int(lengths.astype(np.int64).sum())
    if bin_.stat().st_size != n_tokens * dtype.itemsize:
        raise DataVerificationError(
            f"{bin_}: {bin_.stat().st_size} bytes but the index describes {n_tokens} tokens of "
            f"{dtype.itemsize} bytes ({n_tokens * dtype.itemsize}); the shard is truncated or corrupt"
        )
    if n_tokens:
        tokens = np.memmap(bin_, dtype=dtype, mode="r")
        top, low = int(tokens.max()), int(tokens.min())
        if top >= vocab_size or low < 0:
            raise DataVerificationError(
                f"{bin_}: token id {top if top >= vocab_size else low} is outside the vocabulary [0, {vocab_size})"
            )
        masks = 0 if mask_id is None else int(np.count_nonzero(tokens == mask_id))
        if masks:  # a clean token equal to the mask would look masked to the model and never be scored
            raise DataVerificationError(
                f"{bin_}: the mask token id {mask_id} occurs {masks} times in the clean data (its text was "
                f"tokenized as the special token; today's data prep encodes it as plain text)"
            )
    return len(lengths), n_tokens


def verify_mask(prefix: str) -> int:
    """Check the loss mask beside token shard `prefix`: uint8, the shard's sequence lengths and document indices,
    only 0 and 1; returns its scored tokens."""
    mask = loss_mask_prefix(prefix)
    idx, bin_ = Path(mask + ".idx"), Path(mask + ".bin")
    if not idx.exists() or not bin_.exists():
        raise DataVerificationError(f"{mask}: the loss mask of {prefix} is missing (.idx or .bin)")
    dtype, lengths, _, docs = read_index(idx)
    _, token_lengths, _, token_docs = read_index(Path(prefix + ".idx"))
    if dtype != np.uint8:
        raise DataVerificationError(f"{idx}: a loss mask is uint8, this one is {dtype}")
    if not np.array_equal(lengths, token_lengths) or not np.array_equal(docs, token_docs):
        raise DataVerificationError(
            f"{idx}: the loss mask's {len(lengths)} sequences ({int(lengths.sum())} tokens) do not match the token "
            f"shard's {len(token_lengths)} ({int(token_lengths.sum())} tokens)"
        )
    n = int(lengths.astype(np.int64).sum())
    if bin_.stat().st_size != n:
        raise DataVerificationError(
            f"{bin_}: {bin_.stat().st_size} bytes, the index describes {n}; truncated or corrupt"
        )
    values = np.memmap(bin_, dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)
    if n and int(values.max()) > 1:
        raise DataVerificationError(f"{bin_}: a loss mask holds 0 and 1 only, this one {int(values.max())}")
    return int(values.sum())


def verify(manifest: DataManifest) -> dict:
    """Verify every shard of a manifest; returns {'shards', 'documents', 'tokens'} checked."""
    vocab, mask_id = manifest.tokenizer.vocab_size, manifest.tokenizer.mask_id
    hint = f"delete {manifest.dir} and rerun data prep"
    shards = docs_total = tokens_total = 0
    try:
        for split, s in manifest.splits.items():
            per_source: dict[str, list[int]] = {}
            for prefix in s.prefixes:
                n_docs, n_tok = verify_shard(prefix, vocab, mask_id)
                if manifest.loss_masks:
                    verify_mask(prefix)
                src = Path(prefix).parent.name
                acc = per_source.setdefault(src, [0, 0])
                acc[0] += n_docs
                acc[1] += n_tok
                shards += 1
            for src, counts in s.sources.items():
                got = per_source.get(src, [0, 0])
                if got != [counts["documents"], counts["tokens"]]:
                    raise DataVerificationError(
                        f"{split}/{src}: shards hold {got[0]} documents / {got[1]} tokens, the manifest says "
                        f"{counts['documents']} / {counts['tokens']}"
                    )
                docs_total, tokens_total = docs_total + got[0], tokens_total + got[1]
    except DataVerificationError as err:
        raise DataVerificationError(f"{err}. To fix: {hint}.") from None
    return {"shards": shards, "documents": docs_total, "tokens": tokens_total}
