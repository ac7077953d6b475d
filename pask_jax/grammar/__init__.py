"""Constrained decoding with XGrammar: compilation, matchers, tool-call formats."""
from pask_jax.grammar.matcher import (Grammar, GrammarCompiler, GrammarError, Matcher,
                                      bitmask_words, new_bitmask)
from pask_jax.grammar.toolcall import (DEFAULT_FORMAT, DEFAULT_STYLE, FORMATS, normalize_tools,
                                       parse_calls, tool_call_grammar, tools_system_prompt)

__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "Matcher", "bitmask_words", "new_bitmask",
           "DEFAULT_FORMAT", "DEFAULT_STYLE", "FORMATS", "normalize_tools", "parse_calls",
           "tool_call_grammar", "tools_system_prompt"]
from pask_jax.grammar.fc_adapter import FCAdapter
from pask_jax.grammar.frontier import Frontier, FrontierError, StateVocab
from pask_jax.grammar.prompt_spans import char_labels, label_prompt
from pask_jax.grammar.schema_check import SchemaError
from pask_jax.grammar.schema_check import prepare as prepare_schema
from pask_jax.grammar.toolcall import call_problem, split_calls
from pask_jax.grammar.sql import SQLAdapter, schema_from_ddl, sql_grammar

__all__ += ["FCAdapter", "Frontier", "FrontierError", "StateVocab", "char_labels", "label_prompt",
            "SQLAdapter", "schema_from_ddl", "sql_grammar", "SchemaError", "prepare_schema",
            "split_calls", "call_problem"]
