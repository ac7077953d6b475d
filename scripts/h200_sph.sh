# Device (H200): the GPU Spherical KV tier kernel (issue 26 deliverable 4; bench/check_sph_gpu.py):
# correctness vs the jnp reference at the 1.5B (12q/2kv d128) and 0.5B (14q/2kv d64) shapes, then
# G2 (B=8, 32K keys): tier kernel vs reconstruct-then-attend on the same storage, and the INT4
# partition's GB/s.  No internet, no model, repository only.
#   LIMIT=560 bash scripts/h200_sph.sh
#   NO_CHECK=1 SWEEP='[{}, {"block": 64}, {"num_warps": 4}]' bash scripts/h200_sph.sh   (knob sweep)
#   FORMATS="A4/int4,A42/int4" picks the sweep's tier formats (default A4/int4,A4/bf16,A42/int4).
# Raw output under $OUT: env.txt, check.log.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; git rev-parse HEAD >> $OUT/env.txt
timeout $((limit - 20)) python3 bench/check_sph_gpu.py --iters ${ITERS:-20} ${VARIANTS:+--variants $VARIANTS} ${NO_CHECK:+--no-check} ${SWEEP:+--sweep "$SWEEP"} ${CUPTI:+--cupti} ${FORMATS:+--sweep-formats $FORMATS} > $OUT/check.log 2>&1
echo "exit $?" >> $OUT/check.log
tail -40 $OUT/check.log
