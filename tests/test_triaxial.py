"""TriAxialKV: the INT2/3/4/8 quantizers and their byte accounting, the per-tag allocation, the
runner on a tiny random model and the method end to end through the evaluator."""
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import test_eval as TE
from calibrate import evaluate as E
from calibrate import triaxial as TC
from models import Loaded, ModelConfig, random_model
from pallas_kernels import int4
from pask_jax import tags as T
from pask_jax.baselines import budget as BU
from pask_jax.baselines import quant as Q
from pask_jax.baselines import triaxial as TX
from pask_jax.decode import Runner, Sampling, generate, pad_prompts
from pask_jax.grammar import GrammarCompiler
from pask_jax.testing import TINY, load_tokenizer

pytestmark = pytest.mark.fast_compile

RNG = np.random.default_rng()   # fresh randomness each run


class Tok:
  stop_ids = [0]

  def decode(self, ids):
    return " ".join(map(str, ids))


# --- quantizers and bytes ------------------------------------------------------------------------

def test_quantizers_round_trip_within_their_bounds():
  d = int(RNG.choice([8, 64, 128]))
  x = (RNG.standard_normal((64, 2, d)) * RNG.uniform(0.01, 10)).astype(np.float32)
  err = {}
  for b in Q.WIDTHS:
    c, s = Q.quantize(jnp.asarray(x), b)
    cn, sn = Q.quantize_numpy(x, b)                     # numpy reference: the same codes
    np.testing.assert_array_equal(np.asarray(c), cn)
    np.testing.assert_array_equal(np.asarray(s), sn)
    assert int(c.min()) >= Q.CMIN[b] and int(c.max()) <= Q.CMAX[b]
    y = np.asarray(Q.dequantize(c, s, b))
    np.testing.assert_array_equal(y, np.asarray(Q.qdq(jnp.asarray(x), b)))
    sf = np.asarray(s, np.float32)[..., None]
    assert (np.abs(y - x) <= sf / 2 * (1 + 1e-6)).all(), b
    amax = np.abs(x).max(-1, keepdims=True)
    assert (np.abs(y - x) <= amax / (2 * Q.QMAX[b]) * (1 + 2e-3)).all(), b
    err[b] = float(np.linalg.norm(y - x) / np.linalg.norm(x))
  assert err[2] > err[3] > err[4] > err[8]
  assert err[2] < 0.65 and err[3] < 0.33 and err[4] < 0.15 and err[8] < 0.01
  c4, s4 = int4.quantize(jnp.asarray(x))                 # 4 bits: the cache's own INT4, exactly
  c, s = Q.quantize(jnp.asarray(x), 4)
  assert (np.asarray(c) == np.asarray(c4)).all() and (np.asarray(s) == np.asarray(s4)).all()
  assert (np.asarray(Q.qdq(jnp.asarray(x), 16)) == x).all()
  with pytest.raises(ValueError, match="bit width must be one of"):
    Q.quantize(jnp.asarray(x), 5)


def test_quantizers_round_ties_half_to_even_jitted_or_not():
  """Elements exactly on a rounding midpoint (c + OFFSET + 1/2)·s of their row's own scale, or one
  f32 ulp either side: the codes are the exactly rounded quotient, under jit and eagerly (a
  division-based quantizer stored one code off on such a tie, 2026-12-03)."""
  import jax
  for b in Q.WIDTHS:
    d = int(RNG.choice([8, 64, 128]))
    n = 256
    base = (RNG.standard_normal((n, d)) * RNG.choice([1e-3, 1.0, 300.0], (n, 1))).astype(np.float32)
    _, s = Q.quantize_numpy(base, b)
    s = s.astype(np.float32)[:, None]
    k = RNG.integers(Q.CMIN[b], Q.CMAX[b], (n, d)).astype(np.float32)   # midpoint above code k
    mid = ((k + Q.OFFSET[b] + 0.5) * s).astype(np.float32)
    nudge = RNG.choice([-1, 0, 0, 1], (n, d))
    mid = np.where(nudge > 0, np.nextafter(mid, np.float32(np.inf)),
                   np.where(nudge < 0, np.nextafter(mid, -np.float32(np.inf)), mid))
    x = np.where(RNG.random((n, d)) < 0.75, mid, base)
    top = np.abs(base).argmax(-1)                       # the row's max keeps its scale
    x[np.arange(n), top] = base[np.arange(n), top]
    cn, sn = Q.quantize_numpy(x, b)
    on_tie = (x == mid) & (nudge == 0) & (sn.astype(np.float32)[:, None] == s)
    assert on_tie.sum() > n, b                          # the case under test occurs
    tie_codes = cn[on_tie].astype(np.int64)
    assert (tie_codes % 2 == 0).all(), b                # half to even
    for f in (lambda v: Q.quantize(v, b), jax.jit(lambda v: Q.quantize(v, b))):
      c, s2 = f(jnp.asarray(x))
      np.testing.assert_array_equal(np.asarray(c), cn, err_msg=f"{b} bits")
      np.testing.assert_array_equal(np.asarray(s2), sn, err_msg=f"{b} bits")


def test_packing_round_trips_and_every_byte_is_counted():
  for b in Q.WIDTHS:
    for d in (int(RNG.integers(1, 140)), 64):
      rows = int(RNG.integers(1, 40))
      codes = RNG.integers(Q.CMIN[b], Q.CMAX[b] + 1, (rows, d)).astype(np.int8)
      p = Q.pack(jnp.asarray(codes), b)
      np.testing.assert_array_equal(np.asarray(Q.unpack(p, b, d)), codes)
      assert p.dtype == jnp.uint8 and p.shape == (rows, -(-d // Q.GROUP[b]) * Q.GROUP[b] * b // 8)
      assert p.size + 2 * rows == Q.packed_nbytes(b, d, rows) == rows * Q.row_bits(b, d) // 8
  # 64-wide rows: 2 bits four per byte, 3 bits eight in three bytes, plus the fp16 scale
  assert [Q.row_bits(b, 64) for b in (2, 3, 4, 8, 16)] == [144, 208, 272, 528, 1024]
  for d in (7, 8, 64, 65):            # INT4 is charged exactly as PASK's cost model charges L
    h, low = BU.entry_bits(d)
    assert Q.entry_bits(4, d) == low and Q.entry_bits(16, d) == h


# --- tags and allocation ----------------------------------------------------------------------

SB, PS = T.Cls.SCHEMA_BEARING, T.Cls.PURE_SCAFFOLD


def test_unseen_tags_fall_back_to_their_parent_and_candidates_take_the_widest():
  a = T.fc(SB, T.FCRole.REQUIRED, T.FCState.CRITICAL, T.Next.NO_LOOKAHEAD)
  a2 = T.fc(SB, T.FCRole.REQUIRED, T.FCState.CRITICAL, T.Next.LOOKAHEAD_CRITICAL)
  sib = T.fc(SB, T.FCRole.REQUIRED, T.FCState.BOUNDARY, T.Next.NO_LOOKAHEAD)   # never seen
  other = T.fc(PS, T.FCRole.SCAFFOLD_SEPARATOR)
  tab = TX.table({a: [2, 2, 4], a2: [4, 2, 2]}, high=8, n_groups=3)
  assert tab[a].tolist() == [2, 2, 4] and tab[a2].tolist() == [4, 2, 2]
  assert tab[sib].tolist() == [4, 2, 4]          # the widest under their parent
  assert tab[other].tolist() == [8, 8, 8]        # nothing under its parents: high
  c = np.array([[a, T.PAD, T.PAD, T.PAD], [a, a2, T.PAD, T.PAD], [a, other, T.PAD, T.PAD],
                [T.PAD] * 4, [T.STOP, T.PAD, T.PAD, T.PAD]], np.int32)
  assert TX.resolve(tab, c, 8).tolist() == [[2, 2, 4], [4, 2, 4], [8, 8, 8], [8] * 3, [8] * 3]
  assert TX.resolve(jnp.asarray(tab), jnp.asarray(c), 8).tolist() == TX.resolve(tab, c, 8).tolist()


def _synthetic(n_refs=6):
  ids = [T.fc(SB, T.FCRole.REQUIRED), T.fc(PS, T.FCRole.SCAFFOLD_SEPARATOR),
         T.prompt(T.PromptLabel.PROTECTED_CONTENT), T.prompt(T.PromptLabel.FUNCTION_NAME)]
  seqs = []
  for _ in range(n_refs):
    n = int(RNG.integers(80, 200))
    c = np.full((n, T.N_CAND), T.PAD, np.int32)
    c[:, 0] = RNG.choice(ids, n)
    multi = RNG.random(n) < 0.1
    c[multi, 1] = RNG.choice(ids, int(multi.sum()))
    seqs.append(c)
  return ids, seqs


def test_allocation_meets_the_budget_lowest_distortion_per_bit_first():
  ids, seqs = _synthetic()
  kn = TX.Knobs(prefix=int(RNG.integers(0, 8)), low=2, high=4, window=int(RNG.integers(4, 20)))
  costs = TX.group_costs(6, 2, 64)
  refs = TX.Refs.of(seqs, kn.prefix, kn.window)
  d = {}
  for i in ids:
    for g in range(3):
      d[(i, g, 4)] = float(RNG.uniform(0, 1))
      d[(i, g, 2)] = d[(i, g, 4)] + (0.0 if i == ids[2] else float(RNG.uniform(1, 100)))
  top = TX.allocate(d, refs, kn, 1.0, costs)
  assert top["demoted"] == 0 and top["predicted_B"] == top["top_B"]
  assert all(w == [4, 4, 4] for w in top["units"].values())
  assert top["avg_bits"] == pytest.approx(
      (16 * refs.n_protected + 4 * (refs.n_tokens - refs.n_protected)) / refs.n_tokens)
  target = float(RNG.uniform(top["floor_B"] + 0.01, top["top_B"] - 0.01))
  a = TX.allocate(d, refs, kn, target, costs)
  units = {int(i): w for i, w in a["units"].items()}
  tab = TX.table(units, 4, 3)
  assert a["predicted_B"] == pytest.approx(TX.predict_b(tab, refs, costs, 4)) and \
      a["predicted_B"] <= target
  # the greedy order: Δdistortion per bit saved, lowest first
  one = TX.single(refs.cands)
  n1 = {i: int(refs.weight[one == i].sum()) for i in ids}
  ratio = lambda i, g: (d[(i, g, 2)] - d[(i, g, 4)]) / (n1[i] * (costs[4, g] - costs[2, g]))
  low = [(i, g) for i in ids for g in range(3) if units[i][g] == 2]
  high = [(i, g) for i in ids for g in range(3) if units[i][g] == 4]
  assert low and high
  assert max(ratio(*u) for u in low) <= min(ratio(*u) for u in high)
  # free to demote: first (all of it, unless the target was met before its last group)
  assert any(units[ids[2]][g] == 2 for g in range(3))
  if any(units[ids[2]][g] == 4 for g in range(3)):
    assert all(i == ids[2] for i, _ in low)
  i, g = max(low, key=lambda u: ratio(*u))                   # and no demotion beyond the need
  units[i][g] = 4
  assert TX.predict_b(TX.table(units, 4, 3), refs, costs, 4) > target
  with pytest.raises(ValueError, match="cannot reach B=0.1: .* already cost B="):
    TX.allocate(d, refs, kn, 0.1, costs)


def test_distortion_grows_as_the_width_shrinks():
  L, n, n_prompt, Hq, Hkv, D = 3, 70, 50, 4, 2, 16
  q, k, v = (jnp.asarray(RNG.standard_normal((L, n, h, D)).astype(np.float32))
             for h in (Hq, Hkv, Hkv))
  unit_of = np.where(np.arange(n) % 3 == 0, 0, 1).astype(np.int32)
  unit_of[-5:] = 2                                 # unit 2 only in every query's recent tail
  d = TX.distortion(q, k, v, unit_of, n_prompt, prefix=4, window=8, widths=Q.WIDTHS, n_units=3,
                    group_of=T.group_of_layer(L, 3), n_groups=3)
  assert d.shape == (3, 4, 3)
  tot = d.sum(-1)
  for a in (0, 1):
    assert tot[a, 0] > tot[a, 1] > tot[a, 2] > tot[a, 3] > 0
  assert d[2].max() <= 1e-6 * d[:2].min()        # rounding only: no entry changed


# --- the runner ----------------------------------------------------------------------------------

LABELS = [T.prompt(T.PromptLabel.PROTECTED_CONTENT), T.prompt(T.PromptLabel.FUNCTION_NAME),
          T.prompt(T.PromptLabel.PARAMETER_KEY)]
FREE = T.fc(T.Cls.FREE_GENERATION)


def _alloc(kn, units):
  return {"knobs": kn.asdict(), "budget": 0.5, "n_groups": 3,
          "units": {str(i): w for i, w in units.items()}}


def test_runner_keeps_prefix_and_tail_bf16_and_stores_each_tag_at_its_width():
  cfg = TINY["llama"]
  m = random_model(cfg, seed=int(RNG.integers(1 << 30)))
  prompts = [list(RNG.integers(1, cfg.vocab_size, int(n))) for n in RNG.integers(40, 90, 3)]
  ptags = [np.stack([T.candidates(int(RNG.choice(LABELS))) for _ in p]) for p in prompts]
  units = {LABELS[0]: [2, 3, 8], LABELS[1]: [8, 8, 8], LABELS[2]: [3, 2, 2], FREE: [2, 8, 3]}
  kn = TX.Knobs(prefix=int(RNG.integers(1, 6)), low=2, high=8, window=int(RNG.integers(4, 11)))
  every = TX.Knobs(prefix=10 ** 6, low=2, high=8, window=kn.window)     # all BF16
  r = TX.TriaxialRunner(m, batch=4, capacity=128)
  tokens, lengths = pad_prompts(prompts, 4, 128)
  _, ref = r.configure(every, _alloc(every, units)).begin(tokens, lengths, ptags)
  _, st = r.configure(kn, _alloc(kn, units)).begin(tokens, lengths, ptags)
  tab = TX.layer_table(_alloc(kn, units), cfg.n_layers)                 # [N_IDS, L]
  width, k, k0 = np.asarray(st.width), np.asarray(st.cache.k), np.asarray(ref.cache.k)
  assert (np.asarray(ref.width)[:, :3] == 16).sum() == sum(lengths[:3]) * cfg.n_layers * 2
  for b, n in enumerate(lengths[:3]):
    t = np.arange(n)
    prot = (t < kn.prefix) | (t >= n - kn.window)
    want = np.where(prot[None], 16, tab[ptags[b][:, 0]].T)             # [L, n]
    assert (width[:, b, :, :n] == want[:, None]).all() and (width[:, b, :, n:] == 0).all()
    for w in (16,) + Q.WIDTHS:
      sel = np.swapaxes(width[:, b, :, :n], 1, 2) == w                  # [L, n, Hkv]
      got, raw = k[:, b, :n][sel], k0[:, b, :n][sel]
      if w == 16:
        np.testing.assert_array_equal(got, raw)
      else:                                   # the numpy reference quantizer's values
        c, s = Q.quantize_numpy(raw, w)
        want = (c + Q.OFFSET[w]) * s.astype(np.float32)[:, None]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  # decoding: the token leaving the tail takes its tag's width (free text -> FREE's); measured B
  # is the exact entry payload of the widths at the end of each (ragged) request
  out = generate(r, Tok(), prompts, prompt_tags=ptags, sampling=Sampling(max_tokens=16))
  costs = TX.entry_costs(cfg.head_dim)
  for o, p, pt in zip(out, prompts, ptags):
    led = o.ledger
    n = led["n_prompt"] + led["n_gen"]
    assert led["n_prompt"] == len(p) and led["n_gen"] <= len(o.tokens)
    tag = np.concatenate([pt[:, 0], np.full(led["n_gen"], FREE)])
    t = np.arange(n)
    w = np.where(((t < kn.prefix) | (t >= n - kn.window))[None], 16, tab[tag].T)
    bits = costs[w].sum() * cfg.n_kv_heads
    assert led["prefill_bits"] + led["decode_bits"] == bits
    assert led["measured_B"] == pytest.approx(bits / (n * cfg.n_layers * cfg.n_kv_heads *
                                                      costs[16]))
    assert led["avg_bits"] == pytest.approx(w.mean())
  full = generate(Runner(m, batch=4, capacity=128), Tok(), prompts,
                  sampling=Sampling(max_tokens=16))
  allbf = generate(r.configure(every, _alloc(every, units)), Tok(), prompts, prompt_tags=ptags,
                   sampling=Sampling(max_tokens=16))
  assert [o.tokens for o in allbf] == [o.tokens for o in full]
  assert all(o.ledger["measured_B"] == 1.0 for o in allbf)
  assert r.traces["step"] == 1 and r.traces["compress"] == 1          # knobs are traced


# --- through the evaluator -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
  tok = load_tokenizer(TE.DATA)
  cfg = ModelConfig(arch="qwen2", vocab_size=tok.vocab_size, hidden=32, intermediate=48,
                    n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, rope_theta=1e6,
                    tie_embeddings=True)
  m = Loaded(cfg, random_model(cfg, seed=int(RNG.integers(1 << 30))), tok)
  gc = GrammarCompiler(tok, cfg.vocab_size)
  return E.Session(m, TE.EnumTask(tok, gc), batch=4, compiler=gc)


def test_tune_freezes_the_allocation_and_eval_measures_b(session, tmp_path, monkeypatch):
  grid = {"triaxial": {"prefix": [2], "bits": [[2, 4], [2, 8]], "window": [8]}}
  target = 0.42
  res = E.tune(session, ["triaxial"], target, grid=grid, split="dev", max_cases=1,
               max_tokens=32, out=str(tmp_path), progress=False)
  kn = E.read_knobs(str(tmp_path / "knobs.json"))["triaxial"]
  alloc = kn["allocation"]
  assert kn == json.loads(json.dumps(res["knobs"]["triaxial"])) and kn["gen"] > 0
  assert alloc["split"] == "cal" and alloc["references"] == 6 and alloc["budget"] == target
  assert TX.matches(alloc, TX.Knobs.parse(kn), target) and alloc["predicted_B"] <= target
  assert len([r for r in res["log"] if r["method"] == "triaxial"]) == 2
  # on test the frozen allocation is used as it is: nothing is calibrated again
  monkeypatch.setattr(TC, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
  meta = E.run(session, E.RunConfig("triaxial", target, "test", max_tokens=32,
                                    knobs={"triaxial": kn}), str(tmp_path / "run"),
               progress=False)
  assert meta["settings"]["allocation"] == alloc
  o = meta["categories"]["overall"]
  assert o["total_B"] <= target + 0.03 and abs(o["total_B"] - alloc["predicted_B"]) <= 0.05
  rows = E.read_cases(str(tmp_path / "run"))
  assert len(rows) == 6 and all(0 < r["total_B"] < 1 for r in rows)


@pytest.mark.parametrize("knobs, msg", [
    ({"bits": [5, 4]}, "triaxial bits must be a (low, high) pair from (2, 3, 4, 8), got (5, 4)"),
    ({"bits": [4, 2]}, "need low <= high"),
    ({"bits": 4}, "triaxial bits must be a (low, high) pair, got 4"),
    ({"window": 0}, "triaxial window must be an integer >= 1"),
    ({"prefix": -1}, "triaxial prefix must be an integer >= 0"),
    ({"recent": 8}, "unknown triaxial knob(s) recent")])
def test_bad_knobs_are_one_line_errors(knobs, msg, tmp_path, monkeypatch):
  from pask_jax import cli, platform
  with pytest.raises(ValueError, match=re.escape(msg)):
    E.check_config(E.RunConfig("triaxial", 0.33, knobs={"triaxial": knobs}))
  (tmp_path / "k.json").write_text(json.dumps({"knobs": {"triaxial": knobs}}))
  monkeypatch.setattr(platform, "load_model",
                      lambda *a: pytest.fail("model loaded before the check"))
  with pytest.raises(SystemExit) as e:
    cli.main(["eval", "--method", "triaxial", "--budget", "0.33", "--knobs",
              str(tmp_path / "k.json"), "--out", str(tmp_path)])
  assert msg in str(e.value.code) and "\n" not in str(e.value.code)
