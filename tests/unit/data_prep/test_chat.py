"""Chat templates and loss masks: the mask is exactly the assistant turns (+ the token that closes each), exact at
turn boundaries, for our plain template and for a tokenizer's own (SmolLM2's) applied through transformers; bad
records are named by kind; the shipped tasks are seeded, distinct and exact."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from difflm.data_prep import instruction_tasks
from difflm.data_prep.chat import ChatFormat, TemplateError, TemplateSpec, resolve_template, spans, tokenizer_template
from difflm.data_prep.instructions import record_messages

# SmolLM2-135M-Instruct's chat template (its chat_template.jinja), verbatim
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|mask|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
KEYS = {"messages": "messages", "prompt": "prompt", "response": "response", "system": "system"}
TALK = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "reverse: a b c"},
    {"role": "assistant", "content": "c b a"},
    {"role": "user", "content": "add: 3 4"},
    {"role": "assistant", "content": "7"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE folder with SmolLM2's special tokens and chat template (trained in milliseconds)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["User: reverse: a b c\nAssistant: c b a", "system user assistant"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": SMOLLM2, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    m = np.concatenate([[0], mask, [0]])
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[::2], edges[1::2]))


def test_plain_template_scores_every_assistant_turn_and_its_eos_only(tokenizer_dir):
    chat = ChatFormat(TemplateSpec("plain"), str(tokenizer_dir / "tokenizer.json"), "<|endoftext|>")
    ids, mask = chat.encode(TALK)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    text = chat.tok.decode(ids, skip_special_tokens=False)
    assert text == "System: Answer briefly.\nUser: reverse: a b c\nAssistant: c b a<|endoftext|>User: add: 3 4\n" + (
        "Assistant: 7<|endoftext|>"
    )
    runs = _runs(mask)
    assert len(runs) == 2  # multi-turn: each assistant turn, nothing else
    scored = [chat.tok.decode(ids[a:b], skip_special_tokens=False) for a, b in runs]
    assert scored == [" c b a<|endoftext|>", " 7<|endoftext|>"]
    for a, b in runs:  # exact at the boundaries: the EOS closes the run, the header before it is not scored
        assert ids[b - 1] == chat.eos_id and mask[a - 1] == 0
        assert chat.tok.decode(ids[:a], skip_special_tokens=False).endswith("Assistant:")
    # the ids are the spans tokenized one by one: no token straddles a turn boundary
    assert ids == [i for text, scored in spans(TALK, chat.spec, "<|endoftext|>") for i in chat._ids(text, scored)]


def test_a_prompt_is_the_tokens_before_its_answer(tokenizer_dir):
    chat = ChatFormat(TemplateSpec("plain"), str(tokenizer_dir / "tokenizer.json"), "<|endoftext|>")
    ids, mask = chat.encode(TALK)
    prompt = chat.prompt_ids(TALK)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0
    assert sum(mask[len(prompt) :]) == len(ids) - len(prompt)  # the last answer, its EOS included
    # a special token's text inside a user's turn stays text: it never becomes the EOS (or the mask) id
    tricky = [{"role": "user", "content": "say <|endoftext|> <|mask|>"}, {"role": "assistant", "content": "no"}]
    ids, mask = chat.encode(tricky)
    assert ids.count(chat.eos_id) == 1 and chat.tok.token_to_id("<|mask|>") not in ids


def test_the_tokenizers_template_through_transformers(tokenizer_dir):
    spec = resolve_template("auto", str(tokenizer_dir))
    assert spec.name == "tokenizer" and spec.jinja == SMOLLM2 and spec.special_tokens["eos_token"] == "<|im_end|>"
    chat = ChatFormat(spec, str(tokenizer_dir / "tokenizer.json"), "<|endoftext|>")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), chat_template=SMOLLM2)
    rendered = hf.apply_chat_template(TALK, tokenize=False)
    assert "".join(text for text, _ in spans(TALK, spec, "<|endoftext|>")) == rendered
    ids, mask = chat.encode(TALK)
    assert chat.tok.decode(ids, skip_special_tokens=False) == rendered + "<|endoftext|>"  # the document's EOS
    runs = _runs(mask)
    scored = [chat.tok.decode(ids[a:b], skip_special_tokens=False) for a, b in runs]
    assert scored == ["c b a<|im_end|>", "7<|im_end|>"]  # content and the end of turn; not the newline after it
    im_end = chat.tok.token_to_id("<|im_end|>")
    assert [ids[b - 1] for _, b in runs] == [im_end, im_end] and mask[-1] == 0
    assert ids.count(im_end) == 5 and set(chat.stop_ids) == {chat.eos_id, im_end}
    prompt = chat.prompt_ids(TALK)
    assert chat.tok.decode(prompt, skip_special_tokens=False) == hf.apply_chat_template(
        TALK[:-1], tokenize=False, add_generation_prompt=True
    )
    # without a system turn the template adds its own, unscored
    ids, mask = chat.encode(TALK[1:3])
    assert "SmolLM" in chat.tok.decode(ids, skip_special_tokens=False) and len(_runs(mask)) == 1


def test_template_choice_and_errors(tmp_path, tokenizer_dir):
    (tmp_path / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    assert tokenizer_template(str(tmp_path)) == (None, {})
    assert resolve_template("auto", str(tmp_path)).name == "plain"
    assert resolve_template("plain", str(tokenizer_dir)).name == "plain"
    with pytest.raises(TemplateError, match="has no chat template.*data.chat_template=plain"):
        resolve_template("tokenizer", str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)  # how transformers 5 saves it
    assert resolve_template("tokenizer", str(tmp_path)).jinja == SMOLLM2
    chat = ChatFormat(
        TemplateSpec("tokenizer", "{{ raise_exception('no') }}"), str(tmp_path / "tokenizer.json"), "<|endoftext|>"
    )
    with pytest.raises(TemplateError, match="the chat template failed.*no"):
        chat.encode(TALK)
    reorders = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"  # prefixes do not begin the whole
    chat = ChatFormat(TemplateSpec("tokenizer", reorders), str(tmp_path / "tokenizer.json"), "<|endoftext|>")
    with pytest.raises(TemplateError, match="does not begin the whole conversation"):
        chat.encode(TALK)


@pytest.mark.parametrize(
    "record, kind",
    [
        ({"text": "hello"}, "no_conversation"),
        ({"response": "only an answer"}, "no_conversation"),
        ({"messages": "hi"}, "malformed_messages"),
        ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "y"}]}, "empty_content"),
        ({"prompt": "q", "response": 3}, "empty_content"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no_assistant_turn"),
        ({"prompt": "q"}, "no_assistant_turn"),
    ],
)
def test_bad_records_are_named_by_kind(record, kind):
    messages, got, detail = record_messages(record, KEYS)
    assert messages is None and got == kind and detail.startswith("(")


def test_good_records_become_conversations():
    messages, kind, _ = record_messages({"system": "s", "prompt": "q", "response": "a"}, KEYS)
    assert kind == "" and [m["role"] for m in messages] == ["system", "user", "assistant"]
    messages, _, _ = record_messages({"messages": TALK, "task": "x"}, KEYS)
    assert messages == TALK
    other = {**KEYS, "prompt": "instruction", "response": "output"}
    assert record_messages({"instruction": "q", "output": "a"}, other)[0][1] == {"role": "assistant", "content": "a"}


def _expected(task: str, words: list[str]) -> str:
    if task == "add":
        return str(sum(int(x) for x in words))
    return {"copy": " ".join(words), "reverse": " ".join(words[::-1]), "last": words[-1]}[task]


def test_the_shipped_tasks_are_seeded_distinct_and_exact():
    items = instruction_tasks.generate(seed=3, n=300)
    assert items == instruction_tasks.generate(seed=3, n=300) and items != instruction_tasks.generate(seed=4, n=300)
    assert len({json.dumps(i["messages"]) for i in items}) == 300
    multi = [i for i in items if len(i["messages"]) == 4]
    assert 10 <= len(multi) <= 60 and {i["task"].split("+")[0] for i in items} == set(instruction_tasks.TASKS)
    for item in items:
        prompt, answer = item["messages"][-2]["content"], item["answer"]
        task, words = prompt.split(": ", 1)
        assert answer == item["messages"][-1]["content"] == _expected(task, words.split())
    assert instruction_tasks.exact_match(" c b a ", "c b a") and not instruction_tasks.exact_match("c b", "c b a")


def test_a_single_task_source_holds_that_task_alone_and_the_config_knows_every_source():
    from difflm.config.data import INSTRUCTION_SOURCES

    assert set(INSTRUCTION_SOURCES) == set(instruction_tasks.SOURCES)
    items = instruction_tasks.generate(seed=0, n=instruction_tasks.SINGLE_TASK_ITEMS, tasks=("copy",))
    assert len(items) == instruction_tasks.SINGLE_TASK_ITEMS and {i["task"] for i in items} == {"copy", "copy+copy"}
    letters = {w for i in items for w in i["answer"].split()}
    assert letters == set(instruction_tasks.LETTERS)
