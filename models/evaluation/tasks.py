"""Benchmark tasks built from the user's own held-out data, scored by any export.

- `cloze` (LAMBADA-style): a passage that ends just before the last word of a sentence; the model must
  predict that word. Accuracy: greedy decoding reproduces it (lm-eval's `is_greedy`); also its
  conditional NLL.
- `documents`: whole held-out documents (cut to 200 words): rolling log-likelihood, bits per byte.
- `choice`: a passage and four continuations of equal word count, the true one and three taken from other
  held-out documents (from distant parts of the same ones when the split has fewer than four). Accuracy: the true continuation has the highest log-likelihood (`acc`), or per byte
  (`acc_norm`), as lm-eval's multiple_choice.

Items depend only on the held-out split and the seed, so every run on the same data (ar and diffusion
alike) is scored on the same items. `write_lm_eval_tasks` writes them as JSONL with lm-eval task YAMLs, so
`lm_eval --include_path` scores exactly the same items.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import yaml

from difflm.manifest import DataManifest

WORD = re.compile(r"\S+")
SENTENCE_END = re.compile(r"^([A-Za-z][A-Za-z'-]*[A-Za-z])[.!?]['\")]*$")


def heldout_documents(manifest: DataManifest, tokenizer, limit: int = 2000) -> list[str]:
    """The held-out documents as text (special tokens dropped), in order."""
    # megatron-core only to read prepared shards: scoring an export loads without it
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = []
    for prefix in manifest.split("valid").prefixes:
        ds = IndexedDataset(prefix)
        for i in range(len(ds)):
            docs.append(tokenizer.decode(np.asarray(ds[i]).tolist(), skip_special_tokens=True).strip())
            if len(docs) >= limit:
                return docs
    return docs


def _words(text: str) -> list[re.Match]:
    return list(WORD.finditer(text))


def cloze_items(docs: list[str], n: int, seed: int, context_words: int = 40, min_context_words: int = 8) -> list[dict]:
    """Up to n items {context, target}: `target` the last word of a sentence (punctuation dropped)."""
    candidates = []
    for d, text in enumerate(docs):
        words = _words(text)
        for k in range(min_context_words, len(words)):
            m = SENTENCE_END.match(words[k].group())
            if m:
                candidates.append((d, k, m.group(1)))
    picked = random.Random(seed).sample(candidates, min(n, len(candidates)))
    items = []
    for d, k, word in sorted(picked):
        words = _words(docs[d])
        start = words[max(0, k - context_words)].start()
        items.append({"context": docs[d][start : words[k].start()].strip(), "target": word})
    return items


def choice_items(
    docs: list[str], n: int, seed: int, context_words: int = 32, continuation_words: int = 8, choices: int = 4
) -> list[dict]:
    """Up to n items {context, choices, gold}: the true continuation among `choices` - 1 from other documents."""
    rng = random.Random(seed)
    span = context_words + continuation_words
    usable = [d for d, t in enumerate(docs) if len(_words(t)) >= span]
    if not usable:
        return []
    items = []
    for _ in range(n):  # documents may repeat (at other offsets): small held-out splits still give n items
        d = rng.choice(usable)
        words = _words(docs[d])
        k = rng.randrange(0, len(words) - span + 1)
        context = docs[d][words[k].start() : words[k + context_words - 1].end()]
        options = [_span(docs[d], words, k + context_words, continuation_words)]
        # distractors from other documents; from elsewhere in the same ones when there are too few
        pool = [u for u in usable if u != d] if len(usable) >= choices else usable
        for _ in range(100 * choices):
            if len(options) == choices:
                break
            other = _words(docs[o := rng.choice(pool)])
            j = rng.randrange(0, len(other) - continuation_words + 1)
            if o == d and abs(j - (k + context_words)) < span:
                continue  # too near the true continuation
            cand = _span(docs[o], other, j, continuation_words)
            if cand not in options:
                options.append(cand)
        if len(options) < choices:
            continue
        gold = rng.randrange(choices)
        options[0], options[gold] = options[gold], options[0]
        items.append({"context": context, "choices": options, "gold": gold})
    return items


def _span(text: str, words: list[re.Match], k: int, n: int) -> str:
    return " ".join(w.group() for w in words[k : k + n])


def document_items(docs: list[str], n: int, max_words: int = 200) -> list[dict]:
    """{text}: the first n held-out documents, cut to max_words words, for rolling log-likelihood (bits/byte)."""
    out = []
    for text in docs[:n]:
        words = _words(text)
        out.append({"text": text[: words[min(len(words), max_words) - 1].end()] if words else text})
    return [it for it in out if it["text"].strip()]


def build_items(docs: list[str], n_items: int, seed: int) -> dict[str, list[dict]]:
    return {
        "cloze": cloze_items(docs, n_items, seed),
        "choice": choice_items(docs, n_items, seed),
        "documents": document_items(docs, min(n_items, 16)),
    }


# ---- scoring ------------------------------------------------------------------------------------------


def stderr_of_mean(values: list[float]) -> float | None:
    """The standard error of the mean (lm-eval's: sample standard deviation / sqrt(n)); None below 2 values."""
    if len(values) < 2:
        return None
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def score_cloze(scorer, items: list[dict]) -> dict:
    res = scorer.loglikelihood([(it["context"], " " + it["target"]) for it in items])
    nll = [-ll for ll, _ in res]
    hits = [g for _, g in res]
    # None: the mode has no greedy order (uniform noise): the accuracy is not measured, not 0
    acc = None if any(g is None for g in hits) else float(np.mean(hits))
    return {
        "acc": acc,
        "acc_stderr": None if acc is None else stderr_of_mean([float(h) for h in hits]),
        "nll": float(np.mean(nll)),
        "nll_stderr": stderr_of_mean(nll),
        "items": len(items),
        "samples": [
            {"prompt": it["context"], "target": it["target"], "loglikelihood": -n, "is_greedy": g}
            for it, n, g in zip(items, nll, hits)
        ],
    }


def score_choice(scorer, items: list[dict]) -> dict:
    pairs = [(it["context"], " " + c) for it in items for c in it["choices"]]
    saved, scorer.greedy = scorer.greedy, False
    try:
        lls = [ll for ll, _ in scorer.loglikelihood(pairs)]
    finally:
        scorer.greedy = saved
    acc, acc_norm, nll, samples, i = [], [], [], [], 0
    for it in items:
        ll = lls[i : i + len(it["choices"])]
        i += len(it["choices"])
        per_byte = [v / len((" " + c).encode()) for v, c in zip(ll, it["choices"])]
        acc.append(int(np.argmax(ll)) == it["gold"])
        acc_norm.append(int(np.argmax(per_byte)) == it["gold"])
        nll.append(-ll[it["gold"]])
        samples.append({"prompt": it["context"], "choices": it["choices"], "gold": it["gold"], "loglikelihoods": ll})
    return {
        "acc": float(np.mean(acc)),
        "acc_stderr": stderr_of_mean([float(a) for a in acc]),
        "acc_norm": float(np.mean(acc_norm)),
        "acc_norm_stderr": stderr_of_mean([float(a) for a in acc_norm]),
        "nll": float(np.mean(nll)),
        "nll_stderr": stderr_of_mean(nll),
        "items": len(items),
        "chance": 1.0 / len(items[0]["choices"]) if items else math.nan,
        "samples": samples,
    }


def score_documents(scorer, items: list[dict]) -> dict:
    """Rolling log-likelihood of whole documents: bits per byte and nats per token (bounds for diffusion)."""
    texts = [it["text"] for it in items]
    lls = scorer.loglikelihood_rolling(texts)
    n_bytes = [len(t.encode()) for t in texts]
    n_tokens = sum(len(scorer.encode(t)) for t in texts)
    return {
        "bits_per_byte": -sum(lls) / math.log(2) / sum(n_bytes),
        # the spread of the documents' own bits/byte: how far the pooled number moves with other documents
        "bits_per_byte_stderr": stderr_of_mean([-ll / math.log(2) / b for ll, b in zip(lls, n_bytes) if b]),
        "nll_per_token": -sum(lls) / n_tokens,
        "items": len(items),
        "samples": [{"prompt": t, "loglikelihood": ll, "bytes": b} for t, ll, b in zip(texts, lls, n_bytes)],
    }


SCORERS = {"cloze": score_cloze, "choice": score_choice, "documents": score_documents}
SCORER_NAMES = {  # what each scorer computes, for the record's task protocol
    "cloze": "greedy match of the target word (is_greedy) and its conditional NLL",
    "choice": "highest log-likelihood of 4 continuations (acc) and per byte (acc_norm)",
    "documents": "rolling log-likelihood: bits per byte, nats per token",
}


def score_tasks(scorer, tasks: dict[str, list[dict]]) -> dict[str, dict]:
    return {name: SCORERS[name](scorer, items) for name, items in tasks.items() if items}


# ---- the same items for lm-eval -------------------------------------------------------------------------


def _task_yaml(task: str, data: Path) -> dict:
    """lm-eval task configs over our JSONL items (lm-eval adds target_delimiter " " before targets/choices)."""
    base = {
        "task": f"difflm_{task}",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "doc_to_text": "{{context}}",
    }
    acc = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
    if task == "cloze":
        return {
            **base,
            "output_type": "loglikelihood",
            "doc_to_target": "{{target}}",
            "metric_list": [acc, {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
        }
    if task == "cloze_gen":
        return {
            **base,
            "output_type": "generate_until",
            "doc_to_target": "{{target}}",
            "target_delimiter": " ",
            "generation_kwargs": {"until": [".", "\n", ",", ";"], "max_gen_toks": 6},
            "metric_list": [
                {
                    "metric": "exact_match",
                    "aggregation": "mean",
                    "higher_is_better": True,
                    "ignore_case": True,
                    "ignore_punctuation": True,
                    "regexes_to_ignore": ["\\s"],
                }
            ],
        }
    if task == "documents":
        return {
            **base,
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        }
    return {
        **base,
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "gold",
        "metric_list": [acc, {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }


def lm_eval_task_config(task: str) -> dict:
    """The lm-eval YAML of `task` as `write_lm_eval_tasks` writes it (the items' path aside): hashed into the
    evaluation record, so a changed task definition shows as a changed config digest."""
    return _task_yaml(task, Path(f"{task if task != 'cloze_gen' else 'cloze'}.jsonl"))


def write_lm_eval_tasks(tasks: dict[str, list[dict]], out_dir: Path) -> Path:
    """JSONL files and task YAMLs (difflm_cloze, difflm_cloze_gen, difflm_choice, difflm_documents) for
    `lm_eval --include_path out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, items in tasks.items():
        data = out_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps(it) + "\n" for it in items))
        for task in [name, *(["cloze_gen"] if name == "cloze" else [])]:
            (out_dir / f"difflm_{task}.yaml").write_text(
                yaml.safe_dump(_task_yaml(task, data.resolve()), sort_keys=False)
            )
    return out_dir
