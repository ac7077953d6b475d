"""Offline calibration (paper §3.4, Alg. 1) and its task oracles.

* :mod:`calibrate.bfcl` — the BFCL task: data, the C.1 split, prompts, grammars, the official AST
  checker, and :func:`calibrate.bfcl.run_cases` (generation + scoring, for calibration and eval).
* :mod:`calibrate.tasks` — the task protocol calibration runs on (:class:`calibrate.tasks.Task`)
  and its tasks: BFCL, a user's JSONL file (``pask-jax calibrate --task jsonl``), synthetic.
* :mod:`calibrate.variant` — a calibrated policy's variant at another total B, derived from the
  saved dev measurements without the model (``pask-jax policy derive``).

Submodules are imported explicitly (``from calibrate import bfcl``): they pull jax and XGrammar.
"""
