"""The embedded demo corpus: real English text shipped inside a package on the registry.

The gensim 4.4.0 wheel carries a shortened English Wikipedia dump (CC BY-SA 3.0) among its test data.
On first use we fetch the wheel with pip (the configured package index, no other network), check the
member's SHA-256, strip the wiki markup and cache the documents as JSONL. Later runs read the cache.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import difflm
from difflm.errors import UserError


@dataclass(frozen=True)
class EmbeddedSource:
    name: str
    package: str  # pip requirement of the carrier package
    member: str  # path of the file inside the wheel
    sha256: str  # of the member, so the check is independent of the wheel's platform tag
    license: str
    origin: str


SOURCES = {
    "enwiki": EmbeddedSource(
        name="enwiki",
        package="gensim==4.4.0",
        member="gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
        sha256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
        license="CC BY-SA 3.0 (Wikipedia text), via gensim's test data (LGPL-2.1 package)",
        origin="English Wikipedia dump enwiki-latest-pages-articles1 (shortened), shipped in the gensim 4.4.0 wheel",
    ),
}


def cache_dir() -> Path:
    return Path(difflm.cache_dir())


class CorpusError(UserError, RuntimeError):
    """The embedded demo corpus cannot be fetched or fails its checksum."""


def _fetch_member(src: EmbeddedSource, dest: Path) -> Path:
    """Download the carrier wheel with pip, extract the member, verify its checksum."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            src.package,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            raise CorpusError(
                f"could not fetch {src.package} from the package index to get the demo corpus:\n"
                f"{proc.stderr.strip()[-800:]}\nCheck network access to the package index, or point "
                f"data.inputs at your own JSONL files."
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            data = zf.read(src.member)
    digest = hashlib.sha256(data).hexdigest()
    if digest != src.sha256:
        raise CorpusError(f"checksum mismatch for {src.member}: got {digest}, expected {src.sha256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_dest = dest.with_suffix(".part")
    tmp_dest.write_bytes(data)
    tmp_dest.replace(dest)
    return dest


# ---- wiki markup to prose ---------------------------------------------------------------------

_PAGE = re.compile(r"<page>.*?<title>(.*?)</title>.*?<ns>(\d+)</ns>.*?<text[^>]*>(.*?)</text>", re.S)
_PATTERNS = [
    (re.compile(r"<!--.*?-->", re.S), ""),
    (re.compile(r"<ref[^>/]*/>", re.S), ""),
    (re.compile(r"<ref[^>]*>.*?</ref>", re.S), ""),
    (re.compile(r"<(math|gallery|timeline|source|syntaxhighlight|score)[^>]*>.*?</\1>", re.S | re.I), ""),
    (re.compile(r"</?[a-zA-Z][^>]*>"), ""),
    (re.compile(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", re.I), ""),
    (re.compile(r"\[\[[^\]|]*\|([^\]]*)\]\]"), r"\1"),
    (re.compile(r"\[\[([^\]]*)\]\]"), r"\1"),
    (re.compile(r"\[https?://[^\s\]]+ ([^\]]*)\]"), r"\1"),
    (re.compile(r"\[https?://[^\]]*\]"), ""),
    (re.compile(r"'{2,}"), ""),
    (re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M), r"\1."),
    (re.compile(r"^[*#:;]+\s*", re.M), ""),
    (re.compile(r"^\s*\|.*$|^\s*!.*$", re.M), ""),
    (re.compile(r"__[A-Z]+__"), ""),
]
_SKIP_SECTIONS = re.compile(r"\n(References|External links|See also|Further reading|Notes|Bibliography)\.\n.*", re.S)


# bump when wiki_to_text changes what it writes: the cached JSONL of an older cleaner is then rebuilt
CLEANER_VERSION = "v2"  # v2: wikitext entities (&nbsp;) resolved


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove balanced {{...}} / {|...|} blocks, which regexes cannot match when nested."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def wiki_to_text(markup: str) -> str:
    text = html.unescape(markup)  # the dump's XML escaping (&lt;ref&gt;): markup becomes wikitext
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    text = _SKIP_SECTIONS.sub("", "\n" + text).strip()
    # the wikitext's own entities (&nbsp;, &ndash;) are text, not markup: resolve them once the tags are gone
    text = html.unescape(text).replace("\xa0", " ")
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def wiki_documents(dump: bytes) -> list[dict]:
    """Articles of a MediaWiki XML dump as {'id','title','text'}; redirects and non-articles skipped."""
    xml = bz2.decompress(dump).decode("utf-8")
    docs = []
    for title, ns, body in _PAGE.findall(xml):
        if ns != "0" or body.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = wiki_to_text(body)
        if text:
            docs.append({"id": f"enwiki/{html.unescape(title)}", "title": html.unescape(title), "text": text})
    return docs


def demo_corpus(name: str = "enwiki") -> Path:
    """Path of the cached JSONL of the embedded corpus `name`, building it on first use."""
    if name not in SOURCES:
        raise CorpusError(f"unknown embedded corpus {name!r}; available: {', '.join(SOURCES)}")
    src = SOURCES[name]
    root = cache_dir() / name
    jsonl = root / f"{name}-{src.sha256[:12]}-{CLEANER_VERSION}.jsonl"
    if jsonl.exists():
        return jsonl
    raw = root / Path(src.member).name
    if not raw.exists() or hashlib.sha256(raw.read_bytes()).hexdigest() != src.sha256:
        _fetch_member(src, raw)
    docs = wiki_documents(raw.read_bytes())
    tmp = jsonl.with_suffix(".part")
    with tmp.open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({**d, "source": src.origin, "license": src.license}, ensure_ascii=False) + "\n")
    tmp.replace(jsonl)  # atomic: an interrupted build never leaves a half-written cache
    return jsonl
