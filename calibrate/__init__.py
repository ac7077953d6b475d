"""Offline calibration (paper §3.4, Alg. 1) and its task oracles.

* :mod:`calibrate.bfcl` — the BFCL task: data, the C.1 split, prompts, grammars, the official AST
  checker, and :func:`calibrate.bfcl.run_cases` (generation + scoring, for calibration and eval).

Submodules are imported explicitly (``from calibrate import bfcl``): they pull jax and XGrammar.
"""
