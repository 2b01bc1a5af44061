"""MlflowTracker against a real SQLite MLflow store: a resumed run holds what was logged up
to its checkpoint, every step once, with MLflow's public API only."""

import json

from mlflow import MlflowClient
from mlflow.entities import ViewType
from omegaconf import OmegaConf

from rlexp.sample import Sample, Status, TokenTrace
from rlexp.tracking.mlflow_tracker import MlflowTracker


def _sample(step: int) -> Sample:
    return Sample(group_id=step, prompt=[{"role": "user", "content": f"{step}+1="}], answer=str(step + 1),
                  response_text=str(step + 1), reward=1.0, status=Status.COMPLETED,
                  trace=TokenTrace(turns=[{"role": "assistant", "text": "x", "span": [0, 1], "mask": 1}]))


def _log_steps(tracker: MlflowTracker, steps, sign: float = 1.0) -> None:
    for step in steps:
        tracker.log_metrics({"loss": sign * step, "eval": 10.0 * step}, step)
        tracker.log_samples([_sample(step)], step, decode=lambda ids: "")


def _tracker(uri: str) -> MlflowTracker:
    return MlflowTracker(uri, "t", run_name="r", trace_sample_rate=1.0)


def _active(client: MlflowClient):
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    return run


def _state(client: MlflowClient, run) -> dict:
    """What a user sees of a run: metric histories, trace files, sampled traces' steps."""
    rid = run.info.run_id
    files = sorted(a.path for a in client.list_artifacts(rid, "traces"))
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=rid, include_spans=False)
    return {"loss": sorted((m.step, m.value) for m in client.get_metric_history(rid, "loss")),
            "eval": sorted((m.step, m.value) for m in client.get_metric_history(rid, "eval")),
            "latest": run.data.metrics, "files": files,
            "traced": sorted(int(t.info.tags["rlexp.step"]) for t in traces)}


def test_a_resumed_run_holds_each_step_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    first = _tracker(uri)
    first_id = first.start(OmegaConf.create({"seed": 3, "trainer": {"lr": 0.1}}))
    _log_steps(first, range(1, 6))  # checkpointed at 3, then steps 4, 5, then killed
    first.end(status="KILLED")

    resumed = _tracker(uri)
    resumed.resume(first_id, 3, tags={"rlexp.job_num": "7"})
    _log_steps(resumed, [4], sign=-1.0)  # step 4 again, with other numbers
    resumed.end()

    run = _active(client)
    assert run.info.run_id != first_id and client.get_run(first_id).info.lifecycle_stage == "deleted"
    assert _state(client, run) == {
        "loss": [(1, 1.0), (2, 2.0), (3, 3.0), (4, -4.0)],
        "eval": [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)],
        "latest": {"loss": -4.0, "eval": 40.0},
        "files": [f"traces/step_{s:05d}.jsonl" for s in (1, 2, 3, 4)], "traced": [1, 2, 3, 4]}
    old = client.get_run(first_id)
    assert run.data.params == old.data.params and run.data.params["trainer.lr"] == "0.1"
    assert {k: v for k, v in old.data.tags.items() if k in run.data.tags} == old.data.tags | {
        "mlflow.runName": "r"}  # every tag of the interrupted attempt carried over
    assert (run.data.tags["rlexp.resumes"], run.data.tags["rlexp.resumed_from_step"],
            run.data.tags["rlexp.job_num"], run.data.tags["rlexp.replaces"]) == ("1", "3", "7", first_id)
    assert (run.info.status, run.info.start_time) == ("FINISHED", old.info.start_time)
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert OmegaConf.load(config).seed == 3
    line = json.loads(open(client.download_artifacts(run.info.run_id, "traces/step_00002.jsonl",
                                                     str(tmp_path))).read())
    assert line["group_id"] == 2  # the interrupted attempt's file, copied


def test_resuming_again_from_the_same_checkpoint_drops_the_first_copy(tmp_path):
    """Killed again before the resumed attempt's first checkpoint: the next resume starts
    from the same checkpoint, and so from the same source run."""
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    first = _tracker(uri)
    first_id = first.start(OmegaConf.create({"seed": 3}))
    _log_steps(first, range(1, 6))
    first.end(status="KILLED")
    for attempt in (1, 2):
        tracker = _tracker(uri)
        tracker.resume(first_id, 3, tags={})
        _log_steps(tracker, [4, 5], sign=-attempt)
        tracker.end(status="KILLED")
    run = _active(client)
    exp = run.info.experiment_id
    assert len(client.search_runs([exp], run_view_type=ViewType.ALL)) == 3  # two of them deleted
    assert run.data.tags["rlexp.resumes"] == "2"
    state = _state(client, run)
    assert state["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, -8.0), (5, -10.0)]
    assert state["traced"] == [1, 2, 3, 4, 5]
    assert sorted(int(t.info.tags["rlexp.step"]) for t in client.search_traces(locations=[exp])) == \
        [1, 2, 3, 4, 5]  # the first copy's traces of steps 4 and 5 were deleted with it


def test_a_constrained_turn_and_a_model_judges_call_are_in_the_trace_file_and_the_mlflow_trace(tmp_path):
    """What a request asked of the sampling (a server's reply) and what a model judge was
    asked and answered reach both the step's JSONL line and the sampled MLflow trace."""
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    sampling = {"response_format": {"type": "json_object"}, "top_logprobs": 2}
    s = _sample(1)
    s.trace.turns[0]["sampling"] = sampling
    s.metadata["judge"] = {"prompt": "Grade: 2=", "reply": "Score: 7"}
    tracker = _tracker(uri)
    tracker.start(OmegaConf.create({"seed": 0}))
    tracker.log_samples([s], 1, decode=lambda ids: "")
    tracker.end()
    run = _active(client)
    line = json.loads(open(client.download_artifacts(run.info.run_id, "traces/step_00001.jsonl",
                                                     str(tmp_path))).read())
    assert line["turns"][0]["sampling"] == sampling and line["judge"]["reply"] == "Score: 7"
    (trace,) = client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id)
    turn = next(sp for sp in trace.data.spans if sp.name.startswith("turn 0"))
    recorded = turn.attributes["rlexp.sampling"]  # a JSON string, which MLflow may decode on reading
    assert (json.loads(recorded) if isinstance(recorded, str) else recorded) == sampling
    root = next(sp for sp in trace.data.spans if sp.parent_id is None)
    assert root.outputs["judge"] == {"prompt": "Grade: 2=", "reply": "Score: 7"}


def test_an_moe_samples_routing_goes_beside_the_trace_file_compressed_and_referenced(tmp_path):
    import numpy as np

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    routed = np.random.default_rng(0).integers(0, 8, size=(30, 2, 2), dtype=np.uint8)
    moe, dense = _sample(1), _sample(1)
    moe.trace.routed_experts = routed
    tracker = _tracker(uri)
    tracker.start(OmegaConf.create({"seed": 0}))
    tracker.log_samples([dense, moe], 1, decode=lambda ids: "")
    tracker.end()
    rid = _active(client).info.run_id
    trace_file = client.download_artifacts(rid, "traces/step_00001.jsonl", str(tmp_path))
    lines = [json.loads(x) for x in open(trace_file)]
    assert "routed_experts" not in lines[0]
    ref = lines[1]["routed_experts"]
    assert ref == {"file": "step_00001.routing.npz", "key": "1", "shape": [30, 2, 2]}
    with np.load(client.download_artifacts(rid, f"traces/{ref['file']}", str(tmp_path))) as npz:
        assert list(npz) == ["1"] and np.array_equal(npz["1"], routed) and npz["1"].dtype == np.uint8


def test_a_vision_samples_images_go_beside_the_trace_file_as_pngs_listed_by_its_line(tmp_path):
    from PIL import Image

    from rlexp.data.shapes import draw

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    pictures = [draw(1, 2), draw(2, 3)]
    vision, text = _sample(1), _sample(1)
    vision.prompt = [{"role": "user", "content": [{"type": "image", "image": pictures[0]},
                                                  {"type": "image", "image": pictures[1]},
                                                  {"type": "text", "text": "How many?"}]}]
    vision.mm_infer_info = {"images": pictures, "spans": [[3, 7], [9, 13]]}
    tracker = _tracker(uri)
    tracker.start(OmegaConf.create({"seed": 0}))
    tracker.log_samples([text, vision], 1, decode=lambda ids: "")
    tracker.end()
    rid = _active(client).info.run_id
    trace_file = client.download_artifacts(rid, "traces/step_00001.jsonl", str(tmp_path))
    lines = [json.loads(x) for x in open(trace_file)]
    assert "images" not in lines[0]
    assert lines[1]["images"] == ["step_00001.images/1_0.png", "step_00001.images/1_1.png"]
    assert lines[1]["image_spans"] == [[3, 7], [9, 13]]
    assert [p.get("index") for p in lines[1]["prompt"][0]["content"]] == [0, 1, None]  # the images' places
    for name, picture in zip(lines[1]["images"], pictures):
        with Image.open(client.download_artifacts(rid, f"traces/{name}", str(tmp_path))) as png:
            assert list(png.convert("RGB").getdata()) == list(picture.getdata())  # lossless
