"""The request path's encoder: the backend's ids only where they equal transformers' ``encode``."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from runtime import tokenizing
from runtime.models import demo_model_dir
from runtime.prompts import prepare_chat, prepare_text

TEXTS = [
    "plain words",
    "  two leading spaces, one trailing ",
    "tabs\tand\nnewlines\n\n",
    "Grüße aus Köln — 東京 🚀",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "x" * 300,
    # Past LONG_TEXT_CHARS: the backend's batch call.
    ("A coding agent's system prompt, Ünïcödé — 東京 🚀\n\t<|im_start|>tool\n" * 200),
]


def _tokenizers(tiny_tokenizer):
    yield tiny_tokenizer
    demo = demo_model_dir()
    if (demo / "tokenizer.json").exists():
        yield load_tokenizer(demo)


def test_the_fast_encoder_is_chosen_and_gives_encodes_ids(tiny_tokenizer):
    for tokenizer in _tokenizers(tiny_tokenizer):
        encoder = tokenizing.encoder_for(tokenizer)
        assert encoder.__name__ == "encode_fast"
        assert tokenizing.encoder_for(tokenizer) is encoder  # decided once
        for text in TEXTS:
            for special in (False, True):
                assert encoder(text, special) == list(
                    tokenizer.encode(text, add_special_tokens=special)
                ), (text, special)


def test_chat_prompts_are_the_templates_own_tokens(tiny_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 47 + 85?"}],
        [
            {"role": "system", "content": "You are terse. Ünïcödé."},
            {"role": "user", "content": "hello\n\nthere"},
        ],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c <|im_end|> d"},
        ],
    ]
    for tokenizer in _tokenizers(tiny_tokenizer):
        for messages in conversations:
            prepared = prepare_chat(tokenizer, messages, tools=None, template_args={})
            expected = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=None
            )
            assert list(prepared.tokens) == list(expected)
        text = prepare_text(tokenizer, "Once upon a time")
        assert list(text.tokens) == list(tokenizer.encode("Once upon a time"))


class _Backend:
    def __init__(self, shift: int):
        self.shift = shift

    def encode(self, text, add_special_tokens=True):
        class _Encoding:
            ids = [ord(c) + self.shift for c in text]

        return _Encoding()


class _PythonLayer:
    """A tokenizer whose Python ``encode`` is the backend's ids shifted by ``python_shift``."""

    all_special_tokens: list[str] = []

    def __init__(self, python_shift: int):
        self._tokenizer = _Backend(0)
        self.python_shift = python_shift

    def encode(self, text, add_special_tokens=True):
        return [ord(c) + self.python_shift for c in text]


@pytest.mark.parametrize(("python_shift", "fast"), [(0, True), (1, False)])
def test_a_python_layer_that_changes_the_ids_keeps_the_slow_path(python_shift, fast):
    tokenizer = _PythonLayer(python_shift)
    encoder = tokenizing.encoder_for(tokenizer)
    assert (encoder.__name__ == "encode_fast") is fast
    assert tokenizing.encode(tokenizer, "abc") == tokenizer.encode("abc")


class _BatchingBackend(_Backend):
    """A backend with the batch call, which records the texts it is given."""

    def __init__(self):
        super().__init__(0)
        self.batched: list[int] = []

    def encode_batch_fast(self, texts, add_special_tokens=True):
        self.batched.append(len(texts[0]))
        return [self.encode(text, add_special_tokens) for text in texts]


def test_long_texts_go_through_the_backends_batch_call():
    """Its one-text call holds the GIL while Rust encodes (the event loop stalls for a
    long prompt); the batch call releases it."""
    tokenizer = _PythonLayer(0)
    tokenizer._tokenizer = backend = _BatchingBackend()
    long_text = "y" * tokenizing.LONG_TEXT_CHARS
    assert tokenizing.encoder_for(tokenizer).__name__ == "encode_fast"
    assert backend.batched  # the verdict's probes compared the batch call too
    backend.batched.clear()
    assert tokenizing.encode(tokenizer, "short") == tokenizer.encode("short")
    assert tokenizing.encode(tokenizer, long_text) == tokenizer.encode(long_text)
    assert backend.batched == [len(long_text)]


def test_no_backend_means_the_tokenizers_own_encode():
    class NoBackend:
        def encode(self, text, add_special_tokens=True):
            return [len(text), int(add_special_tokens)]

    tokenizer = NoBackend()
    assert tokenizing.encode(tokenizer, "abcd", add_special_tokens=False) == [4, 0]
    assert tokenizing.encoder_for(tokenizer).__name__ == "encode_slowly"



def test_a_system_prompt_seen_before_is_not_rendered_again(tiny_tokenizer):
    """The system prompt's tokens (where its cache segment ends) are remembered per
    tokenizer, and give the plan a fresh rendering gives."""
    system = {"role": "system", "content": "You are a careful agent. " * 40}
    first = [system, {"role": "user", "content": "list the files"}]
    later = [*first, {"role": "assistant", "content": "a.txt b.txt"},
             {"role": "tool", "content": "done"}]
    calls = []
    real = tiny_tokenizer.apply_chat_template

    def counting(messages, **kwargs):
        calls.append(messages[-1] == {"role": "user", "content": ""})
        return real(messages, **kwargs)

    tiny_tokenizer.apply_chat_template = counting
    try:
        plans = [prepare_chat(tiny_tokenizer, m, tools=None, template_args={}).plan
                 for m in (first, later, first)]
    finally:
        del tiny_tokenizer.apply_chat_template
    # The system part (the system message and an empty user turn) is rendered once.
    assert calls.count(True) == 1
    assert plans[0] == plans[2]
    assert plans[0].segment_types[0] == plans[1].segment_types[0] == "system"
    assert plans[0].segments[0] == plans[1].segments[0]
    # A different system prompt is its own.
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert prepare_chat(tiny_tokenizer, other, tools=None, template_args={}).plan != plans[0]
