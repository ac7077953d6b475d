"""Measure how a model answers a tools prompt when unconstrained (which tool-call format to use).

Prints the greedy unconstrained answer and the log-probability of the ``<tool_call>`` token at the
first answer position.  Usage: python scripts/measure_tool_format.py --model NAME --tools FILE
"""
import argparse
import json
import sys

import jax
import numpy as np


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
  ap.add_argument("--tools", default="examples/weather_tools.json")
  ap.add_argument("--prompt", default="What's the weather like in Tokyo, in fahrenheit?")
  ap.add_argument("--max-tokens", type=int, default=64)
  a = ap.parse_args(argv)
  from models import load
  from pask_jax.decode import Runner, Sampling, generate
  m = load(a.model)
  tok = m.tokenizer
  tools = json.load(open(a.tools))
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": a.prompt}], tools=tools))
  runner = Runner(m.model, batch=1, capacity=-(-(len(ids) + a.max_tokens) // 64) * 64)
  from pask_jax.decode import pad_prompts
  t, l = pad_prompts([ids], 1, runner.capacity)
  logits, _ = runner.prefill_all(runner.new_cache(), t, l)
  lp = np.asarray(jax.nn.log_softmax(logits[0]))
  tc = tok.tok.token_to_id("<tool_call>")
  top = np.argsort(-lp)[:5]
  print(f"log p(<tool_call>) at the first answer position: {lp[tc]:.2f}" if tc is not None else
        "no <tool_call> token")
  print("top-5 first tokens:", [(tok.decode([int(i)], skip_special=False), round(float(lp[i]), 2))
                                for i in top])
  r = generate(runner, tok, [ids], sampling=Sampling(max_tokens=a.max_tokens))[0]
  print(f"greedy unconstrained answer ({len(r.tokens)} tokens):\n{r.text}")


if __name__ == "__main__":
  sys.exit(main())
