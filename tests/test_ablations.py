"""The paper's ablations (Fig. 5, §4.3, C.5) as calibration variants: the ablated policy keys
(pask_jax.tags.coarsen) for every tag id, the table an ablated policy packs, the fixed-order
ranking, the CLI's refusal, and the campaign keys.  Alg. 1 under the variants runs in
test_calibrate.py (its tiny model, task and saved stages)."""
import dataclasses
import itertools
import json
import shutil

import numpy as np
import pytest

from calibrate import alg1
from pask_jax import actions as Act
from pask_jax import policy as P
from pask_jax import tags as T

pytestmark = pytest.mark.fast_compile

# Kept fields per ablation, read from the unpacked id (independent of coarsen's packing).
KEPT = {
    "no-class": lambda f, c, r, s, n: (f, r, s, n),
    "no-role": lambda f, c, r, s, n: (f, c, r > 0, s, n),
    "no-state": lambda f, c, r, s, n: (f, c, r),
}


# ---- keys ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ablation", T.ABLATIONS)
def test_coarsen_partitions_every_tag_id_by_the_fields_the_ablation_keeps(ablation):
  ids = T.all_ids()
  keys = {i: T.coarsen(i, ablation) for i in ids}
  for i, k in keys.items():
    assert T.is_well_formed(k), (T.describe(i), k)
    assert T.coarsen(k, ablation) == k                          # a key is its own key
    assert T.unpack(k)[0] == T.unpack(i)[0]                     # the family is kept
    if T.unpack(i)[0] == T.Family.PROMPT or ablation not in KEPT:
      assert k == i
  if ablation not in KEPT:
    return
  decode = [i for i in ids if T.unpack(i)[0] != T.Family.PROMPT]
  kept = {i: KEPT[ablation](*T.unpack(i)) for i in decode}
  for i, j in itertools.combinations(decode, 2):
    assert (keys[i] == keys[j]) == (kept[i] == kept[j]), (T.describe(i), T.describe(j))
  # The merged field is really gone: fewer keys than ids in each decode family.
  for fam in (T.Family.FC, T.Family.SQL):
    mine = [i for i in decode if T.unpack(i)[0] == fam]
    assert len({keys[i] for i in mine}) < len(mine)
  # no-state keys have neither state nor next, so nothing is critical under it.
  if ablation == "no-state":
    assert not any(T.is_critical(keys[i]) for i in decode)
    assert any(T.is_critical(i) for i in decode)


def test_describe_marks_the_merged_field():
  i = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.CRITICAL)
  assert T.describe(T.coarsen(i, "no-class"), "no-class") == "fc:*/required/critical"
  assert T.describe(T.coarsen(i, "no-role"), "no-role") == "fc:schema_bearing/*/critical"
  assert T.describe(T.coarsen(i, "no-state"), "no-state") == "fc:schema_bearing/required"
  assert T.describe(T.fc(T.Cls.FREE_GENERATION), "no-role") == "fc:free_generation"
  with pytest.raises(ValueError, match="unknown ablation 'no-such'"):
    T.coarsen(i, "no-such")


def _random_entries(ablation, rng, G=3, share=0.5):
  """Random entries on a random share of the ablation's keys (no-layer: tied over groups)."""
  keys = T.ablated_keys(ablation)
  out = {}
  for k in keys:
    if rng.random() > share:
      continue
    a = [int(x) for x in rng.integers(0, 3, G)]
    f = [int(x) for x in rng.integers(0, 3, G)]
    if ablation == "no-layer":
      a, f = [a[0]] * G, [f[0]] * G
    out[k] = P.Entry(a, f, rng.random((G, 2)).tolist())
  return out


@pytest.fixture(scope="module")
def built():
  rng = np.random.default_rng(0)
  out = {}
  for ab in T.KEY_ABLATIONS + ("no-layer",):
    ent = _random_entries(ab, rng)
    out[ab] = (ent, P.build(ent, n_groups=3, ablation=ab))
  return out


@pytest.mark.parametrize("ablation", T.KEY_ABLATIONS + ("no-layer",))
def test_an_ablated_table_gives_each_id_the_entry_of_its_key(built, ablation, tmp_path):
  ent, pol = built[ablation]
  action, floor, prio = (np.asarray(x) for x in (pol.action, pol.floor, pol.prio))
  crit = np.asarray(pol.crit)
  by_key: dict[int, list[int]] = {}
  for i in T.all_ids():
    by_key.setdefault(T.coarsen(i, ablation), []).append(i)
  merged = 0
  for k, ids in by_key.items():
    merged += len(ids) > 1
    for i in ids:
      np.testing.assert_array_equal(action[i], action[ids[0]])
      np.testing.assert_array_equal(floor[i], floor[ids[0]])
      np.testing.assert_array_equal(prio[i], prio[ids[0]])
      assert crit[i] == T.is_critical(k)
    # The nearest calibrated link of the key's parent chain, else H.
    src = next((p for p in T.parents(k) if p in ent), None)
    want = [Act.H] * 3 if src is None else list(ent[src].action)
    assert action[ids[0]].tolist() == want
  assert merged > 0 or ablation == "no-layer"
  if ablation == "no-layer":
    assert (action == action[:, :1]).all() and (floor == floor[:, :1]).all()
  # The ablation is recorded and survives the save / load round trip.
  assert P.ablation_of(pol) == ablation
  P.save(pol, tmp_path / "pol")
  back = P.load(tmp_path / "pol")
  assert P.ablation_of(back) == ablation and back.record == pol.record
  for k in ("action", "floor", "crit", "prio"):
    np.testing.assert_array_equal(np.asarray(getattr(back, k)), np.asarray(getattr(pol, k)))


def test_the_unablated_table_does_not_merge_ids():
  # The same per-key entries without the ablation: ids of one no-class key differ again.
  c = [T.fc(cl, T.FCRole.REQUIRED) for cl in T.Cls]
  ent = {i: P.Entry([a] * 3, [a] * 3) for i, a in zip(c, (Act.R, Act.L, Act.H))}
  pol = P.build(ent, n_groups=3)
  assert len({int(pol.action[i, 0]) for i in c}) == 3
  assert P.ablation_of(pol) is None and "ablation" not in pol.record


def test_build_refuses_entries_the_ablation_cannot_hold():
  i = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED)
  with pytest.raises(ValueError, match="not an ablated key"):
    P.build({i: P.Entry([2] * 3, [2] * 3)}, ablation="no-class")
  with pytest.raises(ValueError, match="differs across the layer groups"):
    P.build({i: P.Entry([0, 1, 2], [0, 0, 0])}, ablation="no-layer")
  with pytest.raises(ValueError, match="unknown ablation"):
    P.build({}, ablation="no-thing")


# ---- fixed order ---------------------------------------------------------------------------------

def test_fixed_order_is_a_layer_group_round_robin_level_by_level():
  buckets = [(i, g) for i in (40, 7, 19) for g in range(3)]
  rho = alg1.fixed_order(buckets)
  path = alg1.greedy_path({b: Act.R for b in buckets}, rho)
  steps = [next(b for b in buckets if m[b] != prev[b]) for prev, m in zip(path, path[1:])]
  order = [(i, g) for i in (7, 19, 40) for g in range(3)]
  assert steps == order + order            # every R->L first, then every L->H, same order
  assert all(rho[b][0] > rho[c][1] for b in buckets for c in buckets)


# ---- no-transition: position bins in place of the parser's tags ---------------------------------

def test_position_bins_are_each_reached_by_the_share_of_every_category():
  rng = np.random.default_rng(1)
  lengths = {"simple_python": list(rng.integers(20, 90, 40)),
             "multiple": list(rng.integers(35, 140, 23))}
  edges = alg1.position_bins(lengths)
  assert len(edges) == 10 and edges[0] == 0 and all(np.diff(edges) > 0)
  widths = np.diff(edges)
  assert widths.max() - widths.min() <= 1                  # equal up to rounding
  for ns in lengths.values():
    ns = np.asarray(ns)
    assert all(np.mean(ns > e) >= 0.75 for e in edges)     # every bin reached by 75%
  # ... and the last bin starts as late as that allows (one position later is reached by less).
  assert min(np.mean(np.asarray(ns) > edges[-1] + 1) for ns in lengths.values()) < 0.75
  with pytest.raises(ValueError, match="at least 10 tokens"):
    alg1.position_bins({"simple_python": [5, 6, 30, 40]})


def test_position_ids_are_distinct_plain_tags_and_bins_cover_positions():
  ids = [T.position_id(k) for k in range(T.MAX_POSITION_BINS)]
  assert len(set(ids)) == len(ids) and all(T.is_well_formed(i) for i in ids)
  assert not any(T.is_critical(i) for i in ids)
  assert [T.describe(i, "no-transition") for i in ids[:2]] == ["pos:bin0", "pos:bin1"]
  edges = (0, 3, 7)
  assert [T.position_bin(p, edges) for p in range(10)] == [0] * 3 + [1] * 4 + [2] * 3
  with pytest.raises(ValueError):
    T.position_id(T.MAX_POSITION_BINS)


class _Inner:
  """A tracker double: tags of its own (a stop token's STOP), a parser state, forkable."""

  def __init__(self, stop=99):
    self.stop, self.terminated = stop, False

  def fill(self, bits, row):
    bits[row] = -1

  def fork(self):
    return _Inner(self.stop)

  def accept(self, token):
    if token == self.stop:
      return T.candidates(T.STOP), 3
    return T.candidates(T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.CRITICAL)), 3


def test_position_tracker_emits_bins_by_position_and_keeps_stops():
  from pask_jax.tracker import PositionTracker, with_positions
  tr = PositionTracker(_Inner(), (0, 2, 5))
  got = [tr.accept(t) for t in (1, 2, 3)]
  assert [int(t[0]) for t, _ in got] == [T.position_id(0)] * 2 + [T.position_id(1)]
  assert all(s == -1 for _, s in got) and all((t[1:] == T.PAD).all() for t, _ in got)
  twin = tr.fork()                          # the fork continues at the same position
  for t in (4, 5):
    tr.accept(t)
  assert int(tr.accept(6)[0][0]) == T.position_id(2)
  assert int(twin.accept(4)[0][0]) == T.position_id(1) and len(twin.tags) == 4
  stop, sid = tr.accept(99)
  assert stop[0] == T.STOP and sid == -1
  assert len(tr.tags) == len(tr.states) == 7
  assert with_positions([tr], None)[0] is tr and with_positions([tr], (0, 1))[0] is tr


def _no_transition_policy(bins=(0, 2, 4)):
  ent = {T.position_id(k): P.Entry([k % 3] * 3, [0] * 3) for k in range(len(bins))}
  return P.build(ent, n_groups=3, ablation="no-transition", position_bins=bins)


def test_a_no_transition_policy_records_its_bins(tmp_path):
  pol = _no_transition_policy()
  assert P.position_bins(pol) == (0, 2, 4) and P.ablation_of(pol) == "no-transition"
  P.save(pol, tmp_path / "pol")
  assert P.position_bins(P.load(tmp_path / "pol")) == (0, 2, 4)
  assert P.position_bins(P.demo()) is None
  with pytest.raises(ValueError, match="position_bins go with"):
    P.build({}, ablation="no-transition")
  with pytest.raises(ValueError, match="position_bins go with"):
    P.build({}, position_bins=(0, 3))
  with pytest.raises(ValueError, match="increasing first positions"):
    P.build({}, ablation="no-transition", position_bins=(0, 3, 3))


def test_generate_feeds_a_no_transition_policy_position_bins():
  """decode.generate wraps the trackers for a runner whose policy has position bins: the
  controller gets each token's bin and the unseen state, not the adapter's tag and state."""
  import types
  import jax.numpy as jnp
  from pask_jax import decode
  from pask_jax.tracker import Tracker

  class Stub:
    batch, capacity, cfg = 1, 64, types.SimpleNamespace(vocab_size=64)

    def __init__(self, policy):
      self.policy, self.seen = policy, []

    def begin(self, tokens, lengths, prompt_tags):
      return jnp.zeros((1, 64)), None

    def select(self, logits, bits, key, temp, top_p, how=None):
      return jnp.asarray([5])

    def advance(self, state, nxt, tag_ids, state_ids, live, bits, key, temp, top_p, how=None):
      self.seen.append((int(np.asarray(tag_ids)[0, 0]), int(np.asarray(state_ids)[0])))
      return jnp.asarray([5]), None

    def report(self, state):
      return None

  tok = types.SimpleNamespace(stop_ids=[], decode=lambda ids: "")

  class Tagged(Tracker):        # an adapter's tag and a parser state of its own
    def accept(self, token):
      return T.candidates(T.fc(T.Cls.FREE_GENERATION)), 2

  for pol, want in ((_no_transition_policy(), [T.position_id(k) for k in (0, 0, 1, 1, 2)]),
                    (P.demo(), [T.fc(T.Cls.FREE_GENERATION)] * 5)):
    r = Stub(pol)
    decode.generate(r, tok, [[1, 2]], trackers=[Tagged()],
                    sampling=decode.Sampling(max_tokens=6))
    assert [t for t, _ in r.seen] == want
    assert {s for _, s in r.seen} == ({-1} if P.position_bins(pol) else {2})


def test_the_serving_engine_refuses_a_no_transition_policy():
  from serve.engine.core import Engine
  with pytest.raises(ValueError, match="no-transition"):
    Engine(None, None, _no_transition_policy())


# ---- the CLI and the campaign --------------------------------------------------------------------

def test_calibrate_cli_refuses_an_unknown_ablation_in_one_line_before_loading(tmp_path,
                                                                              monkeypatch):
  from pask_jax import platform
  from pask_jax.cli import main
  monkeypatch.setattr(platform, "load_model_or_exit",
                      lambda *a, **k: pytest.fail("the model loaded before the check"))
  with pytest.raises(SystemExit) as e:
    main(["calibrate", "--out", str(tmp_path / "o"), "--ablation", "no-parser"])
  msg = str(e.value.code)
  assert msg.startswith("error: --ablation: unknown ablation 'no-parser'") and "\n" not in msg
  assert "no-floors" in msg and "no-layer" in msg


def test_campaign_keys_differ_between_variants(tmp_path, monkeypatch):
  from calibrate import campaign as CP

  @dataclasses.dataclass
  class Case:
    id: str
    category: str

  class Task:
    name = "enum"

    def cases(self, split, categories, seed):
      return [Case(f"{split}_{i}", "simple_python") for i in range(2)]

  monkeypatch.setenv("PASK_JAX_CACHE", str(tmp_path / "cache"))
  monkeypatch.setitem(CP.TASKS, "enum", Task)
  (tmp_path / "tiny.bin").write_bytes(b"tiny model weights")
  # One saved policy, copied: the copy whose policy.json records another ablation (arrays
  # byte-identical) keys differently, the plain copy the same (orbax writes timestamps, so two
  # saves of one policy would differ anyway).
  ent = {T.fc(T.Cls.PURE_SCAFFOLD): P.Entry([0, 1, 2], [0, 0, 0], [[1.0, 2.0]] * 3)}
  pol = P.build(ent, {"n_layers": 3, "n_kv_heads": 1, "head_dim": 8}, ablation="fixed-order",
                b_d=0.2)
  P.save(pol, tmp_path / "pol" / "fixed-order" / "B0.20")
  for name in ("no-floors", "again-fixed-order"):
    shutil.copytree(tmp_path / "pol" / "fixed-order", tmp_path / "pol" / name)
  rec = tmp_path / "pol" / "no-floors" / "B0.20" / "policy.json"
  r = json.loads(rec.read_text())
  assert r["ablation"] == "fixed-order"
  rec.write_text(json.dumps({**r, "ablation": "no-floors"}, indent=1, sort_keys=True) + "\n")
  methods = "".join(f'\n[methods.pask-{n}]\nmethod = "pask"\nbudgets = [0.20]\n'
                    f'policy = "{tmp_path}/pol/{n}/B{{budget:.2f}}"\n'
                    for n in ("no-floors", "fixed-order", "again-fixed-order"))
  plan = tmp_path / "plan.toml"
  plan.write_text(f'name = "abl"\ntask = "enum"\n[models]\ntiny = "{tmp_path}/tiny.bin"\n'
                  + methods + '\n[splits.test]\nsplit = "test"\n')
  keys = {c.method.label: c.key for c in CP.cells(CP.load_plan(str(plan), str(tmp_path / "r")),
                                                  Task())}
  assert keys["pask-no-floors"] != keys["pask-fixed-order"]
  assert keys["pask-fixed-order"] == keys["pask-again-fixed-order"]   # same policy, same key
