"""IncrementalDetokenizer against a tiny byte-level BPE trained offline (no downloads)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from twophase.tokenizer.detokenizer import IncrementalDetokenizer

REPL = "\ufffd"
CORPUS = [
    "héllo wörld 你好 🙂 the quick brown fox jumps over the lazy dog.",
    "STOP here, stop there! Ünïcödé ñ ç 日本語 テスト 😀🙂👍 END of story.",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-char map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    return tokenizer


def byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte."""
    table = _bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in data]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    """Feed ids ``chunk`` at a time, stopping at a stop string; returns (deltas, flushed)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[i : i + chunk]))
        if detok.stop_reason is not None:
            return deltas, ""
    return deltas, detok.flush()


def test_text_deltas_equal_full_decode(tok: Tokenizer) -> None:
    prompt = tok.encode("the quick").ids
    for text in CORPUS + ["  leading spaces", "a🙂b你好c"]:
        ids = tok.encode(text).ids
        detok = IncrementalDetokenizer(tok, prompt, stop=[])
        deltas, tail = stream(detok, ids)
        assert "".join(deltas) + tail == tok.decode(ids) == text
        assert detok.text == text
        assert REPL not in "".join(deltas)


def test_split_emoji_bytes_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("hi ").ids + byte_ids(tok, "🙂".encode()) + byte_ids(tok, "你".encode()) + tok.encode("ok").ids
    detok = IncrementalDetokenizer(tok, [], stop=[])
    deltas, tail = stream(detok, ids)
    assert all(REPL not in d for d in deltas)
    assert "".join(deltas) == "hi 🙂你ok" and tail == ""


@pytest.mark.parametrize("seed", range(5))
def test_random_sequences_match_full_decode(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    vocab = tok.get_vocab_size()
    pieces: list[int] = []
    for _ in range(40):
        kind = rng.random()
        if kind < 0.3:  # a multi-byte character split into single-byte tokens
            pieces += byte_ids(tok, rng.choice("é你🙂😀日ñ").encode())
        elif kind < 0.35:  # a real invalid byte
            pieces += byte_ids(tok, bytes([rng.choice([0xFF, 0x80, 0xC3, 0xF0])]))
        else:
            pieces.append(rng.randrange(vocab))
    for skip in (True, False):
        for chunk in (1, 3):
            detok = IncrementalDetokenizer(tok, tok.encode("prompt 你").ids, stop=[], skip_special_tokens=skip)
            deltas, tail = stream(detok, pieces, chunk)
            assert "".join(deltas) + tail == tok.decode(pieces, skip_special_tokens=skip)


def test_valid_sequences_never_emit_replacement_char(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text = "".join(rng.choice(["a", " ", "é", "你", "🙂", "😀", "ñ", "日本"]) for _ in range(200))
    ids: list[int] = []
    for ch in text:  # mix merged tokens and raw byte tokens
        ids += byte_ids(tok, ch.encode()) if rng.random() < 0.5 else tok.encode(ch).ids
    detok = IncrementalDetokenizer(tok, [], stop=[])
    deltas, tail = stream(detok, ids)
    assert all(REPL not in d for d in deltas)
    assert "".join(deltas) + tail == text


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eot = tok.token_to_id("<|endoftext|>")
    ids = tok.encode("hello").ids + [eot] + tok.encode(" dog").ids
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [eot], stop=[], skip_special_tokens=skip)
        deltas, tail = stream(detok, ids)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stop_split", [2, 3])
def test_stop_string_split_across_tokens_never_leaks(tok: Tokenizer, stop_split: int) -> None:
    stop = "STOP"
    cut = [0, 2, 4] if stop_split == 2 else [0, 1, 3, 4]
    stop_ids = [tok.token_to_id(stop[a:b]) or -1 for a, b in zip(cut, cut[1:])]
    if -1 in stop_ids:
        stop_ids = byte_ids(tok, stop.encode())
    ids = tok.encode("the fox ").ids + stop_ids + tok.encode(" more text").ids
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas, tail = stream(detok, ids)
    assert detok.stop_reason == stop
    assert all("S" not in d for d in deltas)  # not even the held prefix "S"/"ST"/"STO" leaked
    assert "".join(deltas) + tail == "the fox " == detok.text


def test_stop_string_inside_one_token_and_earliest_match(tok: Tokenizer) -> None:
    ids = tok.encode("the quick brown fox jumps over").ids
    detok = IncrementalDetokenizer(tok, [], stop=["jumps", "brown"])
    deltas, _ = stream(detok, ids, chunk=len(ids))
    assert detok.stop_reason == "brown"
    assert "".join(deltas) == "the quick "


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    ids = tok.encode("the fox ").ids + byte_ids(tok, b"STOP") + tok.encode(" more").ids
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas, tail = stream(detok, ids)
    assert detok.stop_reason == "STOP"
    assert "".join(deltas) + tail == "the fox STOP" == detok.text


def test_held_stop_prefix_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("the fox ").ids + byte_ids(tok, b"STO")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) == "the fox "
    assert tail == "STO" and detok.text == "the fox STO"
    assert detok.stop_reason is None
    assert detok.flush() == ""


def test_stop_prefix_released_once_disambiguated(tok: Tokenizer) -> None:
    ids = tok.encode("the fox ").ids + byte_ids(tok, b"STOx")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert "".join(deltas) == "the fox STOx"


def test_stop_string_with_multibyte_chars(tok: Tokenizer) -> None:
    ids = tok.encode("hello ").ids + byte_ids(tok, "你好🙂".encode()) + tok.encode(" dog").ids
    detok = IncrementalDetokenizer(tok, [], stop=["好🙂"])
    deltas, _ = stream(detok, ids)
    assert detok.stop_reason == "好🙂"
    assert "".join(deltas) == "hello 你"
    assert all(REPL not in d for d in deltas)


def test_real_replacement_char_does_not_stall(tok: Tokenizer) -> None:
    ff = byte_ids(tok, b"\xff")
    detok = IncrementalDetokenizer(tok, [], stop=[])
    assert detok.add_tokens(tok.encode("ok").ids) == "ok"
    assert detok.add_tokens(ff) == ""  # could still be a split character
    assert detok.add_tokens(tok.encode("a").ids) == REPL + "a"  # later token shows it is not


def test_run_of_invalid_bytes_is_bounded(tok: Tokenizer) -> None:
    ff = byte_ids(tok, b"\xff")
    detok = IncrementalDetokenizer(tok, [], stop=[])
    deltas = [detok.add_tokens(ff) for _ in range(10)]
    assert "".join(deltas).count(REPL) >= 6  # at most a few tokens are held
    assert "".join(deltas) + detok.flush() == REPL * 10


def test_incomplete_character_at_finish_flushes_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok").ids + byte_ids(tok, "🙂".encode()[:2])
    detok = IncrementalDetokenizer(tok, [], stop=[])
    deltas, tail = stream(detok, ids)
    assert "".join(deltas) == "ok" and tail == tok.decode(ids)[2:] == REPL


def test_sentencepiece_style_leading_space_and_byte_fallback() -> None:
    """Metaspace + ByteFallback (Llama-2/Mistral style): the prompt context keeps the leading space."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"] + byte_tokens, show_progress=False)
    tokenizer.train_from_iterator(["hello world the quick brown fox"] * 10, trainer)
    prompt = tokenizer.encode("hello world").ids
    output = tokenizer.encode("the fox 🙂 你 ok").ids
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[], skip_special_tokens=False)
    deltas = [detok.add_tokens([i]) for i in output]
    assert all(REPL not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == " the fox 🙂 你 ok"  # a bare decode(output) strips the space
