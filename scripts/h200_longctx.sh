# Device (H200): the long-context frontiers of Spherical KV (issue 26 deliverable 5;
# docs/SPHERICAL_KV.md §4; calibrate/longctx.py): `pask-jax eval --task w1|w2|w3` per
# (length, workload, method, budget) cell into /tmp/lc/<task>/L<length>/<method>_B<budget>/,
# resumably: a cell with a summary.json is skipped, so the next call on a warm machine goes on
# where this one stopped (a cold machine starts over: keep what came back in lc.tgz).
#   bash scripts/h200_longctx.sh   (carry .whl; the model uploaded to /tmp/m beforehand)
#   LIMIT    seconds this call may take (default 560)
#   MODEL    default qwen2.5-coder-1.5b-instruct
#   LENGTHS  default "8192 32768" (W2/W3 use 32000 for 32768: the prompt and the answer must fit
#            the model's 32768 positions; W1's documents are 32768 tokens, the prompt 31743)
#   TASKS    default "w1 w2 w3"
#   CELLS    method:budget pairs (default below: Full KV, the full method's budget sweep, the
#            A5 gate, A1 and A2 at one point, three baselines)
#   N_W1 N_W2 N_W3  cases (W1 documents; W2 and W3 per category) — default 64 / 300 / 100
#   SLICE    cases per call-sized piece of a cell (default: the whole cell): a cell that cannot
#            finish in one call runs as --max-cases SLICE --skip-cases k slices, pooled by
#            `pask-jax merge` when all are done (a cut slice is rerun whole)
#   TAIL     W1's scored tokens (default 1024); BATCH rows per batch (default 8)
# Results come back as $OUT/lc.tgz (every cell's cases.jsonl + summary.json) and $OUT/lc.log.
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
model=${MODEL:-qwen2.5-coder-1.5b-instruct}
cells=${CELLS:-"full:1 spherical:0.6 spherical:0.45 spherical:0.35 spherical:0.25 spherical:0.15
  sphkv-gated:0.35 sphkv-gated:0.25 sphkv-rd:0.35 sphkv-angle:0.65 int4:0.35 streaming:0.35
  snapkv:0.35"}
root=/tmp/lc
mkdir -p $root
for L in ${LENGTHS:-8192 32768}; do
  for task in ${TASKS:-w1 w2 w3}; do
    len=$L
    case $task in
      w1) n=${N_W1:-64}; args="--tail ${TAIL:-1024}";;
      w2) n=${N_W2:-300}; args="--max-tokens 24"; [ $L -ge 32768 ] && len=32000;;
      w3) n=${N_W3:-100}; args="--max-tokens 256"; [ $L -ge 32768 ] && len=32000;;
    esac
    slice=${SLICE:-$n}
    for mb in $cells; do
      m=${mb%%:*}; b=${mb#*:}
      d=$root/$task/L$L/${m}_B$b
      [ -f $d/summary.json ] && continue
      parts=""
      for ((k = 0; k < n; k += slice)); do
        part=$d.s$k
        parts="$parts $part"
        [ -f $part/summary.json ] && continue
        [ $SECONDS -gt $((limit - 90)) ] && break 4
        timeout $((limit - SECONDS - 40)) python3 -m pask_jax.cli eval --model $model \
          --task $task --length $len $args --max-cases $((n - k < slice ? n - k : slice)) \
          --skip-cases $k --method $m --budget $b --batch ${BATCH:-8} --out $part \
          >> $OUT/lc.log 2>&1 || echo "cell failed or cut: $task L$L $m B$b slice $k" >> $OUT/lc.log
      done
      python3 -m pask_jax.cli merge $parts --out $d >> $OUT/lc.log 2>&1 && rm -rf $parts
    done
  done
done
grep -E "nll=|acc=|failed|error" $OUT/lc.log | tail -60
tar czf $OUT/lc.tgz -C /tmp lc
