"""What a policy's prefill companion does to BFCL prompts, per prompt label and layer group (CPU).

The prefill plan (``controller.plan_prefill``: floors, then H/L upgrades by priority within B_P)
depends only on the prompts' labels and the policy, not on the model's activations, so it is
computed exactly on any host (the model is loaded for its tokenizer and configuration; nothing
runs through it).  For each policy: the nominal B_P over the
prompts, how many prompts their floors alone put over B_P, and per label its share of the prompt
tokens and the R/L/H fractions of each layer group.

  python bench/prefill_plans.py --model qwen2.5-coder-0.5b-instruct --split test \\
      policies/qwen2.5-coder-0.5b-instruct-bfcl-centered/B0.33 \\
      policies/qwen2.5-coder-0.5b-instruct-bfcl-centered-edits/B0.33-no-release
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from calibrate import bfcl
from models import loaders, registry
from pask_jax import controller as C
from pask_jax import policy as P
from pask_jax import tags as T


def labelled(model: str, split: str, categories) -> tuple[np.ndarray, np.ndarray, dict]:
  """(candidates int32[N, T, N_CAND] padded to a multiple of 64, lengths int32[N], identity)."""
  m = loaders.load(registry.resolve(model), dtype=jnp.bfloat16)
  cases = bfcl.load(categories, split=split)
  prompts = bfcl.prepare(cases, m.tokenizer, arch=m.cfg.arch, prompt_labels=True)
  lengths = np.array([len(p.ids) for p in prompts], np.int32)
  tn = -(-int(lengths.max()) // 64) * 64
  cands = np.full((len(prompts), tn, T.N_CAND), T.PAD, np.int32)
  for k, p in enumerate(prompts):
    cands[k, :len(p.ids)] = np.asarray(p.tags, np.int32)[:len(p.ids)]
  return cands, lengths, m.cfg


def table(pol: P.FrozenPolicy, cands: np.ndarray, lengths: np.ndarray) -> tuple[dict, list]:
  """(summary, rows): nominal B_P, prompts over B_P by floors; per first-candidate label its
  token share and [G][R, L, H] fractions."""
  plan, excess = jax.jit(C.plan_prefill)(pol, jnp.asarray(cands), jnp.asarray(lengths))
  plan, G = np.asarray(plan), pol.n_groups
  real = np.arange(cands.shape[1])[None] < lengths[:, None]
  bits = np.asarray(C.total_cost(pol, jnp.asarray(plan)))               # [N, T] bits
  summary = {"b_p_nominal": float((bits * real).sum() / (float(pol.c_full) * real.sum())),
             "b_p": float(pol.b_p), "over_by_floors": int((np.asarray(excess) > 0).sum()),
             "prompts": int(len(lengths))}
  lab = cands[:, :, 0]
  rows = []
  for l in sorted(set(lab[real].tolist()), key=lambda x: (-(lab[real] == x).sum(), x)):
    sel = real & (lab == l)
    rows.append({"label": T.describe(int(l)) if l >= 0 else "none",
                 "share": float(sel.sum() / real.sum()),
                 "rlh": [(np.bincount(plan[sel][:, g], minlength=3) / sel.sum()).tolist()
                         for g in range(G)]})
  return summary, rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("policies", nargs="+", metavar="POLICY_DIR")
  ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
  ap.add_argument("--split", default="test", choices=("cal", "dev", "test"))
  ap.add_argument("--categories", nargs="+", default=["simple_python", "multiple"])
  a = ap.parse_args(argv)
  cands, lengths, cfg = labelled(a.model, a.split, a.categories)
  print(f"{len(lengths)} prompts of {a.split} {'+'.join(a.categories)}: mean length "
        f"{lengths.mean():.1f}, longest {lengths.max()}")
  for d in a.policies:
    try:
      pol = P.load(d, cfg)
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: {e}")
    s, rows = table(pol, cands, lengths)
    print(f"== {d}: B_P {s['b_p']:.3f}, nominal over these prompts {s['b_p_nominal']:.3f}; "
          f"{s['over_by_floors']} of {s['prompts']} prompts over B_P by their floors alone")
    for r in rows:
      print(f"  {r['label']:34s} share {r['share']:.3f}  " + "  ".join(
          f"g{g} R{f[0]:.2f} L{f[1]:.2f} H{f[2]:.2f}" for g, f in enumerate(r["rlh"])))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
