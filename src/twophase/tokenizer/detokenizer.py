"""Incremental detokenizer: token ids in, safe-to-emit text deltas out, with stop strings.

Decoding uses the prefix-offset technique (vLLM): the delta of a step is
``decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])``, with the prompt's last few tokens as
the initial context so a leading space comes out right (byte-level BPE and SentencePiece alike). A delta ending
in U+FFFD is held: it is usually a multi-byte character split across tokens. It is held for at most
``MAX_HELD_TOKENS`` tokens; after that everything but its last character is released (that part is final for
UTF-8 lossy decoding), so a token that really decodes to U+FFFD never stalls the stream.

``tokenizers.decoders.DecodeStream`` is not used: it holds a trailing U+FFFD forever, has no flush, and raises
on a prefix mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 4  # a split UTF-8 character spans at most 3 pending tokens; the 4th proves a real U+FFFD
MIN_PROMPT_CONTEXT = 5  # prompt tokens used as decoding context
MAX_PROMPT_CONTEXT = 24  # grow the context up to this many tokens to avoid starting inside a character


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, honouring stop strings.

    The concatenation of all deltas and ``flush()`` equals ``backend.decode(output_ids, skip_special_tokens)``
    (cut at a stop string). For a SentencePiece (Metaspace) decoder the stream keeps the leading space of the
    first output token, as vLLM does, where a bare decode of the output alone would strip it.
    """

    def __init__(
        self,
        tokenizer_backend: "tokenizers.Tokenizer",
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._backend = tokenizer_backend
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        context = self._prompt_context(prompt_token_ids)
        self._ids: list[int] = list(context)  # decoding window: prefix ids + pending ids
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._num_delta_emitted = 0  # chars of the current delta released early (held U+FFFD run)
        self._pending = ""  # decoded text not emitted yet (a possible stop-string prefix)
        self._chunks: list[str] = []  # emitted text
        self._tail = ""  # the last (max_stop_len - 1) emitted characters
        self._stop_reason: str | None = None
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, once one did (the caller then finishes the request)."""
        return self._stop_reason

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append generated token ids; return the new text that is safe to emit now."""
        if self._done or not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_delta(force=False), final=False)

    def flush(self) -> str:
        """At finish (length, EOS, abort): return everything still held back. Later calls return ""."""
        if self._done:
            return ""
        return self._release(self._decode_delta(force=True), final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last few tokens, chosen so their text neither starts nor ends inside a character."""
        num_prompt = len(prompt_token_ids)
        for n in range(min(MIN_PROMPT_CONTEXT, num_prompt), min(MAX_PROMPT_CONTEXT, num_prompt) + 1):
            context = prompt_token_ids[num_prompt - n :]
            if REPLACEMENT_CHAR not in self._decode(context):
                return context
        context = prompt_token_ids[num_prompt - min(MIN_PROMPT_CONTEXT, num_prompt) :]
        # A context ending inside a character would glue its bytes to the output's: use none then.
        return [] if self._decode(context).endswith(REPLACEMENT_CHAR) else context

    def _decode_delta(self, force: bool) -> str:
        """Decode the pending tokens; return the part of their text that is final (all of it when forced)."""
        new_text = self._decode(self._ids)
        delta = new_text[len(self._prefix_text) :]
        if not force and delta.endswith(REPLACEMENT_CHAR):
            if len(self._ids) - self._read_offset < MAX_HELD_TOKENS:
                return ""  # probably a character split across tokens: wait for the rest
            released = delta[self._num_delta_emitted : -1]  # all but the last char is final already
            self._num_delta_emitted += len(released)
            return released
        if not force and not delta:
            return ""  # nothing new (e.g. a skipped special token): keep the window
        released = delta[self._num_delta_emitted :]
        self._advance()
        return released

    def _advance(self) -> None:
        """Make the pending tokens the new decoding prefix and drop the tokens before it."""
        prefix_ids = self._ids[self._read_offset :]
        self._ids = prefix_ids
        self._read_offset = len(prefix_ids)
        self._prefix_text = self._decode(prefix_ids)
        self._num_delta_emitted = 0

    def _release(self, new_text: str, final: bool) -> str:
        """Add decoded text; cut at a stop string; emit all but a possible stop-string prefix."""
        self._pending += new_text
        if self._stop:
            window = self._tail + self._pending
            match = _find_first_stop(window, self._stop)
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include_stop else start
                self._pending = window[len(self._tail) : max(end, len(self._tail))]
                self._stop_reason = stop
                final = True
        if final:
            self._done = True
            return self._emit(len(self._pending))
        if self._include_stop:
            return self._emit(len(self._pending))  # the stop string will be in the output anyway
        return self._emit(len(self._pending) - _held_stop_prefix_len(self._pending, self._stop))

    def _emit(self, num_chars: int) -> str:
        """Move the first ``num_chars`` of the pending text to the output and return them."""
        out, self._pending = self._pending[:num_chars], self._pending[num_chars:]
        if out:
            self._chunks.append(out)
            keep = max(self._max_stop_len - 1, 0)
            self._tail = (self._tail + out)[-keep:] if keep else ""
        return out


def _find_first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """The earliest (position, stop string) occurring in ``text``; None when none does."""
    best: tuple[int, str] | None = None
    for s in stop:
        index = text.find(s)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, s)
    return best


def _held_stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = min(len(text), max((len(s) for s in stop), default=1) - 1)
    for length in range(longest, 0, -1):
        suffix = text[-length:]
        if any(s.startswith(suffix) for s in stop):
            return length
    return 0
