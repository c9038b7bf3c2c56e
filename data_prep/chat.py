"""Chat templates for instruction data: a conversation -> token ids and the loss mask of its assistant turns.

Two templates:
- `tokenizer`: the tokenizer's own Jinja chat template (`chat_template` in tokenizer_config.json, or the
  `chat_template.jinja` beside it, as transformers saves it since v5), applied through transformers'
  `apply_chat_template`: e.g. SmolLM2's `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n...<|im_end|>\\n`.
- `plain`: ours, for tokenizers without a template (the byte-level BPE data prep trains has only EOS, mask and pad):

      System: {system}\\n            (when there is a system turn)
      User: {user}\\n
      Assistant: {assistant}<eos>
      User: ...

  Plain-text role markers rather than new special tokens: a role token would change the tokenizer (and with it the
  embedding table of the pretrained model being tuned); the markers are a few ordinary tokens. Each assistant turn
  ends with the tokenizer's EOS token, so the model learns to stop where the answer ends; no newline follows it
  (the next turn starts after the EOS, which already separates), which keeps tiny sequences short. The space after
  `Assistant:` is scored with the answer: a byte-level BPE then tokenizes the answer's first word (" d") as the same
  token as in the prompt, which copying tasks need.

The mask is exact at turn boundaries because the text is tokenized turn by turn: the conversation is cut into
spans (not scored: template text, system and user turns, each assistant turn's header; scored: the assistant's
content and the end-of-turn token that closes it) and each span is tokenized on its own, so no token straddles a
boundary. A prompt at generation time is tokenized the same way (`ChatFormat.prompt_ids`: the spans before an
assistant turn's content), so what the model sees when asked is what it was trained on. With the tokenizer's
template the spans come from rendering prefixes of the conversation (`add_generation_prompt` gives where the
assistant's content starts); a template whose prefixes are not prefixes of the whole rendering is a
`TemplateError` (the record is skipped and counted as such).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")
TEMPLATES = ("auto", "tokenizer", "plain")  # data.chat_template: auto = the tokenizer's when it has one, else plain
PLAIN_MARKERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant:"}


class TemplateError(ValueError):
    """A conversation the template cannot render into turns (the message says why): the record is skipped."""


def tokenizer_template(path: str | None) -> tuple[str | None, dict[str, str]]:
    """(the Jinja chat template, the special tokens' strings) of a local tokenizer folder, or (None, {}): read from
    tokenizer_config.json's `chat_template` or a `chat_template.jinja` file, never from a hub."""
    if not path:
        return None, {}
    folder = Path(path).expanduser()
    if not folder.is_dir():  # a bare tokenizer.json holds no template
        return None, {}
    config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").exists():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not template and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    return (template or None), special


@dataclass(frozen=True)
class TemplateSpec:
    """Which template a data folder was made with: recorded in the manifest (`instruction`), rebuilt from it."""

    name: str  # "plain" or "tokenizer"
    jinja: str | None = None  # the tokenizer's template text
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... for the Jinja template

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.jinja or self.name).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"template": self.name, "chat_template": self.jinja, "special_tokens": dict(self.special_tokens)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TemplateSpec:
        return cls(d["template"], d.get("chat_template"), dict(d.get("special_tokens") or {}))


def resolve_template(choice: str, tokenizer_path: str | None) -> TemplateSpec:
    """The template data.chat_template names: `plain`, the tokenizer's (`tokenizer`: an error when it has none),
    or `auto` (the tokenizer's when it has one)."""
    if choice == "plain":
        return TemplateSpec("plain")
    jinja, special = tokenizer_template(tokenizer_path)
    if jinja:
        return TemplateSpec("tokenizer", jinja, special)
    if choice == "tokenizer":
        raise TemplateError(
            f"data.chat_template=tokenizer: the tokenizer at {tokenizer_path or '(trained by data prep)'} has no "
            f"chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); set "
            f"data.chat_template=plain, or give tokenizer.path a folder with one"
        )
    return TemplateSpec("plain")


def spans(messages: list[dict[str, str]], spec: TemplateSpec, eos_token: str) -> list[tuple[str, bool]]:
    """The conversation as (text, scored) spans, in order; their concatenation is the rendered conversation."""
    if spec.name == "plain":
        return _plain_spans(messages, eos_token)
    return _jinja_spans(messages, spec)


def _plain_spans(messages: list[dict[str, str]], eos_token: str) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    pending = ""  # unscored text up to the next assistant content
    for m in messages:
        if m["role"] == "assistant":
            # the space before the answer is the answer's: " d" is one token of a byte-level BPE, as in the prompt
            out += [(pending + PLAIN_MARKERS["assistant"], False), (" " + m["content"] + eos_token, True)]
            pending = ""
        else:
            pending += f"{PLAIN_MARKERS[m['role']]}{m['content']}\n"
    if pending:
        out.append((pending, False))
    return out


def _render(spec: TemplateSpec, messages: list[dict[str, str]], generation: bool) -> str:
    # transformers (seconds to import) only for the tokenizer's template: the plain one needs none of it
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=spec.jinja,
            add_generation_prompt=generation,
            **spec.special_tokens,
        )
    except Exception as err:  # jinja2's errors and the template's own raise_exception(): any of them
        raise TemplateError(f"the chat template failed: {type(err).__name__}: {' '.join(str(err).split())}") from None
    return rendered[0]


def _jinja_spans(messages: list[dict[str, str]], spec: TemplateSpec) -> list[tuple[str, bool]]:
    """Spans from renderings of prefixes: assistant turn i's content starts where messages[:i] rendered with the
    generation prompt ends, and ends where messages[:i+1] ends (its trailing whitespace, e.g. the newline after
    `<|im_end|>`, not scored)."""
    full = _render(spec, messages, generation=False)
    out: list[tuple[str, bool]] = []
    at = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _prefix_end(_render(spec, messages[:i], generation=True), full, i)
        end = _prefix_end(_render(spec, messages[: i + 1], generation=False), full, i + 1)
        scored_end = start + len(full[start:end].rstrip())
        if start < at or scored_end <= start:
            raise TemplateError(f"the chat template renders assistant turn {i} as nothing: its content is dropped")
        out += [(full[at:start], False), (full[start:scored_end], True)]
        at = scored_end
    if at < len(full):
        out.append((full[at:], False))
    return [s for s in out if s[0]]


def _prefix_end(prefix: str, full: str, turns: int) -> int:
    if not full.startswith(prefix):
        raise TemplateError(
            f"the chat template renders the first {turns} turns as text that does not begin the whole conversation; "
            "turns cannot be told apart for the loss mask (use data.chat_template=plain)"
        )
    return len(prefix)


class ChatFormat:
    """A conversation -> (token ids, loss mask) with one template and tokenizer; what data prep writes and what a
    prompt at evaluation is made of (`prompt_ids`)."""

    def __init__(self, spec: TemplateSpec, tokenizer_file: str, eos_token: str, mask_token: str | None = None):
        self.spec, self.eos_token, self.mask_token = spec, eos_token, mask_token
        self.tok = Tokenizer.from_file(tokenizer_file)
        self.plain = Tokenizer.from_file(tokenizer_file)
        self.plain.encode_special_tokens = True  # a special token's text inside a user's content is plain text
        eos = self.tok.token_to_id(eos_token)
        if eos is None:
            raise TemplateError(f"the tokenizer {tokenizer_file} has no EOS token {eos_token!r}")
        self.eos_id: int = eos

    @classmethod
    def of(cls, manifest: Any) -> ChatFormat:
        """The format an instruction data folder was written with (its manifest's `instruction` record)."""
        cfg = manifest.config.get("tokenizer", {})
        return cls(
            TemplateSpec.from_dict(manifest.instruction),
            manifest.tokenizer.json_file,
            cfg.get("eos_token", "<|endoftext|>"),
            cfg.get("mask_token"),
        )

    def _ids(self, text: str, scored: bool) -> list[int]:
        if self.spec.name == "plain":  # the only special token is the EOS that closes an assistant turn
            if scored and text.endswith(self.eos_token):
                return self.plain.encode(text[: -len(self.eos_token)], add_special_tokens=False).ids + [self.eos_id]
            return self.plain.encode(text, add_special_tokens=False).ids
        return self.tok.encode(text, add_special_tokens=False).ids  # the template's own special tokens count

    def encode(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask: 1 on assistant content and the end-of-turn token closing it, else 0). A
        conversation that does not end with the EOS token gets one (not scored): one conversation, one document,
        each ending with EOS as every pretraining document does."""
        ids: list[int] = []
        mask: list[int] = []
        for text, scored in spans(messages, self.spec, self.eos_token):
            part = self._ids(text, scored)
            ids += part
            mask += [int(scored)] * len(part)
        if not ids or ids[-1] != self.eos_id:
            ids.append(self.eos_id)
            mask.append(0)
        if self.mask_token is not None and self.spec.name != "plain":
            mask_id = self.tok.token_to_id(self.mask_token)
            if mask_id is not None and mask_id in ids:  # the plain template encodes content as plain text instead
                raise TemplateError(
                    f"the text holds the mask token {self.mask_token!r}, which the clean data never may"
                )
        if not any(mask):
            raise TemplateError("the rendered conversation has no assistant token to score")
        return ids, mask

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids a model is given to answer the conversation's last assistant turn: every span before that turn's
        content (its header included), tokenized as `encode` tokenizes them."""
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        cut = spans(messages[: last + 1], self.spec, self.eos_token)
        answer = max(k for k, (_, scored) in enumerate(cut) if scored)
        return [i for text, scored in cut[:answer] for i in self._ids(text, scored)]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an answer: EOS, and the template's end-of-turn token when it is another one."""
        end = self.tok.token_to_id(self.spec.special_tokens.get("eos_token", self.eos_token))
        return tuple(sorted({self.eos_id} | ({end} if end is not None else set())))
