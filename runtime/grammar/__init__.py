"""Structured outputs and enforced tool choice: constraints as grammars, masks per row.

Three modules, one per side of the engine boundary:

* ``compiler`` (request side, a trio worker thread, tokenizer-only):
  ``compile_constraint`` -> a picklable ``ConstraintSpec`` or ``None``;
  ``ClientError`` (400) naming what cannot be enforced.
* ``matcher`` (engine side, no MLX): ``grammar_tokenizer``, ``RowMatcher``
  (one per sequence), ``fill_bitmasks`` (all rows of a step in one call).
* ``backend`` (engine side, MLX): ``GrammarBackend``, the batch sampler's
  ``ConstraintBackend``, and ``constraint_processor`` for the serial path.

This package re-exports what callers use; it receives and emits nothing itself.
"""

from runtime.grammar.compiler import JSON_TOOL_PARSERS, ConstraintSpec, compile_constraint
from runtime.grammar.matcher import GrammarTokenizer, RowMatcher, fill_bitmasks, grammar_tokenizer

__all__ = [
    "JSON_TOOL_PARSERS",
    "ConstraintSpec",
    "GrammarTokenizer",
    "RowMatcher",
    "compile_constraint",
    "fill_bitmasks",
    "grammar_tokenizer",
]
