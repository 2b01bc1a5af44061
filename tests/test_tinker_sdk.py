"""The Tinker API server (`python -m rlexp.tinker`) driven by the official `tinker` SDK 0.38 in
its own venv: its calls are rlexp's own update (the same weights as `fit`), sampling on the
vLLM engine, checkpoints, an MLflow run per model, and a restart from the last save_state."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from rlexp.tinker.models import LORA_PARTS
from rlexp.trainer import update
from rlexp.trainer.batch import TrainBatch, trained
from rlexp.trainer.models import adapter_weights
from tests.dist_fit import make_batch
from tests.tinker_helpers import BASE_MODEL, TINY, Server, require_sdk, sdk

LR, SEED, STEPS = 5e-4, 7, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    require_sdk()
    # Two adapters kept loaded at most: three tenants sampled in turn evict one another
    s = Server(tmp_path_factory.mktemp("tinker"), "trainer.sync_check.bound=off", "rollout.max_loras=2",
               "rollout.max_cpu_loras=2").start()
    yield s
    s.stop()


def fit_and_datums(base_dir: str):
    """rlexp's own fit of a GRPO batch (LoRA rank 4, seed 7) and the same update as Tinker
    datums: ppo's thresholds 0.8/1.2 = PPO-clip 0.2/0.2, the advantages 0 off the trained tokens
    (Tinker's losses sum over every position) and divided by the batch's trained tokens
    (token_mean), the rollout logprobs as the sampler's."""
    with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
        cfg = compose("tinker", overrides=["trainer.sync_check.bound=off", *TINY])
    torch.manual_seed(SEED)  # as the server initialises a model's adapters
    lora = {"rank": 4, "alpha": cfg.trainer.lora.alpha, "target_modules": sum(LORA_PARTS.values(), [])}
    trainer = instantiate(cfg.trainer, model_path=base_dir, lora=lora)
    samples = make_batch(3, groups=3, per_group=4)
    batch = TrainBatch.build(trained(samples), 0, trainer.learner.layout)
    signals = update.advantages(trainer.learner, batch, batch.rollout_logprobs, None, None)
    n_tokens = batch.minibatches[0].totals.tokens
    advantages = signals.advantages.cpu() * batch.loss_mask
    datums = []
    for i, s in enumerate(trained(samples)):
        n = len(s.tokens) - 1
        datums.append({"tokens": s.tokens[:-1], "targets": s.tokens[1:], "logprobs": s.logprobs[1:],
                       "advantages": (advantages[i, :n] / n_tokens).tolist()})
    before = {k: v.clone() for k, v in adapter_weights(trainer.model)}
    for version in range(STEPS):  # the second step's ratios are off 1, and Adam has history
        trainer.fit(samples, version)
    return {k: v.detach().cpu() for k, v in adapter_weights(trainer.model)}, before, datums


EQUAL_FIT = """
data = json.load(open(ARGS[0]))
tc = service.create_lora_training_client(base_model=ARGS[1], rank=4, seed=7)
datums = [types.Datum(model_input=types.ModelInput.from_ints(d["tokens"]),
                      loss_fn_inputs={"target_tokens": d["targets"], "logprobs": d["logprobs"],
                                      "advantages": d["advantages"]}) for d in data]
for _ in range(int(ARGS[3])):
    fb = tc.forward_backward(datums, "ppo")
    step = tc.optim_step(types.AdamParams(learning_rate=float(ARGS[2]), beta1=0.9, beta2=0.999, eps=1e-8,
                                          weight_decay=0.0, grad_clip_norm=1.0))
    out, metrics = fb.result(), step.result().metrics
path = tc.save_state("equal").result().path
print(json.dumps({"model_id": tc.model_id, "path": path, "loss": out.metrics["loss:sum"], "step": metrics,
                  "logprobs": [o["logprobs"].tolist() for o in out.loss_fn_outputs]}))
"""


def test_forward_backward_and_optim_step_through_the_sdk_give_rlexps_fit_weights(server):
    weights, before, datums = fit_and_datums(str(server.state / "base"))
    (server.root / "batch.json").write_text(json.dumps(datums))
    out = sdk(server, EQUAL_FIT, str(server.root / "batch.json"), BASE_MODEL, str(LR), str(STEPS))
    run_dir = server.state / "runs" / out["model_id"]
    saved = load_file(str(run_dir / "weights" / "equal" / "adapter.safetensors"))
    assert set(saved) == set(weights)
    moved = max((weights[k] - before[k]).abs().max().item() for k in weights)
    assert moved > 1e-4  # the step moved the adapters, so equality below says something
    diff = max((saved[k] - weights[k]).abs().max().item() for k in weights)
    assert diff <= 1e-6, f"the SDK's update differs from rlexp's fit by {diff}"
    assert out["step"]["grad_norm:mean"] > 0 and len(out["logprobs"]) == len(datums)
    assert all(len(lp) == len(d["tokens"]) for lp, d in zip(out["logprobs"], datums))


def test_each_model_is_an_mlflow_run_with_its_calls_and_checkpoints(server):
    client = MlflowClient(server.tracking_uri)
    exp = client.get_experiment_by_name("rlexp-tinker")
    runs = client.search_runs([exp.experiment_id], "tags.`rlexp.tinker.model_id` != ''")
    assert runs, "no MLflow run for the Tinker models"
    run = next(r for r in runs if "tinker/forward_backward/loss" in r.data.metrics)
    assert run.data.params["tinker.lora.rank"] == "4" and run.data.params["tinker.base_model"] == BASE_MODEL
    for key in ("tinker/forward_backward/tokens", "tinker/forward_backward/seconds",
                "tinker/optim_step/grad_norm", "tinker/optim_step/learning_rate"):
        assert key in run.data.metrics, key
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/equal")]
    assert "checkpoints/equal/adapter.safetensors" in artifacts
    mlflow.set_tracking_uri(None)


SAMPLE = """
tc = service.create_lora_training_client(base_model=ARGS[0], rank=2, seed=1)
prompt = list(range(10, 30))
d = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * (len(prompt) - 1)})
trained = []
for _ in range(2):
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
forward = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
sampler = tc.save_weights_and_get_sampling_client()
scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0, stop=[int(ARGS[1])])
a = sampler.sample(types.ModelInput.from_ints(prompt[:5]), num_samples=4, sampling_params=params).result()
b = sampler.sample(types.ModelInput.from_ints(prompt[:5]), num_samples=4, sampling_params=params).result()
top = sampler.sample(types.ModelInput.from_ints(prompt[:5]), num_samples=1, sampling_params=params,
                     include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
print(json.dumps({"forward": forward, "scored": scored,
                  "a": [(s.tokens, s.logprobs, s.stop_reason) for s in a.sequences],
                  "b": [s.tokens for s in b.sequences], "ids": [s.sequence_id for s in a.sequences],
                  "top": [[list(c) for c in row] if row else None for row in top.topk_prompt_logprobs],
                  "prompt": top.prompt_logprobs}))
"""


def test_sampling_serves_the_trained_weights_with_logprobs(server):
    stop = 2  # <|im_end|>, the tiny tokenizer's end of a turn
    out = sdk(server, SAMPLE, BASE_MODEL, str(stop))
    # the engine's prompt logprobs of the trained weights are the trainer's forward (float32)
    assert out["scored"][0] is None
    assert max(abs(a - b) for a, b in zip(out["scored"][1:], out["forward"])) < 1e-4
    assert [s[0] for s in out["a"]] == out["b"]  # seeded: the same tokens again
    assert len(set(out["ids"])) == 4
    for tokens, logprobs, reason in out["a"]:
        assert len(tokens) == len(logprobs) and all(lp <= 0 for lp in logprobs)
        assert (reason == "stop") == (tokens[-1] == stop) and (reason == "length") == (len(tokens) == 6)
    assert out["top"][0] is None and all(len(row) == 3 for row in out["top"][1:])
    assert all(row[0][1] >= row[1][1] >= row[2][1] for row in out["top"][1:])
    assert out["prompt"][1:] == pytest.approx(out["scored"][1:5], abs=1e-5)


BAD = """
tc = service.create_lora_training_client(base_model=ARGS[0], rank=2)
good = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                   loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
cases = {
    "stable_reinforce": ([good], "stable_reinforce"),
    "lengths": ([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                             loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})],
                "cross_entropy"),
    "vocab": ([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 100000]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})],
              "cross_entropy"),
    "missing": ([types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                             loss_fn_inputs={"target_tokens": [6, 7, 8], "advantages": [0.0, 1.0, 1.0]})],
                "ppo"),
    "unknown": ([good], "not_a_loss"),
}
seen = {}
for name, (data, loss) in cases.items():
    try:
        tc.forward_backward(data, loss).result()
        seen[name] = "accepted"
    except Exception as e:
        seen[name] = f"{type(e).__name__}: {e}"
after = tc.forward_backward([good], "cross_entropy").result().metrics["loss:sum"]
print(json.dumps({"seen": seen, "after": after}))
"""


def test_bad_datums_are_refused_naming_the_field_and_the_model_still_trains(server):
    out = sdk(server, BAD, BASE_MODEL)
    seen = out["seen"]
    assert "stable_reinforce" in seen["stable_reinforce"] and "not served" in seen["stable_reinforce"]
    assert "data[0].loss_fn_inputs.target_tokens" in seen["lengths"]
    assert "data[0].model_input" in seen["vocab"] and "vocabulary" in seen["vocab"]
    assert "data[0].loss_fn_inputs.logprobs is missing" in seen["missing"]
    assert "unknown loss_fn 'not_a_loss'" in seen["unknown"] or "not_a_loss" in seen["unknown"]
    assert out["after"] > 0


TOKENIZER = """
import httpx
tc = service.create_lora_training_client(base_model=ARGS[0], rank=4)
tokenizer = tc.get_tokenizer()  # no model hub here (HF_HUB_OFFLINE=1): the id names a directory
raw = httpx.post(URL.rstrip("/") + "/api/v1/get_info", json={"model_id": tc.model_id},
                 headers={"X-API-Key": "tml-local"}).json()
print(json.dumps({"ids": tokenizer.encode("12+3="), "entries": len(tokenizer),
                  "tokenizer_id": tc.get_info().model_data.tokenizer_id, "model_data": raw["model_data"]}))
"""


def test_get_tokenizer_works_offline_and_the_vocabulary_size_is_reported(server):
    from transformers import AutoTokenizer

    out = sdk(server, TOKENIZER, BASE_MODEL)
    served = AutoTokenizer.from_pretrained(server.state / "base")
    assert out["ids"] == served.encode("12+3=") and out["entries"] == len(served)
    assert out["tokenizer_id"] == str((server.state / "base").resolve())
    rows = json.loads((server.state / "base" / "config.json").read_text())["vocab_size"]
    assert out["model_data"]["vocab_size"] == rows > len(served)  # the model's rows, not the tokenizer's


TENANTS = """
from concurrent.futures import ThreadPoolExecutor
PREFIX, N = [10, 11, 12], int(ARGS[1])

def train(i):  # tenant i learns that PREFIX goes on with its own tokens; attention + MLP: an adapter
    tc = service.create_lora_training_client(base_model=ARGS[0], rank=4, seed=i, train_unembed=False)
    seq = PREFIX + [40 + 7 * i + k for k in range(6)]
    d = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * 2 + [1.0] * 6})
    for _ in range(8):
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return tc.save_weights_and_get_sampling_client(), tc.model_id

def ask(sampler):  # futures: sampled while the others' are
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    seeded = types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    return (sampler.sample(types.ModelInput.from_ints(PREFIX), 1, greedy),
            sampler.sample(types.ModelInput.from_ints(PREFIX), 3, seeded),
            sampler.compute_logprobs(types.ModelInput.from_ints(PREFIX + [40, 41, 42])))

def answers(futures):
    greedy, seeded, scored = (f.result() for f in futures)
    return {"greedy": greedy.sequences[0].tokens, "seeded": [s.tokens for s in seeded.sequences],
            "logprobs": [s.logprobs for s in seeded.sequences], "scored": scored[1:]}

alone = train(0)  # trained and sampled with no other tenant
alone_out = answers(ask(alone[0]))
with ThreadPoolExecutor(N) as pool:  # N tenants trained at once, tenant 0 as above
    tenants = list(pool.map(train, range(N)))
together = [[answers(ask(t[0])) for t in tenants]]  # in turn: each evicts the least recent
asked = [ask(t[0]) for t in tenants for _ in range(2)]  # all at once, each twice
together.append([answers(asked[2 * i]) for i in range(N)])
print(json.dumps({"alone": alone_out, "together": together, "models": [t[1] for t in tenants]}))
"""


def test_lora_tenants_share_the_engine_each_as_if_alone_and_evicted_adapters_come_back(server):
    """Three LoRA models (attention + MLP: adapters on the engine's one base) trained at once,
    then sampled in turn and all at once on an engine keeping two adapters: each answers what
    the same model trained and sampled alone answers; each learned tokens of its own, so a
    request served by another tenant's adapter (or the base) would show."""
    n = 3
    out = sdk(server, TENANTS, BASE_MODEL, str(n))
    own = [{40 + 7 * i + k for k in range(6)} for i in range(n)]  # disjoint
    for round_ in out["together"]:
        assert all(t["greedy"] and set(t["greedy"]) <= own[i] for i, t in enumerate(round_)), round_
        first = round_[0]
        assert first["greedy"] == out["alone"]["greedy"] and first["seeded"] == out["alone"]["seeded"]
        # the same weights in another batch of the engine: equal to float32 rounding
        assert sum(first["logprobs"], []) == pytest.approx(sum(out["alone"]["logprobs"], []), abs=1e-4)
        assert first["scored"] == pytest.approx(out["alone"]["scored"], abs=1e-4)
    client = MlflowClient(server.tracking_uri)
    runs = [_run_of(client, m).info.run_id for m in out["models"]]
    loads = [len(client.get_metric_history(run, "sync/tokens")) for run in runs]
    assert min(loads) >= 2, f"a tenant's adapter was never loaded again after its eviction: {loads}"


def _run_of(client: MlflowClient, model_id: str):
    exp = client.get_experiment_by_name("rlexp-tinker")
    (run,) = client.search_runs([exp.experiment_id], f"tags.`rlexp.tinker.model_id` = '{model_id}'")
    return run
