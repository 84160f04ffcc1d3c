#!/usr/bin/env bash
# Every GPU check of the standing GPU issue in ONE device call, within one call's limit.
#
# The lent GPU machine stays warm only ~30 s between calls, each fresh start costs minutes of a 15-minute
# budget, and one command may run at most 600 s: so the checks are chained here, each under its own time limit
# (the next stage still runs when one fails or times out), and every stage's whole output is kept under $OUT.
#
#   bash ../shared/tools/device-wheels.sh liger-kernel==0.8.5 torchao==0.18.0 bitsandbytes==0.50.2  # here (.whl/)
#   device run, carry [".whl"], timeout 590:  bash benchmarks/gpu_session.sh          # every stage, ~9 min
#   device run ...:  bash benchmarks/gpu_session.sh throughput precision              # only these stages
#   bash benchmarks/gpu_session.sh --dry-run [STAGE...]                               # print the plan, run nothing
#
# Stages (default: all, in this order, the issue's first needs first; each has a limit in seconds, cut to what is
# left of DEADLINE_S, so that the call ends inside the device's 600 s):
#   install     the carried wheels and this project (no index: nothing can be downloaded there)
#   doctor      `hf-scale doctor` and `hf-scale doctor --config` of a generated ZeRO-2 config      -> doctor.txt
#   throughput  benchmarks/gpu.py: plain Trainer vs hf_scale's variants, the best one profiled     -> gpu.json
#   memory      benchmarks/planner_gpu_memory.py: measured / predicted peak memory per strategy   -> planner_gpu_memory-*.json
#   saves       train.py, bf16, one process: ZeRO-2 and FSDP2, each loop; exit 0, the save check's cost -> saves.log
#   precision   benchmarks/gpu.py --merge: FP8 against bf16+compile, QLoRA against LoRA           -> gpu.json
#   fsdp_save   benchmarks/gpu_fsdp_final_save.py: the Trainer's SHARDED_STATE_DICT final save     -> fsdp_final_save.json
# Results land in $OUT (the device tool brings them back); copy them to benchmarks/results/ and write the
# README/docs numbers from them (docs/gpu.md, benchmarks/README.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-/tmp/hf-scale-gpu-session}
DEADLINE_S=${DEADLINE_S:-570}
WORK=${WORK:-/tmp/hf-scale-gpu-work}
ALL_STAGES=(install doctor throughput memory saves precision fsdp_save)
# The same setup in every gpu.py call, so that --merge keeps the earlier calls' rows (gpu.py compares it).
GPU_PY_SETUP="--steps 20 --warmup 5 --variant-timeout 75 --workdir $WORK/gpu"

dry_run=0
stages=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *)
      if [[ " ${ALL_STAGES[*]} " != *" $arg "* ]]; then
        echo "gpu_session.sh: error: stage '$arg' is not one of: ${ALL_STAGES[*]}" >&2
        exit 2
      fi
      stages+=("$arg") ;;
  esac
done
[ ${#stages[@]} -gt 0 ] || stages=("${ALL_STAGES[@]}")

stage_limit() {  # the stage's own limit, or what is left of the session's
  local limit=$1 left=$((DEADLINE_S - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  echo "$limit"
}

commands_of() {
  case "$1" in
    install)  # the carried wheels (word-split and globbed below) and the project
      echo "python3 -m pip install -q --no-index --no-deps --no-build-isolation .whl/*.whl -e ." ;;
    doctor)
      echo "python3 -m hf_scale doctor"
      echo "python3 -m hf_scale generate --preset zero2 --set topology.processes_per_machine=1 --output-dir $WORK/cfg --force"
      echo "python3 -m hf_scale doctor --config $WORK/cfg/accelerate_configs/zero2.yaml" ;;
    throughput)  # one gpu.py call per variant, --merge: a stage cut short keeps the variants already measured
      for variant in baseline torch_packed_bf16 hf_scale hf_scale_loop hf_scale_best; do
        echo "python3 benchmarks/gpu.py --variants $variant $GPU_PY_SETUP --merge --output $OUT/gpu.json"
      done
      echo "python3 benchmarks/gpu.py --variants hf_scale_best_bf16 $GPU_PY_SETUP --merge --profile --output $OUT/gpu.json" ;;
    precision)
      for variant in hf_scale_compile hf_scale_fp8 hf_scale_lora hf_scale_qlora; do
        echo "python3 benchmarks/gpu.py --variants $variant $GPU_PY_SETUP --merge --output $OUT/gpu.json"
      done ;;
    saves)  # bf16, one process, ZeRO-2 and FSDP2, each loop: exit 0 and the save check's line ("verified ...")
      for preset in zero2 fsdp2_full_shard; do
        echo "python3 -m hf_scale generate --preset $preset --set topology.processes_per_machine=1 --output-dir $WORK/cfg --force"
        for loop in trainer accelerate; do
          echo "bash $WORK/cfg/launch/$preset.accelerate.sh --loop $loop --max_steps 4 --save_steps 2 --output_dir $WORK/runs/$preset-$loop --overwrite_output_dir"
        done
      done ;;
    memory)  # one call per strategy (each writes its own file): a stage cut short keeps the ones measured
      for candidate in ddp zero2 zero3 fsdp2_full_shard zero3_ac zero1; do
        echo "python3 benchmarks/planner_gpu_memory.py --gpus 1 --candidates $candidate --timeout 40 --output $OUT/planner_gpu_memory-$candidate.json"
      done ;;
    fsdp_save)
      echo "python3 benchmarks/gpu_fsdp_final_save.py --workdir $WORK/fsdp_save --output $OUT/fsdp_final_save.json" ;;
  esac
}

limit_of() {
  case "$1" in
    install) echo 40 ;; doctor) echo 40 ;; throughput) echo 330 ;; memory) echo 120 ;; saves) echo 120 ;; precision) echo 150 ;;
    fsdp_save) echo 60 ;;
  esac
}

if [ "$dry_run" = 1 ]; then
  for stage in "${stages[@]}"; do
    echo "# $stage (limit $(limit_of "$stage") s)"
    commands_of "$stage"
  done
  exit 0
fi

mkdir -p "$OUT" "$WORK"
summary="$OUT/session.tsv"
printf 'stage\texit\tseconds\n' > "$summary"
for stage in "${stages[@]}"; do
  limit=$(stage_limit "$(limit_of "$stage")")
  if [ "$limit" -le 5 ]; then
    printf '%s\tskipped (no time left)\t0\n' "$stage" >> "$summary"
    continue
  fi
  start=$SECONDS
  code=0
  while IFS= read -r command; do
    echo "\$ $command" >> "$OUT/$stage.log"
    # shellcheck disable=SC2086  # this script's own commands, word-split (and .whl/*.whl globbed) on purpose
    timeout "$((limit - SECONDS + start > 1 ? limit - SECONDS + start : 1))" $command >> "$OUT/$stage.log" 2>&1 \
      || code=$?
  done < <(commands_of "$stage")
  [ "$stage" = doctor ] && cp "$OUT/$stage.log" "$OUT/doctor.txt"
  printf '%s\t%s\t%s\n' "$stage" "$code" "$((SECONDS - start))" >> "$summary"
  tail -n 3 "$OUT/$stage.log" | sed "s/^/[$stage] /"
done
cat "$summary"
