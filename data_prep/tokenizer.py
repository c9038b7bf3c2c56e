"""Tokenizers for the pipeline: train a byte-level BPE on the corpus, or load any local HF tokenizer.

Masked diffusion needs a mask token; we never guess one. A trained tokenizer gets the configured
special tokens (eos, mask, pad) as ids 0..2; a loaded one must already contain them, or the error
says how to add them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from difflm.config import TokenizerConfig
from difflm.errors import UserError
from difflm.manifest import TokenizerInfo  # the data manifest's record of a tokenizer
from difflm.outputs import staged_output


class TokenizerError(UserError, ValueError):
    """The configured tokenizer cannot be trained or loaded; the message says what to pass instead."""


def _special_ids(tok, cfg: TokenizerConfig, where: str) -> tuple[int, int, int]:
    ids = {}
    for role in ("eos_token", "mask_token", "pad_token"):
        token = getattr(cfg, role)
        tid = tok.token_to_id(token)
        if tid is None:
            raise TokenizerError(
                f"tokenizer at {where} has no {role} {token!r}; masked diffusion needs it. Either set "
                f"tokenizer.{role} to a token the tokenizer has, or add it once with transformers: "
                f"tok = AutoTokenizer.from_pretrained(path); tok.add_special_tokens("
                f"{{'{role if role != 'eos_token' else 'eos_token'}': '{token}'}}); tok.save_pretrained(path)"
            )
        ids[role] = tid
    return ids["eos_token"], ids["mask_token"], ids["pad_token"]


def _save_hf_folder(tok, cfg: TokenizerConfig, folder: Path) -> None:
    """Save as an HF tokenizer folder, atomically: an interrupted save never looks like a tokenizer."""
    # transformers (seconds to import) only to write the HF folder: data prep's preflight and workers load without it
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=cfg.eos_token, mask_token=cfg.mask_token, pad_token=cfg.pad_token
    )
    with staged_output(folder) as tmp:  # the folder is this stage's own (content-addressed in the workdir)
        hf.save_pretrained(str(tmp))


def describe(folder: Path, cfg: TokenizerConfig) -> TokenizerInfo:
    """The TokenizerInfo of a saved tokenizer folder (checks the special tokens again)."""
    tok_file = folder / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_file))
    eos, mask, pad = _special_ids(tok, cfg, str(folder))
    return TokenizerInfo(
        path=str(folder.resolve()),
        vocab_size=tok.get_vocab_size(),
        eos_id=eos,
        mask_id=mask,
        pad_id=pad,
        sha256=hashlib.sha256(tok_file.read_bytes()).hexdigest(),
        special_ids=tuple(
            sorted({i for i, t in tok.get_added_tokens_decoder().items() if t.special} | {eos, mask, pad})
        ),
    )


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig, folder: Path) -> TokenizerInfo:
    """Train a byte-level BPE (GPT-2 style) with the special tokens first; save an HF folder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[cfg.eos_token, cfg.mask_token, cfg.pad_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    _save_hf_folder(tok, cfg, folder)
    return describe(folder, cfg)


def load_tokenizer(cfg: TokenizerConfig, folder: Path) -> TokenizerInfo:
    """Copy a user tokenizer (folder with tokenizer.json, or the file) into `folder` and describe it."""
    src = Path(cfg.path).expanduser()
    tok_file = src / "tokenizer.json" if src.is_dir() else src
    if not tok_file.exists():
        raise TokenizerError(
            f"tokenizer.path {cfg.path!r}: no tokenizer.json found there. Give a local Hugging Face "
            f"tokenizer folder (with tokenizer.json) or the tokenizer.json file itself; hub names are not "
            f"fetched at run time."
        )
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"could not load tokenizer {tok_file}: {err}") from err
    _special_ids(tok, cfg, str(tok_file))
    _save_hf_folder(tok, cfg, folder)
    return describe(folder, cfg)
