"""The unique-data budget: which documents a budget takes (deterministic, nested, within one document of N, the
same for any sharding of the split), the subset's shards, and the subset of a real prep (held-out split untouched)."""

from pathlib import Path

import numpy as np
import pytest
from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile
from helpers import tiny_config

from difflm.data_prep.budget import document_order, select, subset_tokens, write_subset
from difflm.data_prep.pipeline import DataPrepError, data_dir, prepare_data
from difflm.data_prep.verify import read_index, verify_shard
from difflm.manifest import DataManifest


def _documents(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, rng.integers(5, 40)).astype(np.uint16) for _ in range(n)]


def _write(folder, name: str, docs: list[np.ndarray]) -> str:
    writer = MegatronTokenizedFile(str(folder), name, token_size=2)
    for d in docs:
        writer.write(d)
    writer.close()
    return str(folder / name)


def _shards(folder, docs: list[np.ndarray], cuts: list[int]) -> list[str]:
    """`docs` split over shards at `cuts`, the first half as source `a`, the rest as `b`."""
    bounds = [0, *cuts, len(docs)]
    return [
        _write(folder, f"train/{'a' if lo < len(docs) // 2 else 'b'}/{i:05d}_tokens", docs[lo:hi])
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
    ]


def _chosen_tokens(prefixes, chosen) -> list[bytes]:
    out = []
    for shard, doc in chosen:
        dtype, lengths, pointers, _ = read_index(Path(prefixes[shard] + ".idx"))
        tokens = np.fromfile(prefixes[shard] + ".bin", dtype=dtype)
        start = pointers[doc] // dtype.itemsize
        out.append(tokens[start : start + lengths[doc]].tobytes())
    return out


def _all_documents(manifest: DataManifest) -> list[bytes]:
    (prefix,) = manifest.splits["train"].prefixes  # one source: one shard
    return _chosen_tokens([prefix], [(0, i) for i in range(manifest.splits["train"].documents)])


def test_a_budget_is_within_one_document_of_n_deterministic_and_nested(tmp_path):
    docs = _documents(60)
    prefixes = _shards(tmp_path, docs, [20, 30])
    order = document_order(prefixes, seed=0)
    assert order == document_order(prefixes, seed=0)
    longest = max(len(d) for d in docs)
    taken = {}
    for n in (50, 200, 400, 800):
        chosen = select(order, n)
        total = sum(len(t) // 2 for t in _chosen_tokens(prefixes, chosen))
        assert n <= total < n + longest
        assert subset_tokens(order, n) == total  # the count `difflm study --plan` uses, without writing the subset
        taken[n] = chosen
    assert taken[50] == taken[200][: len(taken[50])] and taken[200] == taken[400][: len(taken[200])]
    assert select(order, 10**9) == [(s, d) for _, s, d, _ in order]  # more than the split: all of it
    assert select(document_order(prefixes, seed=1), 400) != taken[400]  # another salt, another subset


def test_the_subset_does_not_depend_on_how_the_split_is_sharded(tmp_path):
    docs = _documents(40, seed=3)
    one = _shards(tmp_path / "one", docs, [])
    many = _shards(tmp_path / "many", docs, [5, 17, 29])
    pick = lambda prefixes: sorted(_chosen_tokens(prefixes, select(document_order(prefixes, 7), 300)))  # noqa: E731
    assert pick(one) == pick(many)


def test_the_subset_is_written_in_hash_order_one_shard_per_source(tmp_path):
    docs = _documents(30, seed=5)
    prefixes = _shards(tmp_path / "prep", docs, [10, 20])
    chosen = select(document_order(prefixes, 0), 250)
    write_subset(prefixes, chosen, tmp_path / "subset", token_bytes=2)
    written = {}
    for src in ("a", "b"):
        prefix = str(tmp_path / "subset" / "train" / src / "00000_tokens")
        n_docs, _ = verify_shard(prefix, vocab_size=512)
        written[src] = _chosen_tokens([prefix], [(0, i) for i in range(n_docs)])
    expected = _chosen_tokens(prefixes, chosen)
    source = [Path(prefixes[shard]).parent.name for shard, _ in chosen]
    assert written == {s: [t for t, src in zip(expected, source) if src == s] for s in "ab"}


def test_a_budget_of_a_real_prep_keeps_the_held_out_split_and_is_reused(session_dir, tiny_manifest, capsys):
    workdir = session_dir / "shared"  # the session's prep: only the subset is written here
    cfg = tiny_config(workdir, "data.unique_tokens=1000")
    small = prepare_data(cfg)
    assert DataManifest.read(data_dir(cfg) / "manifest.json") == small
    train, full = small.splits["train"], tiny_manifest.splits["train"]
    assert small.budget["split_tokens"] == full.tokens and small.budget["from"] == tiny_manifest.dir
    longest = max(int(read_index(Path(p + ".idx"))[1].max()) for p in full.prefixes)
    assert small.budget["tokens"] == train.tokens and 1000 <= train.tokens < 1000 + longest
    assert train.documents < full.documents and small.hash != tiny_manifest.hash
    assert small.splits["valid"] == tiny_manifest.splits["valid"]  # the same held-out tokens
    assert small.tokenizer == tiny_manifest.tokenizer
    assert prepare_data(cfg) == small  # reused: written once
    larger = prepare_data(tiny_config(workdir, "data.unique_tokens=60000"))
    assert larger.splits["train"].documents > train.documents
    assert _all_documents(larger)[: train.documents] == _all_documents(small)  # nested: a prefix of it
    with pytest.raises(DataPrepError, match=f"more than the training split holds \\({full.tokens:,} tokens"):
        prepare_data(tiny_config(workdir, f"data.unique_tokens={full.tokens + 1}"))
    assert not data_dir(tiny_config(workdir, f"data.unique_tokens={full.tokens + 1}")).exists()
