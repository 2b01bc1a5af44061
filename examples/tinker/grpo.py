"""GRPO written as a Tinker user writes it: the official `tinker` SDK against `rlexp tinker`,
the algorithm in the client. It is rlexp's default GRPO experiment step for step, so that the
two callers can be compared (scripts/tinker_two_callers.py, docs/tinker.md):

    .venv-tinker/bin/python examples/tinker/grpo.py URL BASE_MODEL TASK OUT [--rank 8] [--lr 2e-3] [--seed 0]

TASK: a JSONL file, one line per step, `{"groups": [{"prompt": [token ids], "answer": "19",
"seed": 123}, ...], "group_size": 8, "max_tokens": 8, "temperature": 1.0}` (what the Hydra run
samples at that step: the prompts, answers and engine seeds its DataManager and agent draw,
the same problems in the same order, and its rollout settings). OUT: a JSONL file, one line
per step, `{"step": 1, "reward_mean": 0.1, "tokens": 512, "replies": [[token ids], ...]}` (the
replies in the task's order, each group's samples together).

Each step, as rlexp's sync loop with `advantage=grpo policy_loss=ppo_clip aggregation=token_mean`:
1. the current weights as a sampler (`save_weights_and_get_sampling_client`);
2. `group_size` samples per prompt, seeds seed, seed+1, ... (the engine seeds of rlexp's samples),
   stopped at the end-of-turn token;
3. reward 1 if the reply's answer equals the reference (rlexp.judges.math_exact's
   `extract_answer`, imported from the checkout: one judge for both callers);
4. GRPO advantages, A_i = (r_i - mean_g) / (std_g + 1e-6), std over the group (population),
   Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300);
5. `forward_backward` with `importance_sampling`, whose per-token loss is -exp(logp - q) A: on
   the first and only minibatch of an on-policy step its gradient is PPO-clip's (the ratio is
   1, no clip is active). Each token's advantage is divided by the step's response tokens, so
   the summed loss is rlexp's token mean;
6. `optim_step`: AdamW with torch's defaults (betas 0.9/0.999, eps 1e-8, no weight decay) and
   the gradient clipped to norm 1, as rlexp's trainer (trainer.max_grad_norm)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: its judge
from rlexp.judges.math_exact import extract_answer, normalize  # noqa: E402

EPS = 1e-6


def advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-normalised rewards (population std)."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + EPS) for r in rewards]


def reward(tokenizer, tokens: list[int], answer: str) -> float:
    predicted = extract_answer(tokenizer.decode(tokens, skip_special_tokens=True))
    return float(predicted is not None and predicted == normalize(answer))


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """One sample for `importance_sampling`: every position predicts the next token; the
    prompt's positions carry no advantage."""
    seq = prompt + tokens
    n_prompt = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:],
                                       "logprobs": [0.0] * n_prompt + list(logprobs),
                                       "advantages": [0.0] * n_prompt + [advantage] * len(tokens)})


def step(training, tokenizer, task: dict, lr: float) -> dict:
    sampler = training.save_weights_and_get_sampling_client()
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def params(seed: int) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=task["max_tokens"], temperature=task["temperature"], seed=seed,
                                    stop=stop)

    groups = task["groups"]
    futures = [sampler.sample(types.ModelInput.from_ints(g["prompt"]), num_samples=task["group_size"],
                              sampling_params=params(g["seed"])) for g in groups]
    rows, rewards = [], []
    for g, future in zip(groups, futures):
        seqs = future.result().sequences
        r = [reward(tokenizer, s.tokens, g["answer"]) for s in seqs]
        rewards += r
        rows += [(g["prompt"], s, a) for s, a in zip(seqs, advantages(r))]
    tokens = sum(len(s.tokens) for _, s, _ in rows)
    datums = [datum(p, s.tokens, s.logprobs, a / tokens) for p, s, a in rows]
    training.forward_backward(datums, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                         grad_clip_norm=1.0)).result()
    return {"reward_mean": sum(rewards) / len(rewards), "tokens": tokens,
            "replies": [s.tokens for _, s, _ in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("url", "base_model", "task", "out"):
        parser.add_argument(name)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    service = tinker.ServiceClient(base_url=args.url)
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed,
                                                   train_unembed=False)
    tokenizer = training.get_tokenizer()
    with open(args.out, "w") as out:
        for i, line in enumerate(Path(args.task).read_text().splitlines(), start=1):
            figures = step(training, tokenizer, json.loads(line), args.lr)
            out.write(json.dumps({"step": i} | figures) + "\n")
            out.flush()
            print(f"step {i}: reward {figures['reward_mean']:.3f}", flush=True)
    service.close("success").result()  # the model's MLflow run ends FINISHED


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    import os

    os._exit(0)  # the SDK's event loop is a daemon thread: skip the interpreter's teardown beside it
