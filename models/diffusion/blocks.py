"""Block diffusion (BD3-LM): the attention rule of the two-stream layout, per-block noise, the block ELBO.

Pure torch, shipped flat in every export folder. Training and evaluation run the model on `[x_t | x_0]`
(length 2L, RoPE positions 0..L-1 in both halves) under one rule (kuleshov-group/bd3lms `block_diff_mask`):
- a noisy token sees its own noisy block (bidirectional) and the strictly earlier CLEAN blocks;
- a clean token sees the clean blocks up to its own (block-causal), or the clean tokens up to itself
  (token-causal: Megatron-Bridge's `sbd_block_diff`, which makes the clean half an AR model);
- no clean token ever sees a noisy one.
Decoding is the same rule on [finished blocks (clean) | the current block (noisy)], with the blocks of training:
anchored at position 0 (BD3-LM, Fast-dLLM v2), so the prompt's last, partial block is the first noisy one, its
prompt tokens kept. The keys and values of finished blocks are exactly those of the clean half: a KV cache of
them is exact. `DecodeLayout` places a left-padded batch so that every row keeps its own partition.

`allowed` is written on index tensors so it serves as a dense mask here and as FlexAttention's mask_mod.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .noise import NOISE_DEVICE
from .objectives import token_cross_entropy

CLEAN_ATTENTION = ("block_causal", "token_causal")


def allowed(q_noisy, q_block, q_pos, k_noisy, k_block, k_pos, token_causal: bool):
    """May query (noisy?, block, position) attend to key (noisy?, block, position)? Broadcasting tensors."""
    clean_k = ~k_noisy
    clean_rule = (k_pos <= q_pos) if token_causal else (k_block <= q_block)
    return (
        (q_noisy & k_noisy & (q_block == k_block))
        | (q_noisy & clean_k & (k_block < q_block))
        | (~q_noisy & clean_k & clean_rule)
    )


def two_stream_index(length: int, block_size: int, device=None):
    """(noisy [2L], block [2L], position [2L]) of the `[x_t | x_0]` layout."""
    pos = torch.arange(length, device=device).repeat(2)
    noisy = torch.arange(2 * length, device=device) < length
    return noisy, pos // block_size, pos


def two_stream_keep(
    length: int,
    block_size: int,
    token_causal: bool = False,
    document_ids: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """[b or 1, 1, 2L, 2L] bool, True where attention is allowed (SDPA's convention), of the `[x_t | x_0]` layout.

    `document_ids` [b, L] keeps attention within packed documents (both halves carry the same ids); `real`
    [b, L] (False at padding) removes padding keys, every token keeping at least itself (no empty row)."""
    device = next((x.device for x in (real, document_ids) if x is not None), device)
    noisy, block, pos = two_stream_index(length, block_size, device)
    keep = allowed(noisy[:, None], block[:, None], pos[:, None], noisy[None], block[None], pos[None], token_causal)[
        None
    ]  # [1, 2L, 2L]
    if document_ids is not None:
        doc = document_ids.repeat(1, 2)
        keep = keep & (doc[:, :, None] == doc[:, None, :])
    if real is not None:
        eye = torch.eye(2 * length, dtype=torch.bool, device=real.device)
        keep = keep & (real.bool().repeat(1, 2)[:, None, :] | eye)
    return keep[:, None]


def decode_keep(
    n_keys: int, n_queries: int, noisy_from: int, block_size: int, token_causal: bool, device=None
) -> torch.Tensor:
    """[1, 1, n_queries, n_keys] bool: the rule for the last `n_queries` of `n_keys` positions of a decoded
    sequence whose positions from `noisy_from` on are the current (noisy) block; blocks are those of training,
    `position // block_size` (a `DecodeLayout` canvas gives every row this partition)."""
    pos = torch.arange(n_keys, device=device)
    block = torch.div(pos, block_size, rounding_mode="floor")
    noisy = pos >= noisy_from
    q = slice(n_keys - n_queries, n_keys)
    keep = allowed(noisy[q, None], block[q, None], pos[q, None], noisy[None], block[None], pos[None], token_causal)
    return keep[None, None]


def causal_call_keep(n_keys: int, n_queries: int, block_size: int, token_causal: bool, device=None) -> torch.Tensor:
    """[1, 1, n_queries, n_keys] bool: the rule of a one-stream call without a rule of its own (the export called as
    a causal LM is, e.g. by diffusers' LLaDA2Pipeline): the block of the last key is the noisy one being decoded,
    every earlier block is finished (clean). Under block_causal this is the block-causal mask whatever is noisy."""
    last_block = (n_keys - 1) // block_size * block_size if n_keys else 0
    return decode_keep(n_keys, n_queries, last_block, block_size, token_causal, device)


@dataclass(frozen=True)
class DecodeLayout:
    """Where block decoding of a LEFT-padded batch writes: one canvas [b, width] whose grid blocks
    (`column // block_size`) are every row's own blocks counted from its first real token, as in training.

    Row r's prompt of n_r tokens starts at column `block_size * (Q - n_r // block_size)`, so every prompt ends
    inside grid block Q = max_r n_r // block_size, the first block decoded (its prompt tokens stay fixed); the
    row's `new_tokens` follow at once; the width is whole blocks. Columns before and after a row's tokens are
    padding (never attended).
    RoPE is relative, so moving a row along the canvas changes none of its logits."""

    block_size: int
    new_tokens: int
    first_block: int  # Q: every row's first noisy block
    width: int
    starts: torch.Tensor  # [b] column of each row's first prompt token
    begins: torch.Tensor  # [b] column of each row's first new token

    @classmethod
    def of(cls, real: torch.Tensor, new_tokens: int, block_size: int) -> DecodeLayout:
        """The layout of prompts with `real` [b, p] (True at tokens, LEFT-padded)."""
        n = real.long().sum(-1)
        full = torch.div(n, block_size, rounding_mode="floor")
        first = int(full.max()) if len(n) else 0
        starts = block_size * (first - full)
        begins = starts + n
        end = int(begins.max()) + new_tokens if len(n) else new_tokens
        width = -(-end // block_size) * block_size  # whole blocks: a block's step schedule is the same in any batch
        return cls(block_size, new_tokens, first, width, starts, begins)

    def columns(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.starts.device)[None]

    def generated(self) -> torch.Tensor:
        """[b, width] bool: the columns of the new tokens."""
        cols = self.columns()
        return (cols >= self.begins[:, None]) & (cols < self.begins[:, None] + self.new_tokens)

    def keys(self) -> torch.Tensor:
        """[b, width] bool: the columns that hold a row's tokens (prompt or new), the others are padding."""
        cols = self.columns()
        return (cols >= self.starts[:, None]) & (cols < self.begins[:, None] + self.new_tokens)

    def place(self, prompt: torch.Tensor, new: torch.Tensor | int, padding: int) -> torch.Tensor:
        """[b, width]: the rows of `prompt` [b, p] (LEFT-padded) on the canvas, `new` (a value, or [b] one per
        row) at the new tokens' columns, `padding` elsewhere."""
        b, p = prompt.shape
        cols = self.columns()
        new = torch.as_tensor(new, dtype=prompt.dtype, device=prompt.device).expand(b)
        out = torch.where(self.generated(), new[:, None], torch.full_like(new[:, None], padding))
        if p:
            in_prompt = (cols >= self.starts[:, None]) & (cols < self.begins[:, None])
            src = (cols - self.begins[:, None] + p).clamp(0, p - 1)  # the prompt ends at column p - 1
            out = torch.where(in_prompt, prompt.gather(1, src), out)
        return out

    def blocks(self) -> list[tuple[int, int]]:
        """[start, end) canvas columns of the blocks to decode, from the first noisy block on."""
        size = self.block_size
        return [(a, a + size) for a in range(self.first_block * size, self.width, size)]

    def continuation(self, canvas: torch.Tensor) -> torch.Tensor:
        """[b, new_tokens]: the new tokens of each row."""
        index = self.begins[:, None] + torch.arange(self.new_tokens, device=canvas.device)[None]
        return canvas.gather(1, index)


def attention_pairs(length: int, block_size: int, token_causal: bool) -> int:
    """(query, key) pairs the two-stream rule allows for a sequence of `length` (what a block-sparse kernel
    needs to compute, at token granularity)."""
    sizes = [min(block_size, length - a) for a in range(0, length, block_size)]
    before, pairs = 0, 0
    for n in sizes:
        pairs += n * n + n * before  # noisy: own block, earlier clean blocks
        pairs += 0 if token_causal else n * (before + n)  # clean, block-causal
        before += n
    return pairs + (length * (length + 1) // 2 if token_causal else 0)


def block_counts(scored: torch.Tensor, block_size: int) -> torch.Tensor:
    """Scored tokens per block [b, n_blocks] of `scored` [b, s]."""
    b, s = scored.shape
    nb = -(-s // block_size)
    padded = torch.zeros(b, nb * block_size, dtype=torch.long, device=scored.device)
    padded[:, :s] = scored.long()
    return padded.view(b, nb, block_size).sum(-1)


def mask_per_block(
    scored: torch.Tensor, counts: torch.Tensor, block_size: int, generator: torch.Generator | None
) -> torch.Tensor:
    """[b, s] bool: `counts` [b, n_blocks] positions drawn uniformly among the scored ones of each block."""
    b, s = scored.shape
    nb = counts.shape[1]
    keys = torch.rand(b, nb * block_size, generator=generator, device=NOISE_DEVICE)
    keys[:, :s] = keys[:, :s].masked_fill(~scored.to(NOISE_DEVICE).bool(), 2.0)  # never drawn
    keys[:, s:] = 2.0
    rank = keys.view(b, nb, block_size).argsort(-1).argsort(-1)
    return (rank < counts.to(NOISE_DEVICE)[..., None]).view(b, -1)[:, :s]


def stratified_block_counts(
    n: torch.Tensor, sample: int, samples: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Mask counts l in 1..n per block (`n` [b, nb] scored tokens per block), bin `sample` of `samples`: averaged
    over the bins l is uniform on {1..n}, the discrete ELBO's weight n / l stays unbiased."""
    u = torch.rand(n.shape, generator=generator, device=NOISE_DEVICE)
    n = n.to(NOISE_DEVICE)
    return torch.minimum((((sample + u) / samples) * n).ceil().clamp(min=1), n.clamp(min=1)).long()


@torch.no_grad()
def block_elbo_terms(
    logits_fn,
    x0: torch.Tensor,
    scored: torch.Tensor,
    mask_id: int,
    block_size: int,
    samples: int,
    generator,
    max_rows: int = 64,
) -> torch.Tensor:
    """Total nats [b] (float64, CPU) of the block ELBO of the `scored` tokens of x0 [b, s]: for every block j,
    the discrete masked ELBO of its scored tokens given the earlier clean blocks and its own unscored tokens,
    E_{l ~ U{1..n_j}} E_{|M| = l} [(n_j / l) sum_{i in M} -log p(x_i | x_t^j, x_0^{<j})], summed over blocks
    (`samples` draws, l stratified per block). One model call scores every block of a row at once:
    `logits_fn(x_t, x_0, rows)` -> logits of the noisy half, `rows` the indices into x0 of the given rows."""
    b, s = x0.shape
    n = block_counts(scored, block_size)  # [b, nb]
    masks, weights = [], []
    for k in range(samples):
        counts = stratified_block_counts(n, k, samples, generator) * (n > 0).to(NOISE_DEVICE)
        masked = mask_per_block(scored, counts, block_size, generator)
        weight = (n.to(NOISE_DEVICE) / counts.clamp(min=1)).double()  # [b, nb]
        masks.append(masked)
        weights.append(weight.repeat_interleave(block_size, dim=1)[:, :s])  # [b, s]
    masked, weight = torch.cat(masks), torch.cat(weights)  # sample-major [samples * b, s]
    owner = torch.arange(b, device=NOISE_DEVICE).repeat(samples)
    total = torch.zeros(b, dtype=torch.float64, device=NOISE_DEVICE)
    for a in range(0, len(owner), max_rows):
        sl = slice(a, a + max_rows)
        rows = owner[sl].to(x0.device)
        clean, m = x0[rows], masked[sl].to(x0.device)
        xt = torch.where(m, torch.full_like(clean, mask_id), clean)
        ce = token_cross_entropy(logits_fn(xt, clean, rows), clean)
        total.index_add_(0, owner[sl], ((ce * m).double().to(NOISE_DEVICE) * weight[sl]).sum(-1))
    return total / samples


@torch.no_grad()
def block_greedy_match(
    logits_fn, x0: torch.Tensor, target: torch.Tensor, mask_id: int, block_size: int, vocab_limit: int | None = None
) -> torch.Tensor:
    """Would greedy block decoding reproduce the `target` tokens of x0 [b, s]? [b] bool. Each block is decoded
    one token per step, most confident position first, given the earlier blocks clean. Every block is decoded at
    once: a noisy block sees only itself and the earlier clean blocks, which decoding has made equal to x0 as
    long as it matches, and one mismatch makes the row False whatever follows. `logits_fn(x_t, x_0)` -> logits of
    the noisy half."""
    b, s = x0.shape
    nb = -(-s // block_size)
    x = torch.where(target, torch.full_like(x0, mask_id), x0)
    steps = int(block_counts(target, block_size).max()) if s else 0
    for _ in range(steps):
        masked = x == mask_id
        if not masked.any():
            break
        logits = logits_fn(x, x0).float()
        if vocab_limit is not None:
            logits = logits[..., :vocab_limit]
        logits[..., mask_id] = float("-inf")
        conf, pred = torch.softmax(logits, -1).max(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        padded = torch.full((b, nb * block_size), -2.0, device=conf.device)
        padded[:, :s] = conf
        per_block = padded.view(b, nb, block_size)
        rows, blocks = (per_block > -1.0).any(-1).nonzero(as_tuple=True)  # blocks with a masked position
        pos = blocks * block_size + per_block.argmax(-1)[rows, blocks]
        x[rows, pos] = pred[rows, pos]
    return (x == x0).all(-1)
