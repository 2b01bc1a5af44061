"""rlexp.compare across seeds, on a real MLflow store with runs laid out as a sweep logs them."""

import json

import pytest
from mlflow.tracking import MlflowClient

from rlexp.compare import compare, setting_of
from rlexp.tracking.sweep import SWEEP_FILE

# (threshold, seed) -> eval accuracy at steps 0, 10, 20
CURVES = {(0, 0): [0.2, 0.4, 0.6], (0, 1): [0.3, 0.5, 0.7],
          (4, 0): [0.2, 0.3, 0.4], (4, 1): [0.3, 0.3, 0.5]}


@pytest.fixture
def sweep(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("s")
    parent = client.create_run(exp, run_name="sweep", tags={"rlexp.role": "parent"}).info.run_id
    for job, ((k, seed), curve) in enumerate(CURVES.items()):
        run = client.create_run(exp, run_name=f"staleness_threshold={k},seed={seed}", tags={
            "mlflow.parentRunId": parent, "rlexp.job_num": str(job), "rlexp.role": "job"}).info.run_id
        client.log_param(run, "seed", str(seed))
        for i, acc in enumerate(curve):
            client.log_metric(run, "eval/accuracy", acc, step=10 * i, timestamp=1000 * (i + 1))
        for step in range(1, 13):  # reward = step / 10 + seed: the last 10 steps (3..12) mean 0.75 + seed
            client.log_metric(run, "rollout/reward_mean", step / 10 + seed, step=step)
        for step in (1, 2):
            client.log_metric(run, "rollout/staleness_mean", float(k), step=step)
            client.log_metric(run, f"rollout/staleness_hist/{k}", 8.0, step=step)
            client.log_metric(run, f"offpolicy/tokens/staleness_{k}", 100.0, step=step)
            client.log_metric(run, f"offpolicy/mismatch_kl/staleness_{k}", 0.01 * k * step, step=step)
        client.set_terminated(run)
    (tmp_path / SWEEP_FILE).write_text(json.dumps({"tracking_uri": uri, "parent_run_id": parent}))
    return tmp_path


def test_jobs_that_differ_only_by_seed_are_one_setting(sweep):
    class Run:
        class info:
            run_name = "staleness_threshold=2,seed=1"
    assert setting_of(Run) == "staleness_threshold=2"
    out = compare(str(sweep))
    md = (out / "compare.md").read_text()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in md.split("Per setting")[1].splitlines() if r.startswith("| staleness")}
    assert set(rows) == {"staleness_threshold=0", "staleness_threshold=4"}
    seeds, final, auc, vs_first = rows["staleness_threshold=4"][:4]
    assert seeds == "2" and final == "0.450 ± 0.071"      # (0.4, 0.5)
    assert auc == "0.333 ± 0.047"                          # means 0.3 and 0.367
    assert vs_first == "-0.117 ± 0.024"                    # paired by seed: -0.1, -0.133
    assert rows["staleness_threshold=0"][3] == "0.000 ± 0.000"
    assert rows["staleness_threshold=4"][6] == "0.060 ± 0.000"  # token-weighted: (0.04 + 0.08) / 2
    assert rows["staleness_threshold=4"][10] == "1.250 ± 0.707"  # reward_last10: seeds 0.75, 1.75
    assert rows["staleness_threshold=4"][11] == "-"              # entropy_last10: not logged
    for png in ("compare_settings_eval_accuracy.png", "compare_settings_training.png",
                "compare_settings_staleness.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tokens_sampled_count_trained_and_untrained_tokens_up_to_each_step(tmp_path):
    from rlexp.compare_plots import sampled_tokens

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    run = client.create_run(client.create_experiment("t")).info.run_id
    for step, tokens in ((1, 10.0), (2, 20.0), (3, 30.0)):
        client.log_metric(run, "rollout/tokens", tokens, step=step)
    client.log_metric(run, "rollout/untrained_tokens", 5.0, step=2)
    assert sampled_tokens(client, run) == {1: 10.0, 2: 35.0, 3: 65.0}
