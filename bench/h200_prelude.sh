# Sourced by the bench/h200_*.sh device scripts: the shared set-up of one device call.
# Sets OUT (results), L and Q (the Llama-3-8B and Qwen3-0.6B shaped models' directories),
# starts nvidia-smi sampling the clocks every 500 ms into $OUT/smi-$PART.csv (read only)
# and the host's CPU counters (the `cpu` line of /proc/stat, steal time included) every
# second into $OUT/procstat-$PART.txt (both stop when the script exits), and defines `step NAME` (a timestamped progress line) and
# `make_llama` (builds the 8B-shaped model once per warm machine).
set -u
OUT=${OUT:-/tmp/out}
L=/tmp/m/llama3-8b
Q=/tmp/m/qwen3-0.6b
mkdir -p /tmp/m "$OUT"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,pstate \
  --format=csv -lms 500 > "$OUT/smi-${PART:-run}.csv" 2>&1 &
SMI=$!
( while :; do echo "$(date +%s.%N) $(head -1 /proc/stat)"; sleep 1; done ) \
  > "$OUT/procstat-${PART:-run}.txt" 2>&1 &
PROCSTAT=$!
trap 'kill $SMI $PROCSTAT 2> /dev/null' EXIT
step() { echo "== $1 $(date +%T)"; }
make_llama() {
  [ -f $L/config.json ] || { step make-llama; timeout 150 python3 bench/make_shaped_model.py llama3-8b $L > "$OUT/make-llama.log" 2>&1; }
}
