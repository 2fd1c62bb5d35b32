"""Tokenizer: digit pre-tokenization, chat templates, incremental detokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.model.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def smol(default_model: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model)


@pytest.fixture(scope="module")
def hf_smol(default_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.mark.parametrize(
    "text", ["2024", "In 1969, 600000000 people watched.", "π≈3.14159", "x=12+345", "v2.0a99"]
)
def test_every_digit_is_its_own_token(smol, text):
    ids = smol.encode(text)
    assert smol.decode(ids) == text
    digit_pieces = [
        smol.decode([i]) for i in ids if any(c in "0123456789" for c in smol.decode([i]))
    ]
    assert digit_pieces == [c for c in text if c in "0123456789"]


def test_tokenize_matches_the_converted_tokenizer_json_in_transformers(smol, hf_smol):
    text = "Hello, world! 2024 was a year. Ünïcödé 你好 🎉 <|im_start|>user"
    assert smol.encode(text) == hf_smol(text, add_special_tokens=False)["input_ids"]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with  two spaces\nand a newline."},
    ],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_exactly_like_transformers(
    smol, hf_smol, messages, generation_prompt
):
    ours = smol.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    theirs = hf_smol.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert ours == theirs


# A template with whitespace control, loops, filters and raise_exception, as Qwen-style
# templates use: rendered identically to transformers in our sandbox.
TRICKY_TEMPLATE = """{%- for m in messages %}
    {%- if m['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + m['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}
    {%- if loop.last and m.extra is defined %}{{ m.extra | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""


def test_sandboxed_template_matches_transformers_and_raises_cleanly(tmp_path, default_model):
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((default_model / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TRICKY_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "  S  "}, {"role": "user", "content": "Q\n"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(InvalidRequestError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_cannot_reach_python_internals(smol):
    from engine.model.tokenizer import render_chat_template

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequestError):
        render_chat_template(evil, [], add_generation_prompt=False)


MIXED = st.lists(
    st.one_of(
        st.sampled_from(list("abcxyz ,.!?\n\t") + list("éüñß") + ["the ", " and"]),
        st.sampled_from(list("你好世界中文字节漢語")),
        st.sampled_from(["🎉", "👍🏽", "🚀", "😀", "👨‍👩‍👧", "🇫🇷"]),
        # SmolLM2's vocabulary lacks some control bytes and the UTF-8 lead bytes F1-F7
        # (code points past U+3FFFF), so the text it can represent excludes those.
        st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs", "Co", "Cn", "Cc")),
    ),
    max_size=40,
).map("".join)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=MIXED)
def test_incremental_detokenizer_never_splits_a_character(smol, text):
    if REPLACEMENT_CHAR in text:
        return
    ids = smol.encode(text)
    detok = IncrementalDetokenizer(smol)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == smol.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_detokenizer_releases_a_multibyte_character_only_when_complete(smol):
    ids = smol.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits this emoji over several tokens
    detok = IncrementalDetokenizer(smol)
    pieces = [detok.add(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🎉"
