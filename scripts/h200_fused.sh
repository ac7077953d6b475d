# Device (H200): the fused Mosaic GPU kernel for the whole mixed cache (int4_kernel="fused",
# pallas_kernels/gpu/mgpu_mixed.py; issue 22), its first GPU run.
#   LIMIT=560 bash scripts/h200_fused.sh          (no wheels or model needed)
# 1. correctness on the GPU (bench/check_fused.py): the kernel's partials against its jnp
#    reference, decode_attention(int4_kernel="fused") against the float32 reference at the 4B and
#    0.5B shapes (poisoned synth cases, a traced layer, the bench's size per knob variant), rel
#    errors printed; a failure there does not stop step 2.
# 2. CUPTI kernel times (bench/bench_kernels.py), pages of 128 in both pools, 4B-like and 0.5B at
#    B=8 32K: (a) all-BF16 (Triton), (b) the B~0.33 mix with the int4 pool through today's path
#    (Mosaic INT4 + Triton) and fused, the INT4-only and BF16-only partitions, fused knob variants.
# Raw output under $OUT: env.txt, check.log, check.json, kern/, kern.log.
. scripts/h200_env.sh 2>/dev/null || export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fused_out}
mkdir -p $OUT
limit=${LIMIT:-560}
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt; git rev-parse HEAD >> $OUT/env.txt
python3 -c "import jax; print('jax', jax.__version__)" >> $OUT/env.txt 2>&1
cat $OUT/env.txt
# fused knob variants, each on every row (5 x 6 rows): defaults (tile_hi 64, 2 + 2 stages, splits
# by plan()), whole-page BF16 tiles, deeper INT4 pipeline, other split shares.
VARIANTS='[{}, {"tile_hi": 128}, {"stages_lo": 3}, {"splits_lo": 4, "splits_hi": 4}, {"splits_lo": 10, "splits_hi": 6}]'
timeout 170 python3 bench/check_fused.py --json $OUT/check.json \
  --variants '[{}, {"tile_hi": 128}, {"stages_lo": 3, "stages_hi": 3}, {"auto_barriers": true}]' \
  > $OUT/check.log 2>&1
echo "check_fused rc=$? (0: every check passed)"
grep '^{' $OUT/check.log | cut -c1-260
tail -1 $OUT/check.log
left=$((limit - SECONDS - 15))
[ $left -gt 60 ] || exit 0
timeout $left python3 bench/bench_kernels.py --out $OUT/kern --lo-page 128 --hi-page 128 \
  --lo-formats int4 --int4-kernels mosaic,fused --fused-variants "$VARIANTS" --shapes 0,3 \
  --no-gqa --cupti > $OUT/kern.log 2>&1
echo "bench_kernels rc=$?"
grep -E "^FAILED|^CUPTI" $OUT/kern.log | cut -c1-300
sed -n '/^copy /,$p' $OUT/kern.log
python3 - "$OUT/kern/kernels.json" <<'EOF' 2>/dev/null
# Per variant: the call's kernels under CUPTI (device µs) and the x all-BF16 ratio per shape.
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
a = {r["shape"]: r.get("kernels_us") for r in rows if r["variant"] == "pask a_bf16"
     and "fused" not in r["knobs"]}
for r in rows:
  k = r.get("kernels_us")
  ratio = f"{k / a[r['shape']]:.3f}x(a)" if k and a.get(r["shape"]) else ""
  print(f"{r['shape']:16s} {r['variant']:18s} kernels {k or float('nan'):8.1f} us {ratio:>10s} "
        f"err {r['err'] or 0:.1e} {r['knobs']}")
  for name, t in r.get("kernels", []):
    print(f"{'':20s}{t:8.2f} us  {name}")
EOF
