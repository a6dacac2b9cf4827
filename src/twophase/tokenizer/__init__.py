"""Tokenizers (from tokenizer.json or GGUF vocabulary) and sandboxed chat templates."""

from twophase.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
