import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
import pytest

from pask_jax import tags as T


def test_pack_unpack_roundtrip_every_well_formed_id():
  ids = T.all_ids()
  # FC: 3 + 3·4 + 3·4·2 + 3·4·2·2; SQL: 3 + 12 + 36 + 72; prompt: 7 labels
  assert len(T.all_ids(T.Family.FC)) == 87
  assert len(T.all_ids(T.Family.SQL)) == 123
  assert len(T.all_ids(T.Family.PROMPT)) == 7
  assert len(ids) == 217 and len(set(ids)) == 217
  for i in ids:
    assert 0 <= i < T.N_IDS
    assert T.pack(*T.unpack(i)) == i
  # the same functions work on arrays (inside jit, too)
  arr = jnp.asarray(ids, jnp.int32)
  np.testing.assert_array_equal(np.asarray(T.pack(*T.unpack(arr))), np.asarray(ids))


def test_fields_and_names():
  i = T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.CRITICAL, T.Next.NO_LOOKAHEAD)
  assert T.unpack(i) == (0, 2, 2, 2, 2)
  assert T.describe(i) == "fc:schema_bearing/required/critical/no_lookahead"
  s = T.sql(T.Cls.SCHEMA_BEARING, T.SQLRole.PREDICATE, T.SQLState.STABLE)
  assert T.describe(s) == "sql:schema_bearing/predicate/stable"
  assert T.describe(T.prompt(T.PromptLabel.ENUM_CONSTRAINT)) == "prompt:enum_constraint"
  assert T.describe(T.PAD) == "pad" and T.describe(T.STOP) == "stop"
  # distinct families never collide
  assert T.fc(T.Cls.PURE_SCAFFOLD) != T.sql(T.Cls.PURE_SCAFFOLD) != T.prompt(1)


def test_parent_chain():
  c, r, s = T.Cls.SCHEMA_BEARING, T.FCRole.OPTIONAL, T.FCState.BOUNDARY
  n = T.Next.LOOKAHEAD_CRITICAL
  assert T.parents(T.fc(c, r, s, n)) == [T.fc(c, r, s, n), T.fc(c, r, s), T.fc(c, r), T.fc(c)]
  assert T.parents(T.fc(c, r)) == [T.fc(c, r), T.fc(c)]
  assert T.parents(T.fc(c)) == [T.fc(c)]
  for i in T.all_ids():
    chain = T.parents(i)
    assert chain[0] == i and all(T.is_well_formed(p) for p in chain)
    assert len(chain) == len(set(chain))


def test_malformed_ids():
  assert not T.is_well_formed(T.PAD) and not T.is_well_formed(T.N_IDS)
  assert not T.is_well_formed(int(T.pack(0, 0)))                  # no class
  assert not T.is_well_formed(int(T.pack(0, 1, 0, 1)))            # state without role
  assert not T.is_well_formed(int(T.pack(0, 1, 1, 3)))            # FC has no third state
  assert T.is_well_formed(int(T.pack(1, 1, 1, 3)))                # SQL does
  assert not T.is_well_formed(int(T.pack(2, 1, 1)))               # prompt labels have no role
  assert not T.is_well_formed(int(T.pack(3, 1)))                  # no such family


def test_critical():
  assert T.is_critical(T.fc(T.Cls.SCHEMA_BEARING, T.FCRole.REQUIRED, T.FCState.CRITICAL))
  assert T.is_critical(T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR, T.FCState.BOUNDARY,
                            T.Next.LOOKAHEAD_CRITICAL))
  assert not T.is_critical(T.fc(T.Cls.PURE_SCAFFOLD, T.FCRole.SCAFFOLD_SEPARATOR,
                                T.FCState.BOUNDARY, T.Next.NO_LOOKAHEAD))
  assert T.is_critical(T.sql(T.Cls.SCHEMA_BEARING, T.SQLRole.RELATION, T.SQLState.CRITICAL))
  assert not T.is_critical(T.sql(T.Cls.SCHEMA_BEARING, T.SQLRole.RELATION, T.SQLState.BOUNDARY))
  assert not T.is_critical(T.prompt(T.PromptLabel.FUNCTION_NAME))


def test_candidates():
  c = T.candidates(5, 7)
  assert c.dtype == np.int32 and c.tolist() == [5, 7, -1, -1]
  assert T.candidates().tolist() == [-1] * 4
  with pytest.raises(ValueError):
    T.candidates(1, 2, 3, 4, 5)
  assert T.stack_candidates([[1], [2, 3]]).shape == (2, 4)


@pytest.mark.parametrize("L,expect", [(36, (0, 12, 24, 36)), (40, (0, 14, 27, 40)),
                                      (32, (0, 11, 22, 32)), (30, (0, 10, 20, 30)),
                                      (24, (0, 8, 16, 24)), (1, (0, 1, 1, 1))])
def test_layer_groups_paper(L, expect):
  assert T.layer_boundaries(L) == expect
  assert T.layer_boundaries(L)[1] == (L + 2) // 3 and T.layer_boundaries(L)[2] == (2 * L + 2) // 3


def test_layer_groups_any_number():
  for L in range(1, 50):
    for G in range(1, 7):
      groups = T.layer_groups(L, G)
      assert len(groups) == G and groups[0][0] == 0 and groups[-1][1] == L
      assert all(groups[i][1] == groups[i + 1][0] for i in range(G - 1))
      sizes = [hi - lo for lo, hi in groups]
      assert max(sizes) - min(sizes) <= 1       # balanced
      g = T.group_of_layer(L, G)
      assert len(g) == L and list(g) == sorted(g)
  with pytest.raises(ValueError):
    T.layer_groups(0)


def test_vocab_record_is_json():
  import json
  rec = json.loads(json.dumps(T.vocab_record()))
  assert rec["families"]["fc"]["role"]["dispatch_key"] == 4
  assert rec["families"]["sql"]["state"]["critical"] == 3
  assert rec["families"]["prompt"]["class"]["schema_description"] == 7
