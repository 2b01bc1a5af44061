"""examples/tinker/grpo.py, a Tinker user's GRPO, is rlexp's default GRPO step: its group
advantages are rlexp's GroupNormalized on hand-computed values, its datums lay each sample out
as the server's `importance_sampling` reads them, and that loss on advantages divided by the
step's tokens has the gradient of rlexp's PPO-clip with a token mean on an on-policy step.
Run against `rlexp tinker` beside the Hydra run of the same experiment
(scripts/tinker_two_callers.py), it samples the Hydra run's replies, token for token, at its
first steps: same model, prompts and seeds, and after an update the same weights. (The reward
curves of both, 3 seeds each: docs/tinker.md.)"""

import importlib.util
import json
import math
import subprocess

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch.testing import assert_close

from rlexp.algorithms.advantages import GroupNormalized
from rlexp.algorithms.objective import PPOClip, TokenInputs, TokenMean, TokenSum, Totals
from rlexp.algorithms.unclipped import ImportanceSampling
from tests.algorithm_helpers import adv_inputs
from tests.test_run import _traces
from tests.tinker_helpers import BASE_MODEL, ROOT, TINKER_PYTHON, TINY, Server, require_sdk

SEED, STEPS, RANK, LR = 3, 2, 4, 2e-3
# the suite's tiny model (TINY, a short warm start on sums of 0..29) on its own sums: right
# on a few samples, wrong on most, so groups of 8 have a signal and step 1 updates the weights
SMALL = ("data.prompts_per_step=16", "data.samples_per_prompt=8", "data.source.max_operand=29")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    require_sdk()
    s = Server(tmp_path_factory.mktemp("tinker"), f"rollout.max_lora_rank={RANK}").start()
    yield s
    s.stop()


def _two_callers():
    spec = importlib.util.spec_from_file_location("two_callers", ROOT / "scripts" / "tinker_two_callers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tinker_script_samples_the_hydra_runs_replies(server, tmp_path, run_models):
    """Step 1: one model, one engine kind, the same prompts and engine seeds; step 2: after each
    caller's update (rlexp's fit; the script's forward_backward and optim_step), the LoRA
    weights the Hydra run merged into its engine and the adapter the server serves sample the
    same replies: the same update, whichever loop called it."""
    two = _two_callers()
    overrides = two.hydra_overrides(SEED, STEPS, RANK, LR, *TINY, f"model.cache_dir={run_models}", *SMALL)
    two.run_hydra(tmp_path, overrides, SEED)
    two.write_task(overrides, STEPS, tmp_path / "task.jsonl")
    tinker = two.run_tinker(server.url, BASE_MODEL, tmp_path / "task.jsonl", tmp_path, SEED, RANK, LR)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(two.EXPERIMENT).experiment_id])
    tasks = [json.loads(line) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    for step, (task, reported) in enumerate(zip(tasks, tinker), start=1):
        prompts = [g["prompt"] for g in task["groups"] for _ in range(task["group_size"])]
        traces = sorted(_traces(client, run, step), key=lambda r: r["uid"])
        hydra = [r["token_ids"][len(p):] for r, p in zip(traces, prompts)]
        assert [r["token_ids"][:len(p)] for r, p in zip(traces, prompts)] == prompts, step
        assert reported["replies"] == hydra, step
    assert [r["reward_mean"] for r in tinker] == two.hydra_rewards(tmp_path)[SEED]
    first = [r["reward"] for r in sorted(_traces(client, run, 1), key=lambda r: r["uid"])]
    groups = [first[i:i + tasks[0]["group_size"]] for i in range(0, len(first), tasks[0]["group_size"])]
    assert any(len(set(g)) > 1 for g in groups), groups  # step 1 updated the weights step 2 sampled

PROBE = """
import json, sys
sys.path.insert(0, "examples/tinker")
import grpo
d = grpo.datum([1, 2, 3], [7, 8], [-0.5, -0.25], 0.5)
print(json.dumps({"adv": grpo.advantages([1.0, 0.0, 0.0, 0.0]), "tied": grpo.advantages([1.0, 1.0]),
                  "input": d.model_input.to_ints(),
                  "fields": {k: v.tolist() for k, v in d.loss_fn_inputs.items()}}))
"""


def test_the_scripts_advantages_and_datums():
    require_sdk()
    out = subprocess.run([str(TINKER_PYTHON), "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, env={"TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # rewards 1, 0, 0, 0: mean 1/4, population std sqrt(3)/4, so sqrt(3) and -1/sqrt(3) (eps 1e-6 aside)
    assert_close(torch.tensor(got["adv"]), torch.tensor([math.sqrt(3)] + [-1 / math.sqrt(3)] * 3),
                 rtol=1e-5, atol=0)
    rlexp = GroupNormalized()(adv_inputs([1, 0, 0, 0]))[:, 0]
    assert_close(torch.tensor(got["adv"], dtype=torch.float32), rlexp, rtol=1e-6, atol=1e-6)
    assert got["tied"] == [0.0, 0.0]  # no signal in a group of equal rewards, as GroupNormalized
    # prompt 1 2 3, reply 7 8: each position predicts the next; the prompt's two carry nothing
    assert got["input"] == [1, 2, 3, 7]
    assert got["fields"] == {"target_tokens": [2, 3, 7, 8], "logprobs": [0.0, 0.0, -0.5, -0.25],
                             "advantages": [0.0, 0.0, 0.5, 0.5]}


def test_importance_sampling_over_the_steps_tokens_is_ppo_clip_with_a_token_mean_on_policy():
    """The sampler's logprobs q differ from the trainer's by numerical noise on an on-policy
    step (drawn here up to 0.05 in log-ratio): inside PPO's clip both losses are -A r per
    token, so the sum of -r A/N (Tinker's, N the step's trained tokens) and the mean of rlexp's
    PPO-clip have one gradient."""
    torch.manual_seed(0)
    mask = (torch.rand(6, 9) > 0.3).float()
    adv = torch.randn(6, 1).expand(6, 9).contiguous()
    q = -torch.rand(6, 9) * 3
    logp = (q + (torch.rand(6, 9) - 0.5) * 0.1).requires_grad_()
    n = mask.sum()

    def grad(loss_fn, advantages, aggregation, totals):
        logp.grad = None
        loss, _ = loss_fn(TokenInputs(logp, q, q, advantages, mask))
        aggregation(loss, mask, totals).backward()
        return logp.grad.clone()

    ppo = grad(PPOClip(0.2, 0.2), adv, TokenMean(), Totals(tokens=n, seqs=6.0))
    tinker = grad(ImportanceSampling(), adv / n, TokenSum(), Totals(tokens=n, seqs=6.0))
    assert_close(tinker, ppo, rtol=1e-6, atol=1e-9)
    assert ppo.abs().sum() > 0 and torch.equal(ppo[mask == 0], torch.zeros_like(ppo[mask == 0]))
