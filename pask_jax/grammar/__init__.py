"""Constrained decoding with XGrammar: compilation, matchers, tool-call formats."""
from pask_jax.grammar.matcher import (Grammar, GrammarCompiler, GrammarError, Matcher,
                                      bitmask_words, new_bitmask)
from pask_jax.grammar.toolcall import (DEFAULT_FORMAT, DEFAULT_STYLE, FORMATS, normalize_tools, parse_calls,
                                       tool_call_grammar, tools_system_prompt)

__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "Matcher", "bitmask_words", "new_bitmask",
           "DEFAULT_FORMAT", "DEFAULT_STYLE", "FORMATS", "normalize_tools", "parse_calls", "tool_call_grammar",
           "tools_system_prompt"]
