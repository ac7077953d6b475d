# Device (H100 or H200): issue 24, what the 0.5B step's launch is made of, second pass.  The 0.5B
# shape, B=8, 8K, mix .20/.65/.15 and all-BF16 in each process (bench_pask_step.py), INT4 pages
# of 128 in the int4 format:
#   base      today's tree (Alg. 2 as per-group selects: 4 controller kernels instead of ~49)
#   vlog      base, with XLA's command-buffer update log (how many graph nodes are re-parameterized
#             per step: "Updated N commands ... (skipped M ...)")
#   skiptemp  --xla_gpu_command_buffer_update_mode=SKIP_TEMP (temp buffers at fixed addresses)
#   skipprof  --xla_gpu_command_buffer_update_mode=SKIP_PROFILED (also stable params/outputs)
#   color     --xla_gpu_temp_buffer_use_separate_color=true
#   old       with OLD=dir: controller.py and cache.py of an earlier tree (then base2: base again)
#   LIMIT=300 bash scripts/dev_launch24b.sh
# Raw output: $OUT/launch24b.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-300}
d=/tmp/launch24b && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 30 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < 80 ? t : 80 )) python3 bench/bench_pask_step.py --shape qwen2.5-0.5b \
    --batch 8 --context 8192 --layouts unrolled --no-full --steps ${STEPS:-8} \
    --mixes 0.2,0.65,0.15 --lo-page 128 --lo-format int4 --json $d/$tag.jsonl "$@" \
    > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|all|Error|error|host calls" $d/$tag.log | cut -c1-300
}
step base
if [ -n "$OLD" ]; then  # OLD=dir holding controller.py and cache.py of an earlier tree
  cp pask_jax/controller.py /tmp/ctl_new.py && cp pask_jax/cache.py /tmp/cache_new.py
  cp "$OLD/controller.py" pask_jax/controller.py && cp "$OLD/cache.py" pask_jax/cache.py
  step old
  cp /tmp/ctl_new.py pask_jax/controller.py && cp /tmp/cache_new.py pask_jax/cache.py
  step base2
fi
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_executor=1,command_buffer_thunk=1 STEPS=4 step vlog
grep -c "Updated" $d/vlog.log; grep -m 6 -E "Updated|skipped" $d/vlog.log | cut -c1-300
XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP step skiptemp
XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_PROFILED step skipprof
XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true step color
tar czf $OUT/launch24b.tgz -C /tmp launch24b
