# Device (H200): calibrate the paper's ablations (Fig. 5; `pask-jax calibrate --ablation`) of
# Qwen2.5-Coder-1.5B with the flags of scripts/h200_campaign15.sh (every calibration and
# development case, W 16, total-B target 0.20), one variant after another into /tmp/abl15/<v>,
# then run examples/campaign_15b_ablations.toml (each variant at B 0.20 on the test split) into
# /tmp/c15a.  Resumable across 10-minute calls on a warm machine: a variant whose
# calibration.json exists (in /tmp/abl15/<v>/, or committed under $pol/<v>/ by an earlier
# session) is done and skipped, an interrupted one resumes from its saved stages (work/, on the
# warm machine only), the campaign runs only the cells still missing; call it again until it
# prints "ablations: all calibrated" and the campaign has nothing left.
#   bash scripts/h200_ablations15.sh    (carry .whl; the model uploaded to /tmp/m beforehand)
#   LIMIT     seconds this call may take (default 560)
#   ROWS      --rows of each calibration (default 1024 on a card over 100 GB, else 512)
#   VARIANTS  which, in order (default: fixed-order no-floors no-layer no-state no-class no-role
#             no-transition; at another WINDOW: full no-transition no-state)
#   WINDOW    the recent window W of every calibration (default 16, the full method's); another
#             W writes to /tmp/abl15-w<W>, policies/...-ablations-w<W>/ and runs
#             examples/campaign_15b_ablations-w<W>.toml
#   NOKEEP    1: calibrate with --no-decode-keep (each variant's B 0.20 policy composes its own
#             decode stage, never keep-at-L; bench/RESULTS.md 2026-12-06 (fourth): with it the
#             full method and no-transition at W 4 were one policy); writes to .../<dirs>-nokeep
#   MAX_CASES cases per category for calibration and development (default: every case, as the
#             committed full-method policy; keep it the same over the calls)
#   DECODE_B  a matched decode budget (`calibrate --decode-b`): every variant's B 0.20 policy
#             composes its decode candidate whose dev-measured decode B is nearest DECODE_B
#             (keep-at-L left out, NOKEEP not needed); with WINDOW=4 the default variants are
#             no-transition no-state, matched to the W 4 full method's decode B (0.209 on dev);
#             writes to .../<dirs>-bd<DECODE_B> and runs examples/campaign_15b_ablations<sfx>.toml
#   TAG       appended to the suffix of every directory and of the plan's name (e.g. -reaim: a
#             second calibration beside a committed one, which would otherwise be skipped)
#   CELLS     1: with VARIANTS, also run the plan's cells of the variants whose policies exist
#   FULL_WORK the work/ of a full-method calibration with the same flags (e.g. /tmp/cal15c/work
#             of h200_campaign15.sh on the same machine): its shared stages are copied too
# Stages a variant does not change are keyed without its ablation and copied in before it starts
# (cp -n): the reference from any variant; Runtime-D of no-layer from no-floors (both measure the
# full method's buckets); with FULL_WORK also Runtime-V of fixed-order and Runtime-D of no-floors.
# Each finished variant comes back as $OUT/abl15_<v>.tgz (abl15/<v>/policy + calibration.json),
# the cells as $OUT/c15a.tgz.  Commit the policies as
# policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations/<v>/ (policy + B0.20/ + calibration.json):
#   for f in abl15_*.tgz; do tar xzf $f -C /tmp; done
#   for v in /tmp/abl15/*/; do d=policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations/$(basename $v)
#     mkdir -p $d && cp -r $v/policy/. $d/ && cp $v/calibration.json $d/; done
if [ "${NOKEEP:-0}" = 1 ] && [ "${WINDOW:-16}" = 16 ]; then
  echo "NOKEEP=1 is for the W 4 plan (examples/campaign_15b_ablations-w4-nokeep.toml): give WINDOW=4"
  exit 2
fi
if [ -n "$DECODE_B" ] && [ "${WINDOW:-16}" = 16 ]; then
  echo "DECODE_B is for the W 4 plans (examples/campaign_15b_ablations-w4-bd<B>.toml): give WINDOW=4"
  exit 2
fi
set -x
. scripts/h200_env.sh
limit=${LIMIT:-560}
# --rows 1024 (the committed full method's) ran out of memory in Runtime-V on an 80 GB H100
# (2026-12-06): 512 rows there unless ROWS says otherwise (rows: how many stacked interventions
# run as one batch, not a setting of the method)
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
rows=${ROWS:-$([ "${gib:-0}" -gt 100000 ] && echo 1024 || echo 512)}
win=${WINDOW:-16}
sfx=$([ "$win" = 16 ] || echo "-w$win")$([ "${NOKEEP:-0}" = 1 ] && echo -nokeep)\
$([ -n "$DECODE_B" ] && echo "-bd$DECODE_B")${TAG:-}
root=/tmp/abl15$sfx
pol=policies/qwen2.5-coder-1.5b-instruct-bfcl-ablations$sfx
plan=examples/campaign_15b_ablations$sfx.toml
full=${FULL_WORK:-/nonexistent}
mkdir -p $root
share() {   # share VARIANT STAGE SOURCE_DIR...: copy STAGE.npz into VARIANT's work/ if missing
  v=$1; s=$2; shift 2
  for src in "$@"; do
    if [ -f $src/$s.npz ]; then cp -n $src/$s.npz $root/$v/work/$s.npz; return; fi
  done
}
all="fixed-order no-floors no-layer no-state no-class no-role no-transition"
# Another window: the full method beside the decode-key contrasts (parser tags vs position bins,
# the parser state), all calibrated at that window (bench/results/2026-12-06_session21: at W 16
# every decode candidate of every variant is within one dev case of all-high).
[ "$win" = 16 ] || all="full no-transition no-state"
[ -n "$DECODE_B" ] && all="no-transition no-state"
for v in ${VARIANTS:-$all}; do
  [ -f $root/$v/calibration.json ] || [ -f $pol/$v/calibration.json ] && continue
  left=$((limit - SECONDS - 30))
  if [ $left -lt 120 ]; then echo "ablations: out of time before $v"; exit 0; fi
  mkdir -p $root/$v/work
  share $v reference $full $root/*/work
  case $v in
    fixed-order) share $v runtime_v $full ;;
    no-floors|no-layer) share $v runtime_d $full $root/no-floors/work $root/no-layer/work ;;
  esac
  timeout $left python3 -m pask_jax.cli calibrate --model qwen2.5-coder-1.5b-instruct \
    --out $root/$v ${MAX_CASES:+--max-cases $MAX_CASES} --rows $rows --max-tokens 128 \
    --window $win --targets 0.20 --keep-within-se 0 $([ $v = full ] || echo --ablation $v) \
    $([ "${NOKEEP:-0}" = 1 ] && echo --no-decode-keep) ${DECODE_B:+--decode-b $DECODE_B} \
    >> $OUT/abl15${sfx}_$v.log 2>&1 || { tail -c 3000 $OUT/abl15${sfx}_$v.log; exit 0; }
  tail -c 1500 $OUT/abl15${sfx}_$v.log
  tar czf $OUT/abl15${sfx}_$v.tgz -C /tmp abl15$sfx/$v/policy abl15$sfx/$v/calibration.json
done
echo "ablations: all calibrated"
# The plan names every variant: with a VARIANTS subset, calibration only, unless CELLS=1 (then
# the plan's methods whose policy is not there yet are left out of this call's campaign).
[ -n "$VARIANTS" ] && [ "${CELLS:-0}" != 1 ] && exit 0
# Every call sends the committed tree: the policies calibrated here go where the plan reads them
# (committed ones stay as they are).
for v in $all ${VARIANTS:-}; do
  [ -f $root/$v/calibration.json ] || continue
  rm -rf $pol/$v && mkdir -p $pol/$v && cp -r $root/$v/policy/. $pol/$v/ \
    && cp $root/$v/calibration.json $pol/$v/
done
mkdir -p /tmp/c15a$sfx
if [ "${CELLS:-0}" = 1 ]; then
  python3 - $plan /tmp/plan_abl.toml <<'PY'
import os, re, sys
text = open(sys.argv[1]).read()
head, *blocks = re.split(r"(?m)^(?=\[)", text)
def kept(block):   # a method whose policy is not there yet is left out; anything else stays
  m = re.search(r'policy = "([^"]+)"', block)
  return not block.startswith("[methods.") or not m or os.path.isdir(
      m.group(1).format(budget=0.20))
keep = [b for b in blocks if kept(b)]
open(sys.argv[2], "w").write(head + "".join(keep))
PY
  plan=/tmp/plan_abl.toml
fi
# A campaign cell can run past --time-limit (its estimate is a guess): leave 60 s for the tar.
t=$((limit - SECONDS - 60))
[ $t -gt 60 ] && timeout $((t + 40)) python3 -m pask_jax.cli campaign \
  $plan --time-limit $t --results /tmp/c15a$sfx --no-progress \
  >> $OUT/campaign_abl$sfx.log 2>&1
grep -E "accuracy|campaign|failed|error" $OUT/campaign_abl$sfx.log | tail -40
tar czf $OUT/c15a$sfx.tgz -C /tmp c15a$sfx
