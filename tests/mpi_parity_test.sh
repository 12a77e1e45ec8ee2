#!/usr/bin/env bash
# Cluster parity: `colibri run` under mpirun with 1-4 ranks, every placement
# policy, the coordinator hosting experts or not, expert caches small enough to
# evict, the default and the UCX transport, must give logits BITWISE identical to
# the single-process run on the transformers fixtures, and identical tokens.
# usage: mpi_parity_test.sh COLIBRI FIXTURES_DIR [handful|quick|full]
#   handful (CTest's cluster.parity, the sanitizer stage): a few real mpirun runs
#           of mixtral_a that keep the MPI path covered: 2 ranks over the default
#           transport, the coordinator hosting experts, replicas with an evicting
#           cache, a placement file with the pinned cache (--stats), the traffic
#           check, UCX; and one other family. The whole matrix runs in one process
#           over the in-process communicator: tests/test_cluster_parity.cpp
#           (ClusterParity suites of colibri_tests), the same runs compared the same way.
#   quick   the matrix below without 3 ranks, mixtral_a and three other families.
#   full    the whole matrix under mpirun (~100 jobs, ~2 min here).
set -euo pipefail
colibri="$1"
fixtures="$2"
mode="${3:-full}"
case "$mode" in handful | quick | full) ;; *) echo "mode '$mode': handful, quick or full" >&2; exit 2 ;; esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_WAIT_POLICY=passive
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mpirun_base=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 --mca btl self,vader,tcp)
ucx=(--mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any)
fail=0
runs=0

check() {  # name, then the command; compares tokens and logits with the reference
  local name="$1"; shift
  runs=$((runs + 1))
  if ! "$@" --dump-logits "$work/out.npy" > "$work/out.txt" 2> "$work/err.txt"; then
    echo "FAIL $name: exit non-zero"; sed 's/^/    /' "$work/err.txt" | tail -20; fail=$((fail + 1)); return
  fi
  if ! diff <(grep '^sequence' "$work/ref.txt") <(grep '^sequence' "$work/out.txt") > /dev/null; then
    echo "FAIL $name: tokens differ"; diff <(grep '^sequence' "$work/ref.txt") <(grep '^sequence' "$work/out.txt") | head -5
    fail=$((fail + 1)); return
  fi
  if ! cmp -s "$work/ref.npy" "$work/out.npy"; then
    echo "FAIL $name: logits are not bitwise identical"; fail=$((fail + 1)); return
  fi
  echo "ok   $name"
}

# ---- handful: a few real mpirun runs (the matrix runs in one process) ---------
setup_fixture() {  # fx: converts, reads the prompts, makes the reference and its stats
  local fx="$1"
  model="$work/$fx.colibri"
  "$colibri" convert "$fixtures/$fx/hf" "$model" --dtype f32 --log-level warn
  prompts=()
  while read -r line; do prompts+=(--prompt-ids "$line"); done < <(python3 -c "
import json; [print(','.join(map(str,p))) for p in json.load(open('$fixtures/$fx/expected.json'))['prompts']]")
  if [ ${#prompts[@]} -eq 0 ]; then echo "FAIL $fx: no prompts in expected.json"; exit 1; fi
  common=(--model "$model" "${prompts[@]}" --max-new-tokens 8 --ignore-eos --log-level warn)
  "$colibri" generate "${common[@]}" --dump-logits "$work/ref.npy" --record-routing "$work/trace.jsonl" > "$work/ref.txt"
  "$colibri" stats "$work/trace.jsonl" --out "$work/stats.json" --log-level warn > /dev/null
  echo "== $fx: $(grep -c '^sequence' "$work/ref.txt") sequences"
}
traffic_check() {  # fx: np=3 round_robin, the coordinator hosting nothing; every row crosses once
  local fx="$1"
  "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy round_robin > "$work/x.txt" 2>/dev/null
  read -r passes tokens rows rowbytes countbytes total < <(sed -nE 's/^exchange: ([0-9]+) forward passes, ([0-9]+) tokens, ([0-9]+) .* = ([0-9]+) row bytes, ([0-9]+) count bytes, ([0-9]+) bytes.*/\1 \2 \3 \4 \5 \6/p' "$work/x.txt")
  cfg=$("$colibri" inspect "$model" --json | python3 -c "import json,sys; c=json.load(sys.stdin)['config']; print(c['experts_per_token'], c['num_layers'], c['hidden_size'], c['num_experts'])" 2>/dev/null || echo "")
  runs=$((runs + 1))
  if [ -z "$cfg" ]; then
    echo "FAIL $fx traffic: cannot read the model's config with inspect --json"; fail=$((fail + 1)); return
  fi
  read -r k layers hidden experts <<< "$cfg"
  want_rows=$((tokens * k * layers))
  want_counts=$((passes * layers * 2 * experts * 4))   # to 2 workers, E uint32 counts each, per layer
  if [ "$rows" = "$want_rows" ] && [ "$rowbytes" = $((want_rows * hidden * 4)) ] && [ "$countbytes" = "$want_counts" ] && \
     [ "$total" = $((rowbytes + countbytes)) ]; then
    echo "ok   $fx traffic: $rows rows = tokens $tokens x k $k x layers $layers, $total bytes = rows + counts"
  else
    echo "FAIL $fx traffic: rows $rows (want $want_rows), row bytes $rowbytes, count bytes $countbytes (want $want_counts), total $total"
    fail=$((fail + 1))
  fi
}
if [ "$mode" = handful ]; then
  setup_fixture mixtral_a
  check "mixtral_a np=2 contiguous" "${mpirun_base[@]}" -np 2 "$colibri" run "${common[@]}"
  check "mixtral_a np=3 balanced coordinator-experts=yes" \
    "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced --stats "$work/stats.json" --coordinator-experts
  check "mixtral_a np=4 replicated R=2 coordinator-experts, cache 1 expert/rank lru" \
    "${mpirun_base[@]}" -np 4 "$colibri" run "${common[@]}" --policy replicated --redundant 2 --coordinator-experts \
    --stats "$work/stats.json" --expert-cache-experts 1 --cache-policy lru
  "$colibri" place --model "$model" --ranks 3 --policy round_robin --out "$work/p.json" --log-level warn > /dev/null
  check "mixtral_a np=3 placement file, cache 1 expert/rank pinned" \
    "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --placement "$work/p.json" \
    --expert-cache-experts 1 --cache-policy pinned --stats "$work/stats.json"
  traffic_check mixtral_a
  check "mixtral_a np=3 UCX" "${mpirun_base[@]}" "${ucx[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced --stats "$work/stats.json"
  setup_fixture deepseek_v3_a
  check "deepseek_v3_a np=3 balanced" "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced --stats "$work/stats.json"
  echo "$runs runs, $fail failed"
  [ "$fail" -eq 0 ]
  exit
fi

# ---- quick / full: the matrix under mpirun --------------------------------------
for fx in mixtral_a mixtral_b mixtral_c; do
  [ "$mode" = quick ] && [ "$fx" != mixtral_a ] && continue
  model="$work/$fx.colibri"
  "$colibri" convert "$fixtures/$fx/hf" "$model" --dtype f32 --log-level warn
  prompts=()
  while read -r line; do prompts+=(--prompt-ids "$line"); done < <(python3 -c "
import json; [print(','.join(map(str,p))) for p in json.load(open('$fixtures/$fx/expected.json'))['prompts']]" 2>/dev/null || true)
  if [ ${#prompts[@]} -eq 0 ]; then prompts=(--prompt-ids 3,17,42,9,1 --prompt-ids 5,6,7,8,9,10,11,12,13 --prompt-ids 100,2); fi
  common=(--model "$model" "${prompts[@]}" --max-new-tokens 8 --ignore-eos --log-level warn)
  # The reference: one process. Its routing trace feeds the balanced placements.
  "$colibri" generate "${common[@]}" --dump-logits "$work/ref.npy" --record-routing "$work/trace.jsonl" > "$work/ref.txt"
  "$colibri" stats "$work/trace.jsonl" --out "$work/stats.json" --log-level warn > /dev/null
  echo "== $fx: $(grep -c '^sequence' "$work/ref.txt") sequences"
  check "$fx run world=1" "$colibri" run "${common[@]}"
  for np in 2 3 4; do
    for policy in contiguous round_robin balanced replicated; do
      for coord in no yes; do
        [ "$mode" = quick ] && [ "$np" = 3 ] && continue
        extra=(--policy "$policy" --stats "$work/stats.json")
        if [ "$policy" = replicated ]; then
          # Replicas need a second host rank: with np=2 only when rank 0 hosts too.
          [ "$np" = 2 ] && [ "$coord" = no ] && continue
          extra+=(--redundant 2)
        fi
        [ "$coord" = yes ] && extra+=(--coordinator-experts)
        check "$fx np=$np $policy coordinator-experts=$coord" \
          "${mpirun_base[@]}" -np "$np" "$colibri" run "${common[@]}" "${extra[@]}"
      done
    done
  done
  # A placement file, a small evicting cache of every policy, and the UCX transport.
  "$colibri" place --model "$model" --ranks 3 --policy round_robin --out "$work/p.json" --log-level warn > /dev/null
  for cp in lru lfu hybrid pinned predict; do
    check "$fx np=3 placement file, cache 1 expert/rank $cp" \
      "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --placement "$work/p.json" \
      --expert-cache-experts 1 --cache-policy "$cp" --stats "$work/stats.json"
  done
  # Traffic: with the coordinator hosting no experts every (token, expert) row
  # crosses the wire exactly once (tokens x top-k x layers), and apart from the
  # per-layer counts nothing else is sent: not the whole batch per rank.
  traffic_check "$fx"
  check "$fx np=3 UCX" "${mpirun_base[@]}" "${ucx[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced --stats "$work/stats.json"
done
# The other families (dense-then-MoE layers, shared experts, grouped and biased
# routing, MLA, sinks, MXFP4...): non-trivial placements over MoE layers only,
# bitwise equal to one process. Quick mode (sanitizers): three families, one run each.
for fx in qwen2_moe_a qwen2_moe_b qwen3_moe_a qwen3_moe_b olmoe_a olmoe_b deepseek_v2_a deepseek_v2_b \
          deepseek_v3_a deepseek_v3_b glm4_moe_a glm4_moe_b gpt_oss_a gpt_oss_b gpt_oss_mxfp4; do
  if [ "$mode" = quick ]; then case "$fx" in qwen2_moe_a|deepseek_v3_a|gpt_oss_a) ;; *) continue ;; esac; fi
  model="$work/$fx.colibri"
  "$colibri" convert "$fixtures/$fx/hf" "$model" --dtype f32 --log-level warn
  prompts=()
  while read -r line; do prompts+=(--prompt-ids "$line"); done < <(python3 -c "
import json; [print(','.join(map(str,p))) for p in json.load(open('$fixtures/$fx/expected.json'))['prompts']]")
  if [ ${#prompts[@]} -eq 0 ]; then echo "FAIL $fx: no prompts in expected.json"; fail=$((fail + 1)); continue; fi
  common=(--model "$model" "${prompts[@]}" --max-new-tokens 8 --ignore-eos --log-level warn)
  "$colibri" generate "${common[@]}" --dump-logits "$work/ref.npy" --record-routing "$work/trace.jsonl" > "$work/ref.txt"
  "$colibri" stats "$work/trace.jsonl" --out "$work/stats.json" --log-level warn > /dev/null
  echo "== $fx: $(grep -c '^sequence' "$work/ref.txt") sequences"
  check "$fx np=3 balanced" "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced --stats "$work/stats.json"
  [ "$mode" = quick ] && continue
  check "$fx np=4 replicated R=2 coordinator-experts, cache 1 expert/rank lru" \
    "${mpirun_base[@]}" -np 4 "$colibri" run "${common[@]}" --policy replicated --redundant 2 --coordinator-experts \
    --stats "$work/stats.json" --expert-cache-experts 1 --cache-policy lru
  # Traffic counts MoE layers only: dense layers never leave the coordinator.
  "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy round_robin > "$work/x.txt" 2>/dev/null
  read -r tokens rows < <(sed -nE 's/^exchange: ([0-9]+) forward passes, ([0-9]+) tokens, ([0-9]+) .*/\2 \3/p' "$work/x.txt")
  want=$("$colibri" inspect "$model" --json | python3 -c "import json,sys; c=json.load(sys.stdin)['config']; print(c['experts_per_token'] * len(c['moe_layers']))")
  runs=$((runs + 1))
  if [ -n "$rows" ] && [ -n "$want" ] && [ "$rows" = $((tokens * want)) ]; then
    echo "ok   $fx traffic: $rows rows = tokens $tokens x k x MoE layers ($want)"
  else
    echo "FAIL $fx traffic: rows '$rows', want tokens '$tokens' x $want"; fail=$((fail + 1))
  fi
done
# Quantised files: the workers' stores and caches hold int4 expert blocks, the
# coordinator int8 dense matrices; still bitwise one process. Quick mode: one run.
for fx in mixtral_a deepseek_v3_a; do
  [ "$mode" = quick ] && [ "$fx" != mixtral_a ] && continue
  model="$work/$fx.q.colibri"
  group=32; [ "$fx" = deepseek_v3_a ] && group=16
  "$colibri" convert "$fixtures/$fx/hf" "$model" --dtype bf16 --quantize-experts int4 --quantize-dense int8 \
    --group-size "$group" --log-level warn
  prompts=()
  while read -r line; do prompts+=(--prompt-ids "$line"); done < <(python3 -c "
import json; [print(','.join(map(str,p))) for p in json.load(open('$fixtures/$fx/expected.json'))['prompts']]")
  common=(--model "$model" "${prompts[@]}" --max-new-tokens 8 --ignore-eos --log-level warn)
  "$colibri" generate "${common[@]}" --dump-logits "$work/ref.npy" --record-routing "$work/trace.jsonl" > "$work/ref.txt"
  "$colibri" stats "$work/trace.jsonl" --out "$work/stats.json" --log-level warn > /dev/null
  echo "== $fx int4 experts + int8 dense: $(grep -c '^sequence' "$work/ref.txt") sequences"
  check "$fx quantised np=3 balanced" "${mpirun_base[@]}" -np 3 "$colibri" run "${common[@]}" --policy balanced \
    --stats "$work/stats.json"
  [ "$mode" = quick ] && continue
  check "$fx quantised np=4 replicated R=2 coordinator-experts, cache 1 expert/rank lru" \
    "${mpirun_base[@]}" -np 4 "$colibri" run "${common[@]}" --policy replicated --redundant 2 --coordinator-experts \
    --stats "$work/stats.json" --expert-cache-experts 1 --cache-policy lru
done
echo "$runs runs, $fail failed"
[ "$fail" -eq 0 ]
