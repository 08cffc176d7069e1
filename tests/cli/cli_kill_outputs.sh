# Outputs under SIGKILL (issue #22): `run` and `sweep` killed with `kill -9` at random moments never leave a partial
# file under a final name (each output is written to a temporary name and renamed), and `sweep --resume` continues a
# killed sweep to the same set of rows. (`train`: tests/cli_train_resume.sh.) The moments are random fractions of the
# measured runtime; STREAMBP_KILL_SEED=N replays a draw.
# ctest-cost: 65
source "$(dirname "$0")/../support/cli_common.sh"
kill_seed=${STREAMBP_KILL_SEED:-$(($(date +%s%N) / 1000 % 32768))}
RANDOM=$kill_seed
echo "kill moments drawn with STREAMBP_KILL_SEED=$kill_seed"

# Every final-named output that exists must be whole: JSON/CSV parse, safetensors read back.
check_whole() {
  local f
  for f in "$@"; do
    [[ -e $f ]] || continue
    case $f in
      *.json) python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$f" || fail "partial JSON $f" ;;
      *.csv) python3 -c "import csv,sys; rows=list(csv.reader(open(sys.argv[1]))); assert rows and all(len(r) == len(rows[0]) for r in rows)" "$f" ||
               fail "partial CSV $f:\n$(cat "$f")" ;;
      *.safetensors) "$STREAMBP" compare "$f" "$f" --rtol 0 >/dev/null || fail "partial safetensors $f" ;;
    esac
  done
}

run_args=(run --preset tiny --method standard --dtype fp32 --batch 2 --seq 2048 --json r.json --save-grads g.safetensors
          --save-batch b.safetensors --save-model m --force)
start=$(date +%s%N)
"$STREAMBP" "${run_args[@]}" >/dev/null 2>&1 || fail "run failed"
total_ms=$((($(date +%s%N) - start) / 1000000))
echo "run: ${total_ms} ms uninterrupted"
for i in 1 2 3 4 5; do
  rm -rf r.json g.safetensors b.safetensors m
  "$STREAMBP" "${run_args[@]}" >/dev/null 2>&1 &
  pid=$!
  sleep "$(awk -v t="$total_ms" -v r=$RANDOM 'BEGIN { printf "%.3f", t * (0.2 + 0.7 * r / 32768) / 1000 }')"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  check_whole r.json g.safetensors b.safetensors m/model.safetensors m/config.json
  echo "ok: run killed ($i): whole outputs only: $(ls -d r.json g.safetensors b.safetensors m/* 2>/dev/null | tr '\n' ' ')"
done

sweep_args=(sweep seq --preset tiny --seq 256,512,1024,2048 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64"
            --repeats 1 --check-seq 0)
start=$(date +%s%N)
"$STREAMBP" "${sweep_args[@]}" --out full >/dev/null 2>&1 || fail "sweep failed"
total_ms=$((($(date +%s%N) - start) / 1000000))
echo "sweep: ${total_ms} ms uninterrupted"
for i in 1 2 3; do
  rm -rf killed
  "$STREAMBP" "${sweep_args[@]}" --out killed >/dev/null 2>&1 &
  pid=$!
  sleep "$(awk -v t="$total_ms" -v r=$RANDOM 'BEGIN { printf "%.3f", t * (0.3 + 0.6 * r / 32768) / 1000 }')"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  csv=$(ls killed/seq-*.csv 2>/dev/null || true)
  [[ -n $csv ]] || { echo "ok: sweep killed ($i) before its first point: no CSV"; continue; }
  check_whole "$csv" "${csv%.csv}.json"
  before=$(($(wc -l <"$csv") - 1))
  "$STREAMBP" sweep seq --preset tiny --seq 256,512,1024,2048 --methods "checkpoint;streambp:layer_chunk=64,head_chunk=64" \
    --repeats 1 --check-seq 0 --resume "$csv" >/dev/null 2>&1 || fail "sweep --resume after a kill failed"
  python3 - "$csv" <<'PY' || fail "the resumed sweep's rows:\n$(cat "$csv")"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
got = sorted((r["method"], r["seq_len"]) for r in rows)
want = sorted((m, t) for m in ["checkpoint", "streambp:layer_chunk=64,head_chunk=64"] for t in ["256", "512", "1024", "2048"])
assert got == want, got
PY
  echo "ok: sweep killed ($i) with $before rows written, resumed to all 8"
done
