#!/usr/bin/env bash
# The GPT recipe pilots of docs/TRAINING.md: equal tokens (200 steps x 16 x 256 = 819,200), same data,
# seed and batch order, cosine to 10 % of the peak lr; one thread each, all at once on the 2 cores.
# Usage: bash training/pilots.sh [RUNS]   (a finished pilot is skipped; the table: python -m training pilots)
set -euo pipefail
RUNS=${1:-runs/pilots}
mkdir -p "$RUNS"
PY=${PYTHON:-.venv/bin/python}
[ -f "$RUNS/tok8k.json" ] || $PY -m training tokenizer --vocab-size 8192 --out "$RUNS/tok8k.json"
[ -f "$RUNS/tok16k.json" ] || $PY -m training tokenizer --vocab-size 16384 --out "$RUNS/tok16k.json"
BASE=(--variant rope --n-layer 6 --n-head 8 --d-model 320 --context-length 256 --batch-size 16 --lr 1e-3
  --min-lr 1e-4 --warmup-steps 20 --dropout 0.1 --weight-decay 0.1 --max-steps 200 --eval-interval 50
  --save-interval 50 --amp bf16 --no-final-eval --tokenizer "$RUNS/tok8k.json")
declare -A PILOTS=(
  [base]=""
  [learned]="--variant learned-pos"
  [sinusoidal]="--variant dot"
  [lr2e-3]="--lr 2e-3 --min-lr 2e-4"
  [lr3e-3]="--lr 3e-3 --min-lr 3e-4"
  [wide-4x384]="--n-layer 4 --d-model 384 --n-head 6"
  [deep-10x256]="--n-layer 10 --d-model 256 --n-head 8"
  [vocab16k]="--tokenizer $RUNS/tok16k.json"
  [context512]="--context-length 512 --batch-size 8"
)
# Regularisation for a many-epoch run cannot show in 200 steps, so it is piloted on a model and a corpus
# both about 10x smaller than the full run's (4 x 128 on the first tenth of the train articles), for
# the full run's ~10 epochs: the same ratio of parameters to tokens and of tokens seen to tokens held.
SMALL=(--variant rope --n-layer 4 --n-head 4 --d-model 128 --context-length 256 --batch-size 16 --lr 2e-3
  --min-lr 2e-4 --warmup-steps 20 --max-steps 640 --eval-interval 40 --save-interval 80 --amp bf16
  --no-final-eval --tokenizer "$RUNS/tok8k.json" --data "$RUNS/wt2-10pct")
declare -A REGULARISATION=(
  [small-dropout0]="--dropout 0.0 --weight-decay 0.1"
  [small-dropout0.1]="--dropout 0.1 --weight-decay 0.1"
  [small-dropout0.2]="--dropout 0.2 --weight-decay 0.1"
  [small-dropout0.1-wd0.3]="--dropout 0.1 --weight-decay 0.3"
)
if [ ! -f "$RUNS/wt2-10pct/train.txt" ]; then
  mkdir -p "$RUNS/wt2-10pct"
  $PY - "$RUNS/wt2-10pct" <<'PYTHON'
import sys
from pathlib import Path
from training import SHARED_DATA
src, out = SHARED_DATA / "wikitext-2-raw", Path(sys.argv[1])
lines = (src / "train.txt").read_text().splitlines(keepends=True)
cut = len(lines) // 10
while not (lines[cut].startswith(" = ") and not lines[cut].startswith(" = = ")):  # an article starts here
    cut += 1
(out / "train.txt").write_text("".join(lines[:cut]))
for split in ("valid", "test"):
    (out / f"{split}.txt").write_text((src / f"{split}.txt").read_text())
PYTHON
fi

launch() {  # NAME STEPS ARGS...: start a pilot unless its log already reaches STEPS
  local name=$1 steps=$2
  shift 2
  grep -q "\"step\": $steps," "$RUNS/$name/train_log.jsonl" 2>/dev/null && return
  OMP_NUM_THREADS=1 $PY -m training gpt --out "$RUNS/$name" "$@" > "$RUNS/$name.log" 2>&1 &
}
# shellcheck disable=SC2086
for name in "${!PILOTS[@]}"; do launch "$name" 200 "${BASE[@]}" ${PILOTS[$name]}; done
# shellcheck disable=SC2086
for name in "${!REGULARISATION[@]}"; do launch "$name" 640 "${SMALL[@]}" ${REGULARISATION[$name]}; done
wait
