# Device (H200): calibrate the paper's ablations (Fig. 5; `pask-jax calibrate --ablation`) of
# Qwen2.5-Coder-1.5B with the flags of scripts/h200_campaign15.sh (every calibration and
# development case, W 16, total-B target 0.20), one variant after another into /tmp/abl15/<v>.
# Resumable across 10-minute calls on a warm machine: a variant whose calibration.json exists is
# done and skipped, an interrupted one resumes from its saved stages (work/); call it again until
# it prints "ablations: all calibrated".
#   bash scripts/h200_ablations15.sh    (carry .whl; the model uploaded to /tmp/m beforehand)
#   LIMIT     seconds this call may take (default 560)
#   VARIANTS  which, in order (default: fixed-order no-floors no-layer no-state no-class no-role)
#   MAX_CASES cases per category for calibration and development (default: every case, as the
#             committed full-method policy; a smaller value is a different calibration split)
# Stages a variant does not change are not keyed by its ablation and are copied in before it
# starts (cp -n): the reference from any variant (or from /tmp/cal15c, the full method's
# calibration of h200_campaign15.sh, when a warm machine still has it); Runtime-V of fixed-order
# from /tmp/cal15c; Runtime-D of no-floors and no-layer from no-floors or /tmp/cal15c.
# Each finished variant comes back as $OUT/abl15_<v>.tgz (abl15/<v>/policy + calibration.json);
# unpack them into policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations/ (see
# examples/campaign_15b_ablations.toml), e.g.
#   for f in abl15_*.tgz; do tar xzf $f -C /tmp; done
#   for v in /tmp/abl15/*/; do n=$(basename $v); d=policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations/$n
#     mkdir -p $d && cp -r $v/policy/. $d/ && cp $v/calibration.json $d/; done
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
root=/tmp/abl15
full=/tmp/cal15c/work
mkdir -p $root
share() {   # share VARIANT STAGE SOURCE_DIR...: copy STAGE.npz into VARIANT's work/ if missing
  v=$1; s=$2; shift 2
  for src in "$@"; do
    if [ -f $src/$s.npz ]; then cp -n $src/$s.npz $root/$v/work/$s.npz; return; fi
  done
}
for v in ${VARIANTS:-fixed-order no-floors no-layer no-state no-class no-role}; do
  [ -f $root/$v/calibration.json ] && continue
  left=$((limit - SECONDS - 30))
  if [ $left -lt 120 ]; then echo "ablations: out of time before $v"; exit 0; fi
  mkdir -p $root/$v/work
  share $v reference $full $root/*/work
  case $v in
    fixed-order) share $v runtime_v $full ;;
    no-floors|no-layer) share $v runtime_d $full $root/no-floors/work $root/no-layer/work ;;
  esac
  timeout $left python3 -m pask_jax.cli calibrate --model qwen2.5-coder-1.5b-instruct \
    --out $root/$v ${MAX_CASES:+--max-cases $MAX_CASES} --rows 1024 --max-tokens 128 \
    --window 16 --targets 0.20 --ablation $v >> $OUT/abl15_$v.log 2>&1 \
    || { tail -c 3000 $OUT/abl15_$v.log; exit 0; }
  tail -c 1500 $OUT/abl15_$v.log
  tar czf $OUT/abl15_$v.tgz -C /tmp abl15/$v/policy abl15/$v/calibration.json
done
echo "ablations: all calibrated"
