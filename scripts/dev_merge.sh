# Device (H200 or H100): the one-launch Pallas merge (decode_attention_gpu merge="kernel",
# pallas_kernels/gpu/merge.py) against XLA's merge over the partial sets (the default), issue 22's
# glue, in two calls on a warm machine:
#   PART=kern LIMIT=420 bash scripts/dev_merge.sh   per decode call with CUPTI per kernel at the
#       0.5B shape (where the glue was 36 % of the call on the H100) and the 4B-like shape,
#       all-BF16 and the B≈0.33 mix, each merge;
#   PART=step LIMIT=560 bash scripts/dev_merge.sh   the whole step at the 0.5B shape (B=8, 8K)
#       and the Qwen3-4B shape (B=8, 32K), each with its all-BF16 baseline in the same process.
# No wheels or model needed.  Raw output: $OUT/merge_$PART.tgz (env.txt, kern_*/ + logs,
# step_*.jsonl/log); the summary lines in the call's output.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-420}
part=${PART:-kern}
d=/tmp/merge_$part && rm -rf $d && mkdir -p $d
nvidia-smi --query-gpu=name,driver_version --format=csv > $d/env.txt
git rev-parse HEAD >> $d/env.txt 2>/dev/null; git status --short >> $d/env.txt 2>/dev/null
left() { echo $((limit - SECONDS - 20)); }
if [ "$part" = kern ]; then
  for shape in 3 0; do
    for merge in sets kernel; do
      t=$(left); [ $t -gt 40 ] || { echo "no time for kernels shape $shape $merge"; break 2; }
      tag=$([ $shape = 3 ] && echo 05 || echo 4b)_$merge
      timeout -k 5 -s KILL $(( t < 95 ? t : 95 )) python3 bench/bench_kernels.py --out $d/kern_$tag \
        --lo-page 128 --lo-formats int4 --int4-kernels mosaic --shapes $shape --no-gqa --cupti \
        --knobs "{\"merge\": \"$merge\"}" > $d/kern_$tag.log 2>&1
      echo "kern $tag rc $?"; grep -E "^\{" $d/kern_$tag.log | cut -c1-260
    done
  done
else
  for merge in sets kernel; do
    t=$(left); [ $t -gt 60 ] || { echo "no time for the 0.5B step ($merge)"; break; }
    timeout -s KILL $(( t < 100 ? t : 100 )) python3 bench/bench_pask_step.py --shape qwen2.5-0.5b \
      --batch 8 --context 8192 --mixes 0.2,0.65,0.15 --layouts unrolled --no-full --lo-page 128 \
      --lo-format int4 --kernel-knobs "{\"merge\": \"$merge\"}" --json $d/step_05_$merge.jsonl \
      > $d/step_05_$merge.log 2>&1
    echo "step 0.5B $merge rc $?"; tail -4 $d/step_05_$merge.log
  done
  for merge in kernel sets; do
    t=$(left); [ $t -gt 60 ] || { echo "no time for the 4B step ($merge)"; break; }
    timeout -s KILL $(( t < 160 ? t : 160 )) python3 bench/bench_pask_step.py --shape qwen3-4b \
      --batch 8 --context 32768 --mixes 0.2,0.65,0.15 0.5,0.4,0.1 --layouts unrolled --no-full \
      --lo-page 128 --lo-format int4 --kernel-knobs "{\"merge\": \"$merge\"}" \
      --json $d/step_4b_$merge.jsonl > $d/step_4b_$merge.log 2>&1
    echo "step 4B $merge rc $?"; tail -4 $d/step_4b_$merge.log
  done
fi
tar czf $OUT/merge_$part.tgz -C /tmp merge_$part
