"""The Tinker API server under bad input and faults: 1,000 malformed requests shaped like the
SDK's get a 4xx (never a 5xx) and leave it serving; two clients driving one model are told
so; a client that goes away mid-call loses nothing; a closed session frees its model; a killed
server restarts from its last save_state."""

from __future__ import annotations

import copy
import json
import random

import httpx
import numpy as np
import pytest

from rlexp.tinker import proto
from tests.tinker_helpers import BASE_MODEL, Server, require_sdk, sdk

V1 = "/api/v1"
FUZZ = 1000
POLLS = 60  # retrieve_future answers "not yet" after tinker.poll_s=5


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    require_sdk()
    # its tests leave their models open (clients gone without closing, within the session timeout)
    s = Server(tmp_path_factory.mktemp("tinker_faults"), "tinker.poll_s=5", "tinker.max_models=24").start()
    yield s
    s.stop()


def result(client: httpx.Client, request_id: str) -> tuple[int, dict | bytes]:
    """A future's answer once it is ready (the server answers 408 while it is pending)."""
    for _ in range(POLLS):
        r = client.post(f"{V1}/retrieve_future", json={"request_id": request_id}, timeout=60)
        if r.status_code != 408:
            return r.status_code, (r.content if "protobuf" in r.headers.get("content-type", "") else r.json())
    raise AssertionError(f"{request_id} never finished")


def new_model(client: httpx.Client) -> tuple[str, str]:
    created = client.post(f"{V1}/create_session", json={"tags": [], "sdk_version": "test"})
    session = created.json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
            "lora_config": {"rank": 2, "seed": 0}}
    r = client.post(f"{V1}/create_model", json=body).json()
    assert result(client, r["request_id"])[0] == 200
    return session, r["model_id"]


def fb_body(model_id: str, seq_id: int, tokens: list[int], loss: str = "cross_entropy",
            forward_only: bool = False, targets: list[int] | None = None, **inputs: list[float]) -> bytes:
    m = proto.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss,
                                     forward_only=forward_only)
    d = m.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    for key, values in {"target_tokens": targets or tokens[1:] + [3], **inputs}.items():
        t = d.loss_fn_inputs[key]
        integer = key == "target_tokens"
        t.dense, t.dtype = np.asarray(values, "<i8" if integer else "<f4").tobytes(), (
            proto.DTYPE_INT64 if integer else proto.DTYPE_FLOAT32)
        t.shape.append(len(values))
    return m.SerializeToString()


def post_fb(client: httpx.Client, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/x-protobuf"}
    return client.post(f"{V1}/forward_backward", content=body, headers=headers)


# ---- the fuzz ------------------------------------------------------------------------------------

JUNK = [None, "", "x", -1, 0, 10**12, 1.5, -1e308, float("nan"), True, [], [1, "a"], {}, {"a": {"b": []}}]


def json_cases(session: str, model: str, sampler: str) -> list[tuple[str, dict]]:
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    return [
        ("create_model", {"session_id": session, "model_seq_id": 50, "base_model": BASE_MODEL,
                          "lora_config": {"rank": 2, "train_mlp": True}}),
        ("optim_step", {"model_id": model,
                        "adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}),
        ("asample", {"sampling_session_id": sampler, "num_samples": 2, "prompt": prompt,
                     "sampling_params": {"max_tokens": 3, "temperature": 1.0, "stop": [2]},
                     "prompt_logprobs": True, "topk_prompt_logprobs": 2}),
        ("save_weights", {"model_id": model, "path": "fuzz"}),
        ("save_weights_for_sampler", {"model_id": model, "path": "fuzz"}),
        ("load_weights", {"session_id": session, "model_seq_id": 60, "path": f"tinker://{model}/weights/none",
                          "optimizer": True}),
        ("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 70,
                                     "base_model": BASE_MODEL}),
        ("get_info", {"model_id": model}),
        ("retrieve_future", {"request_id": "req-1"}),
        ("weights_info", {"tinker_path": f"tinker://{model}/weights/none"}),
        ("session_heartbeat", {"session_id": session}),
    ]


def mutate_json(g: random.Random, body: dict) -> bytes:
    body = copy.deepcopy(body)
    kind = g.randrange(6)
    if kind == 0:
        return g.choice([b"", b"{", b"[1,2]", b"null", b"\xff\xfe", b'{"a":' * 3000, b'"text"'])
    target, key = body, g.choice(list(body))
    while isinstance(target[key], dict) and target[key] and g.random() < 0.6:  # reach into nested objects
        target = target[key]
        key = g.choice(list(target))
    if kind == 1:
        del target[key]
    else:
        target[key] = g.choice(JUNK)
    return json.dumps(body, allow_nan=True).encode()


def mutate_fb(g: random.Random, model: str, vocab: int) -> bytes:
    tokens = [5, 6, 7, 8]
    case = g.randrange(12)
    if case == 0:
        return bytes(g.randrange(256) for _ in range(g.randrange(1, 200)))
    if case == 1:
        good = fb_body(model, 0, tokens, weights=[1.0] * 4)
        return good[:g.randrange(1, len(good))]
    cases = {
        2: dict(model_id="nobody:train:0"), 3: dict(loss="no_such_loss"), 4: dict(loss="stable_reinforce"),
        5: dict(weights=[1.0] * 3), 6: dict(targets=[5, 6, 7, vocab + g.randrange(1000)]),
        7: dict(weights=[1.0, float("nan"), 1.0, 1.0]), 8: dict(loss="ppo", weights=[1.0] * 4),
        9: dict(tokens=[]), 10: dict(tokens=[-5, 6, 7, 8]), 11: dict(loss="gspo", logprobs=[0.0] * 4),
    }[case]
    model_id, loss = cases.pop("model_id", model), cases.pop("loss", "cross_entropy")
    t, targets = cases.pop("tokens", tokens), cases.pop("targets", None)
    inputs = cases or {"weights": [1.0] * 4}
    seq = g.choice([0, 0, 0, 10**6])  # 0: unnumbered (run in arrival order); 10**6: far ahead, refused
    return fb_body(model_id, seq, t, loss, targets=targets, **inputs)


def test_a_thousand_malformed_requests_get_no_5xx_and_the_server_still_serves(server):
    g = random.Random(0)
    statuses: dict[int, int] = {}
    accepted: list[str] = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        session, model = new_model(client)
        sampler = client.post(f"{V1}/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}).json()[
            "sampling_session_id"]
        cases = json_cases(session, model, sampler)
        for i in range(FUZZ):
            if i % 3 == 0:
                r = post_fb(client, mutate_fb(g, model, 128))
            elif i % 11 == 5:
                r = client.request(g.choice(["GET", "DELETE"]), g.choice([
                    f"{V1}/training_runs/{g.random()}", f"{V1}/samplers/x{i}", f"{V1}/sessions/none",
                    f"{V1}/training_runs/{model}/checkpoints/weights/none",
                    f"{V1}/training_runs/{model}/checkpoints/a/b/c",
                    f"{V1}/training_runs?limit=abc", f"{V1}/nowhere"]))
            else:
                route, body = g.choice(cases)
                r = client.post(f"{V1}/{route}", content=mutate_json(g, body),
                                headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 200 and r.headers["content-type"].startswith("application/json"):
                accepted += [r.json()["request_id"]] if "request_id" in r.json() else []
        failed_by_server = [a for a in accepted if (out := result(client, a)[1]) and isinstance(out, dict)
                            and out.get("category") == "server"]
    print(f"fuzz: {FUZZ} requests, answers by status {dict(sorted(statuses.items()))}, "
          f"{len(accepted)} accepted calls")
    assert not [s for s in statuses if s >= 500], f"5xx answers: {statuses}"
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= 0.9 * FUZZ, statuses
    assert not failed_by_server, f"accepted calls that failed on the server's side: {failed_by_server}"
    out = sdk(server, FORWARD, BASE_MODEL)  # still serving the SDK
    assert out["loss"] > 0


FORWARD = """
tc = service.create_lora_training_client(base_model=ARGS[0], rank=2)
d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
print(json.dumps({"loss": tc.forward([d], "cross_entropy").result().metrics["loss:sum"]}))
"""


def logprobs_of(raw: bytes) -> np.ndarray:
    out = proto.ForwardBackwardOutput()
    out.ParseFromString(raw)
    return np.frombuffer(out.loss_fn_outputs[0].fields["logprobs"].data, "<f4")


def test_two_clients_on_one_model_and_a_client_that_goes_away(server):
    tokens, weights = [5, 6, 7, 8, 9], [1.0] * 5
    with httpx.Client(base_url=server.url, timeout=120) as client:
        _, model = new_model(client)
        first = post_fb(client, fb_body(model, 1, tokens, forward_only=True, weights=weights)).json()
        other = post_fb(client, fb_body(model, 1, [9, 8, 7], forward_only=True, weights=[1.0] * 3))
        assert other.status_code == 400 and other.json()["field"] == "seq_id"
        assert "two clients are driving one model" in other.json()["detail"]
        again = post_fb(client, fb_body(model, 1, tokens, forward_only=True, weights=weights)).json()
        assert again["request_id"] == first["request_id"]  # an SDK retry: the same call, run once
        before = logprobs_of(result(client, first["request_id"])[1])
        # a client submits an update and goes away without reading any result
        train = post_fb(client, fb_body(model, 2, tokens, weights=weights)).json()["request_id"]
        step = client.post(f"{V1}/optim_step", json={"model_id": model, "seq_id": 3, "adam_params": {
            "learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}}).json()["request_id"]
    with httpx.Client(base_url=server.url, timeout=120) as client:  # another connection, later
        after = post_fb(client, fb_body(model, 4, tokens, forward_only=True, weights=weights)).json()
        changed = logprobs_of(result(client, after["request_id"])[1])
        assert not np.allclose(before, changed)  # the update it left behind was applied
        assert result(client, step)[1]["metrics"]["grad_norm:mean"] > 0  # and its results kept
        assert result(client, train)[0] == 200


DELETED = """
unembed = ARGS[1] == "merged"  # merged: sampled as the whole model; else as an adapter
tc = service.create_lora_training_client(base_model=ARGS[0], rank=2, seed=0, train_unembed=unembed)
# each saved before the next (the first one's are deleted by the fourth save)
clients = [tc.save_weights_and_get_sampling_client().result() for _ in range(4)]
params = types.SamplingParams(max_tokens=2, seed=0)
try:
    clients[0].sample(types.ModelInput.from_ints([5, 6]), 1, params).result()
    first = "served"
except Exception as e:
    first = f"{type(e).__name__}: {e}"
last = len(clients[-1].sample(types.ModelInput.from_ints([5, 6]), 1, params).result().sequences)
print(json.dumps({"first": first, "last": last}))
"""


@pytest.mark.parametrize("kind", ["adapter", "merged"])
def test_a_sampler_whose_weights_were_deleted_is_told_so_and_the_newest_serves(server, kind):
    out = sdk(server, DELETED, BASE_MODEL, kind)
    assert "were deleted" in out["first"] and "save them again" in out["first"], out["first"]
    assert out["last"] == 1


TRAIN_AND_SAVE = """
tc = service.create_lora_training_client(base_model=ARGS[0], rank=2, seed=3)
d = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 20))),
                loss_fn_inputs={"target_tokens": list(range(6, 21)), "weights": [1.0] * 15})
for _ in range(2):
    tc.forward_backward([d], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
path = tc.save_state("before-kill").result().path
out = tc.forward([d], "cross_entropy").result()
print(json.dumps({"path": path, "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist()}))
"""
RESUME = """
tc = service.create_training_client_from_state_with_optimizer(ARGS[0]).result()
d = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 20))),
                loss_fn_inputs={"target_tokens": list(range(6, 21)), "weights": [1.0] * 15})
out = tc.forward([d], "cross_entropy").result()
tc.forward_backward([d], "cross_entropy")
step = tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
run = service.create_rest_client().get_training_run_by_tinker_path(ARGS[0]).result()
print(json.dumps({"logprobs": out.loss_fn_outputs[0]["logprobs"].tolist(), "step": step.metrics,
                  "run": run.training_run_id, "last": run.last_checkpoint.tinker_path}))
"""


def test_a_closed_session_releases_its_model_whose_saved_state_goes_on(server):
    """ServiceClient.close(): the session ends (its heartbeat a 410, the SDK's sign to stop), its
    model's trainer is freed and its MLflow run FINISHED, a call to it is a 410 naming the model,
    and its saved state loads into a new model, the weights exactly as saved."""
    from mlflow.tracking import MlflowClient

    saved = sdk(server, TRAIN_AND_SAVE + 'service.close("success").result()\n', BASE_MODEL)
    model_id = saved["path"].removeprefix("tinker://").split("/")[0]
    run_id = json.loads((server.state / "runs" / model_id / "meta.json").read_text())["mlflow_run_id"]
    assert MlflowClient(server.tracking_uri).get_run(run_id).info.status == "FINISHED"
    with httpx.Client(base_url=server.url, timeout=120) as client:
        beat = client.post(f"{V1}/session_heartbeat", json={"session_id": model_id.split(":train:")[0]})
        call = post_fb(client, fb_body(model_id, 9, [5, 6, 7], forward_only=True, weights=[1.0] * 3))
    assert beat.status_code == 410 and "was finished by its client (success)" in beat.json()["detail"]
    assert call.status_code == 410 and call.json()["field"] == "model_id"
    assert "released" in call.json()["detail"]
    assert sdk(server, RESUME, saved["path"])["logprobs"] == saved["logprobs"]


def test_a_killed_server_restarts_from_its_last_save_state(server):
    saved = sdk(server, TRAIN_AND_SAVE, BASE_MODEL)
    server.kill()
    server.start()  # the same state directory, a new process and port
    resumed = sdk(server, RESUME, saved["path"])
    assert resumed["logprobs"] == saved["logprobs"]  # the weights as saved, exactly
    assert resumed["step"]["grad_norm:mean"] > 0  # and it trains on (with the optimizer's state)
    assert saved["path"].startswith(f"tinker://{resumed['run']}/") and resumed["last"] == saved["path"]


def test_a_stopped_server_ends_its_models_runs_and_a_restarted_one_continues_them(server):
    """SIGTERM: every model's MLflow run KILLED (not left RUNNING), the process then dies of the
    signal; restarted, the model's saved state loaded (a new training client, as the SDK makes
    one), its run is the same one, RUNNING again, and its metrics go on from its last step."""
    from mlflow.tracking import MlflowClient

    saved = sdk(server, TRAIN_AND_SAVE, BASE_MODEL)
    model_id = saved["path"].removeprefix("tinker://").split("/")[0]
    run_id = json.loads((server.state / "runs" / model_id / "meta.json").read_text())["mlflow_run_id"]
    proc = server.proc
    server.stop()  # SIGTERM
    client = MlflowClient(server.tracking_uri)
    assert proc.returncode == -15  # died of the signal, after the cleanup
    assert client.get_run(run_id).info.status == "KILLED"
    server.start()
    sdk(server, RESUME, saved["path"])
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and run.info.run_name == model_id  # the same run, continued
    steps = [m.step for m in client.get_metric_history(run_id, "tinker/optim_step/learning_rate")]
    assert sorted(steps) == [1, 2, 3]  # two optimizer steps before the stop, one after, in one run
