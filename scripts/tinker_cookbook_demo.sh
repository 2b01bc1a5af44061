#!/usr/bin/env bash
# tinker-cookbook's own recipes, unchanged, against rlexp's Tinker server (python -m rlexp.tinker),
# on a CPU: SFT with recipes/sl_loop.py, then RL with recipes/rl_loop.py from the SFT'd weights.
#
#   scripts/tinker_cookbook_demo.sh OUT_DIR        (from a checkout with .venv and .venv-tinker: make envs)
#
# 1. OUT/hf: an offline hub cache (scripts/tinker_hub_cache.py --format rl_loop): HuggingFaceH4/no_robots
#    whose conversations are exactly rl_loop's prompt (its strawberry exchange, then "What is 2 + 1?"
#    with its suffix) answered "\boxed{3}", openai/gsm8k with the same problems ("#### 3"), and the
#    tiny model's character tokenizer as the model repo Qwen/Qwen3-4B-Instruct-2507.
#    That name is an alias: the cookbook picks its renderer from model_name and knows no rlexp/...
#    model; for this name it picks qwen3_instruct (ChatML), which renders the tiny tokenizer's own
#    template token for token. The server still serves rlexp's tiny model (tinker.base_model only
#    names it).
# 2. a server on the tiny model (conf/model/tiny.yaml); sl_loop on no_robots; the server stops.
# 3. OUT/sft_model: sl_loop's final sampler weights (the server keeps them, LoRA merged, under
#    <state_dir>/runs/<model id>/sampler_weights/final/) with the served base's config and tokenizer.
# 4. a server on OUT/sft_model (model=local); rl_loop on gsm8k; the server stops.
# 5. the SL loss (train_mean_nll) and the RL reward (reward/total) per step, from the recipes' own
#    OUT/sl/metrics.jsonl and OUT/rl/metrics.jsonl.
#
# The recipes' options below are their chz Config fields; the environment overrides the sizes
# (SL_STEPS, SL_BATCH, SL_LR, RL_STEPS, RL_BATCH, GROUP, MAX_TOKENS, RL_LR, LORA_RANK, MAX_OPERAND).
# Two of them depart from the recipes' defaults on purpose:
# - sl_loop train_on_what=last_assistant_message: the loss on the final "\boxed{N}" reply only. With
#   the default (all assistant messages) the 190-character strawberry reply outweighs it and the 2-layer
#   model learns neither within minutes (it cannot tell the two assistant turns apart).
# - rl_loop loss_fn=importance_sampling: its default stable_reinforce is Tinker's own, unpublished
#   loss; rlexp answers 400 naming it.
set -euo pipefail

OUT=${1:?usage: $0 OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
TPY=$ROOT/.venv-tinker/bin/python
MODEL_NAME=Qwen/Qwen3-4B-Instruct-2507
SL_STEPS=${SL_STEPS:-200} SL_BATCH=${SL_BATCH:-16} SL_LR=${SL_LR:-1e-2}
RL_STEPS=${RL_STEPS:-30} RL_BATCH=${RL_BATCH:-16} GROUP=${GROUP:-8} MAX_TOKENS=${MAX_TOKENS:-16}
RL_LR=${RL_LR:-2e-4} LORA_RANK=${LORA_RANK:-32} MAX_OPERAND=${MAX_OPERAND:-3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for d in sl rl sft_model sl_server rl_server hf; do
  [[ -e $OUT/$d ]] && { echo "demo: $OUT/$d exists (the recipes would resume from it): use a fresh OUT_DIR" >&2; exit 2; }
done
export HF_HOME=$OUT/hf HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_API_KEY=tml-local TINKER_TELEMETRY=0

SERVER_PID=
stop_server() {
  if [[ -n $SERVER_PID ]]; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}
trap stop_server EXIT

start_server() {  # start_server DIR [overrides...]: sets SERVER_PID and URL
  local dir=$1; shift
  mkdir -p "$dir"
  "$PY" -m rlexp.tinker tinker.port=0 tinker.state_dir="$dir/state" \
    logger.tracking_uri="sqlite:///$dir/mlflow.db" logger.artifact_location="$dir/art" \
    hydra.run.dir="$dir/hydra" tinker.base_model=$MODEL_NAME "$@" >"$dir/stdout.log" 2>"$dir/server.log" &
  SERVER_PID=$!
  URL=
  for _ in $(seq 600); do
    URL=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$dir/stdout.log" | head -1 || true)
    [[ -n $URL ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -30 "$dir/server.log" >&2; exit 1; }
    sleep 1
  done
  [[ -n $URL ]] || { echo "demo: the server did not start; $dir/server.log" >&2; exit 1; }
  echo "demo: server on $URL ($*)"
}

echo "demo: 1. hub cache"
"$PY" -c "from rlexp.models.tiny import build_char_tokenizer; build_char_tokenizer().save_pretrained('$OUT/tokenizer')"
"$PY" "$ROOT/scripts/tinker_hub_cache.py" "$OUT/hf" --tokenizer "$OUT/tokenizer" --model-id $MODEL_NAME \
  --format rl_loop --ops + --max-operand "$MAX_OPERAND" --with-replacement \
  --train-rows $((SL_BATCH * SL_STEPS)) --test-rows 64

echo "demo: 2. sl_loop"
start_server "$OUT/sl_server"   # the tiny model (conf/model/tiny.yaml)
SL_CMD=("$TPY" -m tinker_cookbook.recipes.sl_loop base_url="$URL" model_name=$MODEL_NAME log_path="$OUT/sl"
        batch_size="$SL_BATCH" learning_rate="$SL_LR" lora_rank="$LORA_RANK" save_every=0
        train_on_what=last_assistant_message)
echo "demo: ${SL_CMD[*]}"
t0=$(date +%s.%N)
"${SL_CMD[@]}" >"$OUT/sl.log" 2>&1 || { tail -40 "$OUT/sl.log" >&2; exit 1; }
SL_WALL=$(echo "$(date +%s.%N) - $t0" | bc)
stop_server

echo "demo: 3. export sl_loop's final sampler weights"
SAMPLER=$("$PY" -c "
import json, sys
rows = [json.loads(l) for l in open('$OUT/sl/checkpoints.jsonl')]
print([r for r in rows if r['name'] == 'final'][-1]['sampler_path'])")
MODEL_ID=${SAMPLER#tinker://}; MODEL_ID=${MODEL_ID%%/*}
WEIGHTS=$OUT/sl_server/state/runs/$MODEL_ID/sampler_weights/final
mkdir -p "$OUT/sft_model"
cp "$WEIGHTS/model.safetensors" "$OUT/sft_model/"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  [[ -f $OUT/sl_server/state/base/$f ]] && cp "$OUT/sl_server/state/base/$f" "$OUT/sft_model/"
done
echo "demo: $SAMPLER -> $OUT/sft_model"

echo "demo: 4. rl_loop"
start_server "$OUT/rl_server" model=local model.path="$OUT/sft_model" rollout.max_model_len=512
RL_CMD=("$TPY" -m tinker_cookbook.recipes.rl_loop base_url="$URL" model_name=$MODEL_NAME log_path="$OUT/rl"
        batch_size="$RL_BATCH" group_size="$GROUP" max_tokens="$MAX_TOKENS" learning_rate="$RL_LR"
        lora_rank="$LORA_RANK" max_steps="$RL_STEPS" save_every=0 loss_fn=importance_sampling)
echo "demo: ${RL_CMD[*]}"
t0=$(date +%s.%N)
"${RL_CMD[@]}" >"$OUT/rl.log" 2>&1 || { tail -40 "$OUT/rl.log" >&2; exit 1; }
RL_WALL=$(echo "$(date +%s.%N) - $t0" | bc)
stop_server

echo "demo: 5. results"
"$PY" - "$OUT" "$SL_WALL" "$RL_WALL" <<'EOF'
import json, sys
out, sl_wall, rl_wall = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
sl = [json.loads(l) for l in open(f"{out}/sl/metrics.jsonl")]
rl = [json.loads(l) for l in open(f"{out}/rl/metrics.jsonl")]
sl = [r for r in sl if "train_mean_nll" in r]
rl = [r for r in rl if "reward/total" in r]
print("SL step  train_mean_nll")
for r in sl:
    print(f"{r['step']:7d}  {r['train_mean_nll']:.4f}")
print("RL step  reward/total")
for r in rl:
    print(f"{r['step']:7d}  {r['reward/total']:.4f}")
mean = lambda xs: sum(xs) / len(xs)
rewards = [r["reward/total"] for r in rl]
print(f"SL: train_mean_nll {sl[0]['train_mean_nll']:.4f} (step {sl[0]['step']}) -> {sl[-1]['train_mean_nll']:.4f} "
      f"(step {sl[-1]['step']}); wall {sl_wall:.0f}s")
print(f"RL: reward/total first 5 steps {mean(rewards[:5]):.4f} -> last 5 steps {mean(rewards[-5:]):.4f}; "
      f"wall {rl_wall:.0f}s")
EOF
