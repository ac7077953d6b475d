"""Host time per stacked step of calibration's overlapped generate (issue 24, CPU): V policies
x N requests of the synthetic task on a small random model at the SmolLM2 vocabulary (49,152),
parsers shared per prefix (run_stack's default); generate_overlapped's timers per step (host_s:
accepting the tokens and building the masks; launch_s: the calls, the mask upload inside).
Run from a checkout: python bench/results/2026-12-07_session34/stack_host.py V N"""
import sys

from calibrate import stack as S, tasks
from calibrate.shared import Forest
from models import ModelConfig, random_model
from pask_jax import decode as dec
from pask_jax import policy as P
from pask_jax.grammar import GrammarCompiler
from pask_jax.testing.fixtures import smollm2

V, N = (int(x) for x in sys.argv[1:3])
tok = smollm2().tokenizer
cfg = ModelConfig(arch="llama", vocab_size=smollm2().cfg.vocab_size, hidden=64, intermediate=96,
                  n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=10000.0,
                  tie_embeddings=True)
task = tasks.SyntheticTask(tok, GrammarCompiler(tok, cfg.vocab_size), N, seed=0)
tmpl = P.all_high(cfg, sink=2, window=4)
runner = S.StackRunner(random_model(cfg, seed=0), tmpl, n_policies=V, n_requests=N,
                       capacity=256)
runner.use(S.stack([tmpl] * V))
prompts = [r.ids for _ in range(V) for r in task.requests]
for rep in range(2):   # the first compiles
  forest = Forest(task.tracker)
  trackers = [forest.row(i) for _ in range(V) for i in range(N)]
  tm = {}
  S.generate_overlapped(runner, tok, prompts, trackers=trackers,
                        sampling=dec.Sampling(max_tokens=48), timers=tm)
print({"V": V, "N": N, "rows": V * N, "steps": tm["steps"],
       **{k + "_ms_per_step": round(1e3 * tm[k] / tm["steps"], 3)
          for k in ("host_s", "launch_s", "wait_s")}})
