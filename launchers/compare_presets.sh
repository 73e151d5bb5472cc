#!/usr/bin/env bash
# The comparison workflow in one command: run the same job across several presets and/or batch splits,
# all into one W&B group and one output folder, then `zerofit compare` the results.
#
#   launchers/compare_presets.sh --config configs/demo.yaml --presets "zero1 zero2 zero3" --gpus 2
#   launchers/compare_presets.sh --config configs/demo.yaml --micro "8 4 2" --gpus 2 -- train.max_steps=30
#   launchers/compare_presets.sh --config CFG --presets "zero2 fsdp" --gpus 4 --name ablation
#
# Options:
#   --config FILE     the run config shared by every run (required)
#   --presets "A B"   presets from ds_configs/ (`zerofit presets` lists them); default: the config's own
#   --micro "M N"     micro-batch sizes (the global batch stays fixed; accumulation is derived); default: config's
#   --gpus N          ranks per run (default 1); DeepSpeed presets start under `deepspeed`, FSDP ones `torchrun`
#   --name NAME       sweep name: W&B group and folder runs/NAME (default: <config stem>-<timestamp>)
#   --out DIR         where the comparison tables' plots go (default: runs/NAME/compare)
#   -- key=value ...  extra dotted overrides for every run
#
# Every run is (presets x micro) with run_name = <preset>-m<micro>. A failed run is reported and skipped;
# the script exits non-zero at the end if any run failed, after comparing the ones that finished.
#
# Why a script and not a `zerofit sweep` subcommand: every run needs its own distributed launch
# (`deepspeed --num_gpus N` / `torchrun`), and on a cluster users swap that line for srun or a hostfile.
# A dozen lines of shell they can read and edit beats a Python process that spawns launchers.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_BIN="${VENV_BIN:-$ROOT/.venv/bin}"
[[ -x "$VENV_BIN/python" ]] || VENV_BIN="$(dirname "$(command -v python3)")"
PY="$VENV_BIN/python"
ZEROFIT="$VENV_BIN/zerofit"

CONFIG="" PRESETS="" MICROS="" GPUS=1 NAME="" OUT="" EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --presets) PRESETS="$2"; shift 2 ;;
    --micro) MICROS="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --name) NAME="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare_presets.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$CONFIG" || ! -f "$CONFIG" ]]; then
  echo "compare_presets.sh: --config FILE is required and must exist (got '${CONFIG}')" >&2
  exit 2
fi
NAME="${NAME:-$(basename "${CONFIG%.*}")-$(date +%Y%m%d-%H%M%S)}"
SWEEP_DIR="${SWEEP_DIR:-runs}/$NAME"
OUT="${OUT:-$SWEEP_DIR/compare}"
if [[ -e "$SWEEP_DIR" ]]; then
  # A reused folder would make runs land in <label>-2 and compare stale ones: refuse, say what to do.
  echo "compare_presets.sh: $SWEEP_DIR already exists; pick another --name (or delete that folder)" >&2
  exit 2
fi
# An empty list means "what the config says": one loop iteration with no override.
read -r -a PRESET_LIST <<< "${PRESETS:-_}"
read -r -a MICRO_LIST <<< "${MICROS:-_}"

strategy_of() {  # the engine a preset belongs to (deepspeed | fsdp), from its _zerofit block
  "$PY" - "$1" <<'PYEOF'
import sys
from zerofit.core.errors import ZerofitError
from zerofit.catalogue.presets import get_preset
try:
    print(get_preset(sys.argv[1]).strategy)
except ZerofitError as exc:
    sys.exit(f"compare_presets.sh: {exc}")
PYEOF
}

free_port() {
  "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

RUN_DIRS=() FAILED=()
for preset in "${PRESET_LIST[@]}"; do
  for micro in "${MICRO_LIST[@]}"; do
    overrides=("output_dir=$SWEEP_DIR" "logging.wandb.group=$NAME")
    label=""
    if [[ "$preset" != "_" ]]; then
      strategy="$(strategy_of "$preset")" || exit 2
      overrides+=("distributed.strategy=$strategy" "distributed.preset=$preset")
      label="$preset"
    else
      strategy="$("$PY" -c "import sys; from zerofit.config import load_config; print(load_config(sys.argv[1]).distributed.strategy)" "$CONFIG")"
      label="$strategy"
    fi
    if [[ "$micro" != "_" ]]; then
      # Keep the global batch; let accumulation follow from micro x dp.
      overrides+=("batch.micro_batch_size=$micro" "batch.grad_accum_steps=null")
      label="$label-m$micro"
    fi
    overrides+=("run_name=$label")
    if [[ "$strategy" == "deepspeed" ]]; then
      launch=("$VENV_BIN/deepspeed" --master_port "$(free_port)" --num_gpus "$GPUS")
    else
      launch=("$VENV_BIN/torchrun" --master_port "$(free_port)" --nproc_per_node "$GPUS")
    fi
    echo "== $label: ${launch[*]} launchers/launch_finetune.py --config $CONFIG ${overrides[*]} ${EXTRA[*]:-}"
    if "${launch[@]}" "$ROOT/launchers/launch_finetune.py" --config "$CONFIG" "${overrides[@]}" "${EXTRA[@]}"; then
      RUN_DIRS+=("$SWEEP_DIR/$label")
    else
      echo "== $label FAILED (exit $?); continuing with the other runs" >&2
      FAILED+=("$label")
    fi
  done
done

if [[ ${#RUN_DIRS[@]} -gt 0 ]]; then
  "$ZEROFIT" compare "${RUN_DIRS[@]}" --out "$OUT"
fi
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "compare_presets.sh: ${#FAILED[@]} run(s) failed: ${FAILED[*]}" >&2
  exit 1
fi
