import bz2
import json
import re

import pytest

from difflm.data_prep import corpus


def test_wiki_markup_is_stripped():
    markup = (
        "{{Infobox person|name=X|born={{birth date|1900|1|1}}}}'''Ada''' was a [[mathematician|mathematician]] "
        "from [[London]].<ref>Cite {{cite book}}</ref> [[File:Ada.jpg|thumb|A [[portrait]]]]\n"
        "== Life ==\n* She wrote [http://example.org notes].\n{| class=wikitable\n|a||b\n|}\n"
        "[[Category:People]]\n== References ==\nignored text"
    )
    text = corpus.wiki_to_text(markup)
    assert text.startswith("Ada was a mathematician from London.")
    assert "Life." in text and "She wrote notes." in text
    for junk in ("{{", "[[", "<ref", "Category", "wikitable", "ignored text", "'''"):
        assert junk not in text


def test_wiki_documents_skip_redirects_and_other_namespaces():
    xml = (
        '<mediawiki><page><title>A</title><ns>0</ns><revision><text xml:space="preserve">Alpha text.</text>'
        "</revision></page><page><title>B</title><ns>0</ns><revision><text>#REDIRECT [[A]]</text></revision></page>"
        "<page><title>Talk:A</title><ns>1</ns><revision><text>chat</text></revision></page></mediawiki>"
    )
    docs = corpus.wiki_documents(bz2.compress(xml.encode()))
    assert [d["title"] for d in docs] == ["A"] and docs[0]["text"] == "Alpha text."


def test_demo_corpus_is_real_cached_text():
    path = corpus.demo_corpus("enwiki")
    assert path == corpus.demo_corpus("enwiki")  # cached: the same file, no refetch
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(docs) > 100 and sum(len(d["text"]) for d in docs) > 2_000_000
    assert all(d["license"].startswith("CC BY-SA") for d in docs)
    # the dump escapes the wikitext, whose own entities (&nbsp;) are text: none may reach the corpus
    entities = [m for d in docs for m in re.findall(r"&[a-zA-Z]+;|&#\d+;", d["text"])]
    assert not entities, entities[:10]


def test_wikitext_entities_become_text():
    assert corpus.wiki_to_text("5&amp;nbsp;km &amp;ndash; [[Paris]]&amp;#39;s") == "5 km \u2013 Paris's"


def test_checksum_mismatch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFLM_CACHE", str(tmp_path))
    src = corpus.SOURCES["enwiki"]
    bad = corpus.EmbeddedSource(**{**src.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(corpus.SOURCES, "enwiki", bad)
    # seed the cache with the real file so no download is needed: its digest will not match
    raw = tmp_path / "enwiki" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    raw.parent.mkdir(parents=True)
    raw.write_bytes(b"not the real dump")
    monkeypatch.setattr(
        corpus,
        "_fetch_member",
        lambda s, dest: (_ for _ in ()).throw(corpus.CorpusError(f"checksum mismatch for {s.member}")),
    )
    with pytest.raises(corpus.CorpusError, match="checksum mismatch"):
        corpus.demo_corpus("enwiki")


def test_unknown_corpus_name():
    with pytest.raises(corpus.CorpusError, match="available: enwiki"):
        corpus.demo_corpus("nope")
