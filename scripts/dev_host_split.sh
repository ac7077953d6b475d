# Device (H100 or H200): issue 24 -- where the engine's host time per decode step goes, function
# by function (bench/host_split.py around bench/bench_serving.py), at dev_serving05.sh's cell:
# 8K in / 256 out, c=8, PASK and plain XLA, the 0.5B shape (and the real Qwen2.5-Coder-0.5B when
# its GGUF is in /tmp/m).  Carry .whl and .tok.
#   LIMIT=240 bash scripts/dev_host_split.sh
# Raw output: $OUT/cpu.log (the host's CPU, bench/token_host.py), $OUT/host_split.log,
# $OUT/host_split.jsonl.
. scripts/h200_env.sh || exit 1
limit=${LIMIT:-240}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# The host's CPU and its Python speed, then the per-token host work alone (no device, no engine).
{ lscpu | grep -E 'Model name|^CPU\(s\)|MHz'; python3 -c "import timeit; print('python sum(range(1000)) x20000:', round(timeit.timeit('sum(range(1000))', number=20000), 3), 's')"
  timeout 120 python3 bench/token_host.py --tokenizer .tok --vocab 151936 --rows 8 --tokens 256; } > $OUT/cpu.log 2>&1
cat $OUT/cpu.log | grep -v '^WARNING'
timeout -s KILL $((limit - 10)) python3 bench/host_split.py --shape qwen2.5-0.5b \
  --tokenizer .tok --inputs 8192 --outputs 256 --concurrency 8 --methods ${METHODS:-pask xla} \
  --kv-memory 16 --page 16 --lo-format int4 --prefill-memo --time-limit $((limit - 30)) \
  --out /tmp/host_split > $OUT/host_split.log 2>&1
echo "host_split rc $?"
cp /tmp/host_split/results.jsonl $OUT/host_split.jsonl 2>/dev/null
grep -E '^\{|^#|^[A-Za-z_.]+ +[0-9]' $OUT/host_split.log | cut -c1-300 | tail -40
