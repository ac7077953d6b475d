"""The benchmarks (scripts run from a checkout: ``python bench/NAME.py``); shared helpers."""
from __future__ import annotations

import json


def print_row(row: dict, out: str | None = None) -> None:
  """Print ``row`` as one JSON line, and append it to the file ``out`` if given."""
  line = json.dumps(row)
  print(line, flush=True)
  if out:
    with open(out, "a") as f:
      f.write(line + "\n")
