# Device (H100 or H200): issue 24's serving cell -- the engine at 8K in / 256 out, c=8, PASK
# (bench B0.33 policy; the calibrated B0.33 on the real model), all-high and plain XLA in one
# process, 16 GB of KV, BF16 pages of 16, INT4 pages of 128 in the int4 format.  The Qwen 0.5B
# shape with random weights always; the real Qwen2.5-Coder-0.5B too when its GGUF is in the
# model cache (/tmp/m: uploaded as for scripts/h200_bfcl05.sh).  PROFILE=8 adds a trace of 8
# engine iterations per cell (executables per step, host gap).  Carry .whl and .tok
# (`python bench/bench_serving.py --export-tokenizer .tok`).
#   LIMIT=300 bash scripts/dev_serving05.sh
# Raw output: $OUT/serving05.tgz (results.jsonl, summary.md, the log).
. scripts/h200_env.sh || exit 1
limit=${LIMIT:-300}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s KILL $((limit - 10)) python3 bench/bench_serving.py --shape qwen2.5-0.5b \
  --tokenizer .tok --inputs 8192 --outputs 256 --concurrency 8 --methods pask full xla \
  --kv-memory 16 --page 16 --lo-format int4 --prefill-memo --time-limit $((limit - 30)) \
  ${PROFILE:+--profile $PROFILE} --out /tmp/serving05 > /tmp/serving05.log 2>&1
echo "serving rc $?"
grep -E '^\{|^#|host calls|device busy|host gap' /tmp/serving05.log | cut -c1-330
python3 - <<'PY'
import json
for line in open("/tmp/serving05/results.jsonl"):
  r = json.loads(line)
  print(r["model"], r["method"], "TPOT", round(r["tpot_ms_median"] or -1, 3), "host ms/step",
        {k: round(v, 3) for k, v in r.get("host_ms_per_step", {}).items()})
PY
cp /tmp/serving05.log /tmp/serving05/
rm -rf /tmp/serving05/trace
tar czf $OUT/serving05.tgz -C /tmp serving05
