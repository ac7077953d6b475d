# Device (H100 or H200): issue 24, where the 0.5B step's launch goes and what removes it.
# The 0.5B shape, B=8, 8K, mix .20/.65/.15 and all-BF16 in each process (bench_pask_step.py):
#   new     today's tree: Alg. 2's loops unrolled (no `while` thunk), Mosaic GPU INT4 pages of 128
#           (XLA's thunk sequence dumped: which thunks run outside the CUDA graphs), profiled
#           (host-side driver calls per step)
#   triton  the same tree, INT4 pool in the bytes format read by the Triton kernel: on jax 0.10.2's
#           deviceless compile the whole step is one command buffer
#   old     Alg. 2's loops rolled (OLD=file with the previous pask_jax/controller.py), Mosaic GPU
#   LIMIT=560 OLD=old_controller.py.txt bash scripts/dev_launch24.sh
# Raw output: $OUT/launch24.tgz.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-560}
d=/tmp/launch24 && rm -rf $d && mkdir -p $d
. scripts/device_env.sh $d
left() { echo $((limit - SECONDS - 10)); }
step() {  # tag, args...
  local tag=$1 t; shift; t=$(left)
  [ $t -gt 40 ] || { echo "no time for $tag"; return; }
  timeout -s KILL $(( t < 130 ? t : 130 )) python3 bench/bench_pask_step.py --shape qwen2.5-0.5b \
    --batch 8 --context 8192 --layouts unrolled --no-full --steps 8 --mixes 0.2,0.65,0.15 \
    --json $d/$tag.jsonl "$@" > $d/$tag.log 2>&1
  echo "$tag rc $?"; grep -E "mix \(|all|Error|host calls|host gap|busy" $d/$tag.log | cut -c1-400
}
XLA_FLAGS="--xla_dump_to=$d/dump --xla_dump_hlo_module_re=decode" step new --lo-page 128 \
  --lo-format int4 --profile $d/prof_new
step triton --lo-format bytes
if [ -n "$OLD" ]; then
  cp pask_jax/controller.py /tmp/ctl_new.py && cp "$OLD" pask_jax/controller.py
  step old --lo-page 128 --lo-format int4
  cp /tmp/ctl_new.py pask_jax/controller.py
fi
mkdir -p $d/thunks && cp $d/dump/*thunk_sequence* $d/thunks/ 2>/dev/null; rm -rf $d/dump
for f in $d/thunks/*after_thunk_passes.txt; do echo "$f"; grep -E "^[0-9]{3}: " "$f" | awk '{print $2}' | sort | uniq -c; done
rm -rf $d/prof_new
tar czf $OUT/launch24.tgz -C /tmp launch24
