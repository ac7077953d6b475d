"""The grammar package's error and XGrammar's messages as one line (imported by the compiler and
the schema check, so neither imports the other for it)."""
from __future__ import annotations

import re


class GrammarError(ValueError):
  """A schema or grammar that XGrammar cannot compile."""


_CPP = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?\.(?:cc|h|cpp):\d+: (?:Check failed: .*? is false: )?")


def xgrammar_message(e: BaseException) -> str:
  """XGrammar's error as one clean line: without its C++ timestamp, file and line."""
  msg = _CPP.sub("", str(e)).strip()
  return " ".join(msg.split()) or type(e).__name__
