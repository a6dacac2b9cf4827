"""Tokenizer: GGUF-built vocabularies match transformers, chat templates render like HF and stay sandboxed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import write_tiny_gguf, write_tiny_llama
from twophase.loader import open_model_source
from twophase.sampling_params import InvalidRequestError
from twophase.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world", " leading space", "trailing  ", "a  b   c\n\n\nd\t\te", "12345 + 67.89 = 1e10, 2024-01-01",
    " 1 22 333", "naïve café — 日本語のテキスト, Ελληνικά, русский", "emoji 😀👍🏽 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n", "<|im_start|>user\nhi<|im_end|>\n", "don't I'll we're",
    "", "   ", "\n", "<|endoftext|>x<repo_name>", "<|im_start|", "ℌ𝔢𝔩𝔩𝔬 ﬁ",
]
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tok") / "hf")


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: Path) -> Tokenizer:
    return load_tokenizer(open_model_source(tiny_dir))


@pytest.fixture(scope="module")
def smol(default_model: Path) -> tuple[Tokenizer, object]:
    path = default_model
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return load_tokenizer(open_model_source(path)), reference


def test_smollm2_ids_match_transformers(smol: tuple[Tokenizer, object]) -> None:
    tok, ref = smol
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def test_smollm2_special_tokens(smol: tuple[Tokenizer, object]) -> None:
    tok, ref = smol
    assert tok.vocab_size == 49152 == len(ref)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"
    assert tok.encode("Hi") == [tok.token_to_id("Hi")]  # add_bos_token is false in this GGUF
    assert tok.has_chat_template and tok.backend is not None


def test_smollm2_chat_template_matches_transformers(smol: tuple[Tokenizer, object]) -> None:
    tok, ref = smol
    for messages in (CHAT, [{"role": "system", "content": "Be brief."}, *CHAT]):
        for generation_prompt in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert tok.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected


def test_tiny_hf_round_trip(tiny_tok: Tokenizer) -> None:
    assert tiny_tok.vocab_size == 400 and tiny_tok.eos_token_ids == (2,) and tiny_tok.bos_token_id == 1
    for text in TEXTS:
        assert tiny_tok.decode(tiny_tok.encode(text), skip_special_tokens=False) == text
    assert tiny_tok.encode("<|im_end|>") == [2]


def test_tiny_gguf_tokenizer_matches_hf(tiny_dir: Path, tiny_tok: Tokenizer) -> None:
    gguf_tok = load_tokenizer(open_model_source(write_tiny_gguf(tiny_dir, tiny_dir.parent / "t.gguf")))
    for text in TEXTS:
        assert gguf_tok.encode(text) == tiny_tok.encode(text), text
    assert gguf_tok.apply_chat_template(CHAT) == tiny_tok.apply_chat_template(CHAT)
    assert gguf_tok.eos_token_ids == tiny_tok.eos_token_ids


def test_tiny_chat_template_matches_transformers(tiny_dir: Path, tiny_tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert tiny_tok.apply_chat_template(CHAT) == ref.apply_chat_template(CHAT, tokenize=False,
                                                                         add_generation_prompt=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tiny_tok.apply_chat_template(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{% for m in messages %}{{ m.__init__.__globals__ }}{% endfor %}",
    "{{ messages.append(1) }}",
])
def test_sandbox_refuses_escapes(tiny_tok: Tokenizer, template: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny_tok.apply_chat_template(CHAT, chat_template=template)
    assert info.value.param == "chat_template"


def test_template_errors(tiny_tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny_tok.apply_chat_template(CHAT, chat_template="{% for m in messages %}")
    assert info.value.param == "chat_template"
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        tiny_tok.apply_chat_template(CHAT, chat_template="{{ raise_exception('roles must alternate') }}")
    assert info.value.param == "messages"
    assert tiny_tok.apply_chat_template(CHAT, chat_template="{{ strftime_now('%Y') | length }}") == "4"


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ("hello", "messages"),
    (["hello"], "messages[0]"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]"),
])
def test_bad_messages_refused(tiny_tok: Tokenizer, messages: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny_tok.apply_chat_template(messages)  # type: ignore[arg-type]
    assert info.value.param == param


def test_no_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(load_tokenizer(open_model_source(tiny_dir)).backend, eos_token="<|im_end|>")
    assert not tok.has_chat_template and tok.eos_token_ids == (2,)
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(CHAT)
    assert info.value.param == "chat_template"


def test_add_bos(tiny_dir: Path) -> None:
    base = load_tokenizer(open_model_source(tiny_dir)).backend
    tok = Tokenizer(base, bos_token="<|im_start|>", add_bos=True)
    assert tok.encode("hello")[0] == 1 and tok.encode("hello", add_special_tokens=False)[0] != 1
