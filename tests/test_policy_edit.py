"""``pask-jax policy edit`` (:func:`pask_jax.policy.edit`): one stage of a calibrated policy made
all-high (the paper's Table 17 prefill–decode decomposition) or releasing no prompt token, the
other stage exactly as calibrated — checked through the controller on random tag streams."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax import actions as Act
from pask_jax import controller as C
from pask_jax import policy as P
from pask_jax import tags as T
from pask_jax.cli import main

SRC = os.path.join(os.path.dirname(__file__), "data", "policy15_rule2", "B0.33")
PROMPT = T.all_ids(T.Family.PROMPT)
DECODE = T.all_ids(T.Family.FC)


def _prompts(rng, b=3, n=160):
  """Random prompt-label streams (one label per token, some tokens with two), ragged lengths."""
  rows = [[[int(rng.choice(PROMPT))] + ([int(rng.choice(PROMPT))] if rng.random() < 0.1 else [])
           for _ in range(n)] for _ in range(b)]
  return jnp.asarray(T.stack_candidates([t for r in rows for t in r]).reshape(b, n, -1)), \
      jnp.asarray(rng.integers(n // 2, n + 1, size=b), jnp.int32)


def _decode(pol, rng, steps=200):
  """Alg. 2 over a random FC tag stream: the actions, int8[steps, G]."""
  ids = rng.choice(DECODE, size=steps)
  bal = C.initial_balance(pol)
  out = []
  step = jax.jit(C.control)
  for i in ids:
    a, bal = step(pol, jnp.asarray(T.candidates(int(i))), jnp.int32(-1), bal)
    out.append(np.asarray(a))
  return np.stack(out)


def _edited(tmp_path, *flags):
  out = tmp_path / "_".join(f.strip("-") for f in flags)
  assert main(["policy", "edit", SRC, "--out", str(out), *flags]) == 0
  return P.load(out)


def test_stage_decomposition_keeps_the_other_stage_as_calibrated(tmp_path, capsys):
  src = P.load(SRC)
  rng = np.random.default_rng(7)
  cands, lengths = _prompts(rng)
  plan0, _ = C.plan_prefill(src, cands, lengths)
  seed = int(rng.integers(1 << 30))
  dec0 = _decode(src, np.random.default_rng(seed))
  real = np.arange(cands.shape[1])[None, :] < np.asarray(lengths)[:, None]
  # the source releases prompt tokens and decodes below H: the edits have something to change
  assert (np.asarray(plan0)[real] == Act.R).any() and (dec0 < Act.H).any()

  pre_only = _edited(tmp_path, "--all-high", "decode")          # Table 17 "prefill-only"
  assert float(pre_only.b_d) == 1.0 and float(pre_only.pooled) == 0.0
  assert not np.asarray(pre_only.reserve).any()
  assert (_decode(pre_only, np.random.default_rng(seed)) == Act.H).all()
  np.testing.assert_array_equal(C.plan_prefill(pre_only, cands, lengths)[0], plan0)

  dec_only = _edited(tmp_path, "--all-high", "prefill")         # Table 17 "decode-only"
  assert float(dec_only.b_p) == 1.0
  plan, excess = C.plan_prefill(dec_only, cands, lengths)
  assert (np.asarray(plan)[real] == Act.H).all() and not np.asarray(excess).any()
  np.testing.assert_array_equal(_decode(dec_only, np.random.default_rng(seed)), dec0)

  keep = _edited(tmp_path, "--no-release", "prefill")
  assert float(keep.b_p) == float(src.b_p) and float(keep.b_d) == float(src.b_d)
  plan, excess = C.plan_prefill(keep, cands, lengths)
  plan = np.asarray(plan)
  assert (plan[real] >= Act.L).all()                             # nothing released
  # within B_P where the L floors fit under it: the budget is spent, not exceeded
  bits = np.asarray(jax.vmap(lambda p: C.total_cost(keep, p).sum())(jnp.asarray(plan)))
  cap = float(keep.b_p) * np.asarray(lengths) * float(keep.c_full)
  fits = ~np.asarray(excess).astype(bool)
  assert fits.any() and (bits[fits] <= cap[fits] * (1 + 1e-6)).all()
  assert (plan[real] == Act.H).any()                             # the rest went to H upgrades
  np.testing.assert_array_equal(_decode(keep, np.random.default_rng(seed)), dec0)

  # the record says what the policy now is: thresholds, and the source's variant kept aside
  assert keep.record["thresholds"]["prefill"] == [-1.0, 1.0]
  assert dec_only.record["thresholds"]["prefill"] is None
  assert pre_only.record["thresholds"]["decode"] is None
  for pol in (keep, dec_only, pre_only):
    assert "variant" not in pol.record["extra"]
    assert pol.record["extra"]["edit"]["source_variant"] == src.record["extra"].get("variant")

  said = capsys.readouterr().out
  assert "(decode all-high)" in said and "(prefill all-high)" in said
  assert {k: v for k, v in keep.record["extra"]["edit"].items() if k != "source_variant"} == \
      {"all_high": None, "no_release": "prefill", "source_name": src.record["extra"]["name"]}


def test_bad_edits_are_one_line(tmp_path):
  out = tmp_path / "x"
  for argv, msg in [([], "error: nothing to edit"),
                    (["--all-high", "prefill", "--no-release", "prefill"],
                     "error: the prefill stage cannot be both"),
                    ]:
    with pytest.raises(SystemExit) as e:
      main(["policy", "edit", SRC, "--out", str(out), *argv])
    assert str(e.value.code).startswith(msg) and "\n" not in str(e.value.code)
  assert not out.exists()
  with pytest.raises(SystemExit) as e:                           # not a policy directory
    main(["policy", "edit", str(tmp_path), "--out", str(out), "--all-high", "decode"])
  assert str(e.value.code).startswith("error: ") and "\n" not in str(e.value.code)
  assert main(["policy", "edit", SRC, "--out", str(out), "--all-high", "decode"]) == 0
  with pytest.raises(SystemExit) as e:                           # never overwrites a policy
    main(["policy", "edit", SRC, "--out", str(out), "--all-high", "prefill"])
  assert "already holds a policy" in str(e.value.code)
  with pytest.raises(ValueError, match="no_release='decode' is not an edit"):
    P.edit(P.load(SRC), no_release="decode")
  with pytest.raises(ValueError, match="needs the calibrated prompt priorities"):
    P.edit(P.all_high(), no_release="prefill")       # nothing calibrated to keep at L
  with pytest.raises(ValueError, match="all_high must be one of prefill, decode"):
    P.edit(P.load(SRC), all_high="both")


def test_an_edit_runs_at_its_source_variants_target(tmp_path):
  """A campaign cell of an edit (``budgets = [0.33]`` in the plan) runs it at its source's
  target, though its own B_D and B_P differ; an edit of a policy with no target states none."""
  from calibrate import evaluate as E
  target = P.load(SRC).record["extra"]["variant"]["target"]
  for flags in (("--all-high", "decode"), ("--all-high", "prefill"), ("--no-release", "prefill")):
    out = str(tmp_path / "_".join(f.strip("-") for f in flags))
    _edited(tmp_path, *flags)
    assert E.pick_policy(out, target) == (out, target)
    with pytest.raises(ValueError, match=f"its own target B is {target:g}"):
      E.pick_policy(out, target - 0.1)
  P.save(P.demo(b_d=0.0, b_p=0.5), tmp_path / "own")
  assert main(["policy", "edit", str(tmp_path / "own"), "--out", str(tmp_path / "e"),
               "--all-high", "decode"]) == 0
  with pytest.raises(ValueError, match="states no target B"):
    E.pick_policy(str(tmp_path / "e"), 0.33)
