"""The confident-model benchmark's data and score (benchmarks/confident_decoding.py), without training: the corpus
is the same for the same seed and every continuation in it is determined by its prompt; the score counts a
completion cut short by the token budget and nothing that strays."""

from __future__ import annotations

import json

from benchmarks.confident_decoding import BASELINE, PROMPT_WORDS, WORDS, continues, decoders, prompts, write_corpus


def test_the_corpus_is_seeded_and_each_document_repeats_one_word(tmp_path):
    first = write_corpus(tmp_path / "a.jsonl", seed=0).read_text()
    assert first == write_corpus(tmp_path / "b.jsonl", seed=0).read_text()
    assert first != write_corpus(tmp_path / "c.jsonl", seed=1).read_text()
    docs = [json.loads(line)["text"].split() for line in first.splitlines()]
    assert len(docs) == 400 and all(40 <= len(d) <= 80 and len(set(d)) == 1 and d[0] in WORDS for d in docs)
    assert len({d[0] for d in docs}) == len(WORDS)  # every word is seen in training


def test_prompts_name_their_word_and_the_score_accepts_only_its_continuation():
    (prompt, truth), *_ = prompts(3)
    word = prompt.split()[0]
    assert prompt.split() == [word] * PROMPT_WORDS and truth == [word] * 64
    assert continues(f" {word} {word} {word[:2]}", truth)  # the last word cut by the token budget
    other = next(w for w in WORDS if w != word)
    assert not continues(f" {word} {other} {word}", truth) and not continues("", truth)
    assert not continues(" ".join([word] * 66), truth)  # longer than what is known


def test_the_baseline_comes_first_and_block_rows_only_when_asked():
    rows = decoders(24, block=False)
    assert rows[0] == (BASELINE, "difflm-noshift", {"steps": 24}) and rows[-1][1] == "ar"
    assert {mode for _, mode, _ in rows} == {"difflm-noshift", "ar"}
    assert {mode for _, mode, _ in decoders(24, block=True)} == {"difflm-noshift", "difflm-block", "ar"}
