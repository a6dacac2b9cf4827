"""Structured outputs: a request's grammar spec (no heavy imports), compiled and matched with xgrammar
(``twophase.structured.grammar``, imported only where grammars are compiled or applied)."""

from twophase.structured.spec import STRUCTURED_KINDS, StructuredOutputSpec

__all__ = ["STRUCTURED_KINDS", "StructuredOutputSpec"]
