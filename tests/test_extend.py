"""Components of a user's own, in their own module (examples/extend/, the "Extend rlexp" docs
page), selected by `_target_` with no rlexp edit; config checks that ask a component what it
can do (an attribute of its Protocol, rlexp/config_components.py) instead of reading its
`_target_`'s name."""

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from rlexp.config import validate
from rlexp.errors import ConfigError
from rlexp.protocols import Agent, RolloutEngine
from rlexp.sample import Generation, Sample, Status
from tests.fakes import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "extend"
sys.path.insert(0, str(EXAMPLES))  # the user's modules, as PYTHONPATH puts them in a real run

from my_agent import HintAgent  # noqa: E402
from my_data import CsvSource  # noqa: E402
from my_judge import ShortAnswerJudge  # noqa: E402


def _sample(reply="", answer="7", length=0):
    s = Sample(group_id=0, prompt=[{"role": "user", "content": "3+4="}], answer=answer, metadata={"seed": 1})
    s.response_text = reply
    s.trace.append([5] * length, role="assistant", generation=Generation([5] * length, [-0.5] * length,
                                                                       "stop", [0] * length))
    return s


def test_the_example_judge_scores_by_hand():
    judge = ShortAnswerJudge(length_penalty=0.01)
    scored = asyncio.run(judge.score(_sample("3+4 is 7", length=5)))
    assert scored.reward == pytest.approx(1.0 - 0.05) and scored.correct == 1.0
    assert asyncio.run(judge.score(_sample("8", length=2))).reward == pytest.approx(-0.02)
    assert asyncio.run(judge.score(_sample("no number"))).reward == 0.0


def _csv(tmp_path, rows, name="problems.csv"):
    path = tmp_path / name
    path.write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in rows))
    return str(path)


def test_the_example_data_source_splits_and_names_a_bad_row(tmp_path):
    path = _csv(tmp_path, [(f"{i}+1=", i + 1) for i in range(10)])
    source = CsvSource(path, eval_size=3, seed=0, system_prompt="Answer with a number.")
    train, held_out = source.problems("train"), source.problems("eval")
    assert len(train) == 7 and len(held_out) == 3
    assert {p.messages[-1]["content"] for p in train + held_out} == {f"{i}+1=" for i in range(10)}
    assert all(p.messages[0] == {"role": "system", "content": "Answer with a number."} for p in train)
    assert all(int(p.messages[-1]["content"].split("+")[0]) + 1 == int(p.answer) for p in train)
    bad = _csv(tmp_path, [("1+1=", 2), ("2+2=", "")], "bad.csv")
    with pytest.raises(ValueError, match=r"bad.csv:3: a row needs a question and an answer"):
        CsvSource(bad, eval_size=1, seed=0)


def test_the_example_agent_records_tokens_and_asks_its_judge(tokenizer):
    engine = ScriptedEngine(tokenizer, ["7"])
    agent = HintAgent(engine, tokenizer, ShortAnswerJudge(0.0), hint=" Think.")
    s = asyncio.run(agent.rollout(_sample()))
    ((prompt, generated),) = engine.calls
    assert "3+4= Think." in tokenizer.decode(prompt)
    assert s.tokens == prompt + generated and sum(s.loss_mask) == len(generated)
    assert s.status is Status.COMPLETED and s.reward == 1.0


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# A user's own classes, named so that reading their `_target_` would misjudge them.
class MyVLLMEngineWrapper(RolloutEngine):  # "VLLMEngine" in its name; takes no images (the default)
    def __init__(self, **rollout_keys):
        pass


class PictureSampler(RolloutEngine):  # takes images, and says so
    takes_images = True

    def __init__(self, **rollout_keys):
        pass


class CountingAgentWithImages:  # not subclassing Agent: it declares the attribute itself
    sends_images = True


class TextAgent(Agent):
    pass


def test_image_checks_ask_the_agent_and_the_engine():
    here = __name__
    base = ["experiment=vlm", f"agent._target_={here}.CountingAgentWithImages"]
    validate(_compose(*base), images=True)
    with pytest.raises(ConfigError, match="does not send to the engine"):
        validate(_compose("experiment=vlm", f"agent._target_={here}.TextAgent"), images=True)
    with pytest.raises(ConfigError, match="MyVLLMEngineWrapper takes none"):
        validate(_compose(*base, f"rollout._target_={here}.MyVLLMEngineWrapper"), images=True)
    validate(_compose(*base, f"rollout._target_={here}.PictureSampler"), images=True)
    with pytest.raises(ConfigError, match="rollout=hf|takes none"):
        validate(_compose(*base, "rollout=hf"), images=True)


def test_a_class_without_its_protocols_attribute_is_named_with_the_protocol_to_subclass():
    agent = "agent._target_=tests.test_schedulers.CountingAgent"
    message = (r"^agent._target_: tests.test_schedulers.CountingAgent is not an rlexp Agent: "
               r"it has no sends_images \(subclass rlexp.protocols.Agent\)$")
    with pytest.raises(ConfigError, match=message):
        validate(_compose("experiment=vlm", agent), images=True)
    validate(_compose(agent))  # no images: the check does not ask
    with pytest.raises(ConfigError, match=r"rollout._target_: .*Engineless is not an rlexp RolloutEngine: "
                                          r"it has no constrains_replies"):
        validate(_compose(f"rollout._target_={__name__}.Engineless"))
    cfg = _compose()
    cfg.cluster = OmegaConf.create({"_target_": f"{__name__}.Engineless"})
    with pytest.raises(ConfigError, match="cluster._target_: .* is not an rlexp Cluster: "):
        validate(cfg)


class Engineless:
    def __init__(self, **keys):
        pass


class ArrayCluster:  # "ray" is in its module path (tests.test_extend.ArrayCluster): not a Ray cluster
    distributed = False


def test_the_cluster_check_asks_the_cluster():
    cfg = _compose("rollout.replicas=2")
    cfg.cluster = OmegaConf.create({"_target_": f"{__name__}.ArrayCluster"})
    assert "ray" in cfg.cluster._target_.lower()  # what a name-based check would have trusted
    with pytest.raises(ConfigError, match="rollout.replicas=2 runs several engines"):
        validate(cfg)
    cfg.cluster = OmegaConf.create({"_target_": "rlexp.cluster.ray_cluster.RayCluster"})
    validate(cfg)  # declares distributed = True


BUGGY_JUDGE = """
from rlexp.protocols import Judge


class BuggyJudge(Judge):
    def __init__(self, fail_after: int):
        self.fail_after, self.calls = fail_after, 0

    async def score(self, sample):
        self.calls += 1
        sample.reward = 0.0
        if self.calls > self.fail_after:
            sample.reward = sample.response_text + 1.0  # a bug: str + float
        return sample
"""


def _run(tmp_path, models, *overrides, pythonpath):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "--config-dir", str(EXAMPLES / "conf"), "experiment=smoke",
           f"logger.tracking_uri={uri}", f"logger.artifact_location={tmp_path}/artifacts",
           f"model.cache_dir={models}", "model.warm_start_steps=40",
           f"hydra.run.dir={tmp_path}/out", *overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    return res, client, run


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_with_the_users_judge_data_and_agent(tmp_path):
    """The examples together through real vLLM, from the user's config dir: TRL-style reward
    functions (the example judge class is tested by hand above), the CSV source, the agent."""
    path = _csv(tmp_path, [(f"{a}+{b}=", a + b) for a in range(12) for b in range(6)])
    functions = "judge.functions=[my_rewards.accuracy,my_rewards.brevity]"
    res, client, run = _run(tmp_path, tmp_path / "models", "judge=reward_functions", functions,
                            "judge.correct_function=accuracy", "data=csv", f"data.source.path={path}",
                            "agent=hint", "agent.hint=' '", pythonpath=[EXAMPLES, ROOT])
    assert res.returncode == 0, res.stderr[-4000:]
    assert run.info.status == "FINISHED"
    assert run.data.params["judge._target_"] == "rlexp.judges.reward_functions.RewardFunctions"
    assert run.data.params["data.source._target_"] == "my_data.CsvSource"
    assert run.data.params["agent._target_"] == "my_agent.HintAgent"
    rewards = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [m.step for m in rewards] == [1, 2, 3]
    assert all(m.value <= 1.0 for m in rewards)


@pytest.mark.slow
def test_a_programming_error_in_a_users_judge_stops_the_run_and_keeps_what_was_logged(tmp_path, run_models):
    """Exit code 3 with the user's traceback; the steps before it stay in MLflow (rollout=hf:
    the policy is irrelevant here, and it starts in a second)."""
    (tmp_path / "buggy.py").write_text(textwrap.dedent(BUGGY_JUDGE))
    calls_before_step_2 = 16 + 16  # the step-0 evaluation (16 prompts) and step 1 (4 x 4)
    res, client, run = _run(tmp_path, run_models, "rollout=hf", "~judge", "+judge._target_=buggy.BuggyJudge",
                            f"+judge.fail_after={calls_before_step_2}", pythonpath=[tmp_path, ROOT])
    assert res.returncode == 3, res.stderr[-4000:]
    assert "Traceback" in res.stderr and "buggy.py" in res.stderr
    assert "sample.reward = sample.response_text + 1.0" in res.stderr  # the user's line
    assert "rlexp: run stopped: " in res.stderr and "agent raised TypeError" in res.stderr
    assert "resume=" in res.stderr
    assert run.info.status == "FAILED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean")]
    assert steps == [1]  # step 1 was logged; step 2 stopped at its first bad score


def test_a_users_config_keys_are_checked_against_the_users_signature():
    """The user's own config dir, composed as --config-dir composes it."""
    def judge(**keys):
        cfg = _compose()
        cfg.judge = OmegaConf.create({"_target_": "my_judge.ShortAnswerJudge", **keys})
        return cfg

    with pytest.raises(ConfigError, match="judge.length_penalty must be a number, got 'fast'"):
        validate(judge(length_penalty="fast"))
    validate(judge(length_penalty=0.01))
    with pytest.raises(ConfigError, match="judge.lenght_penalty is not an argument of my_judge"):
        validate(judge(lenght_penalty=0.01))


def test_trl_style_reward_functions_score_unchanged():
    from rlexp.judges.reward_functions import RewardFunctions

    judge = RewardFunctions(["my_rewards.accuracy", "my_rewards.brevity"], weights=[1.0, 2.0],
                            correct_function="accuracy")
    s = asyncio.run(judge.score(_sample("it is 7", length=10)))
    assert s.reward_components == {"accuracy": 1.0, "brevity": pytest.approx(-0.02), "correct": 1.0}
    assert s.reward == pytest.approx(1.0 + 2.0 * -0.02)
    s = asyncio.run(judge.score(_sample("it is 8", length=3)))
    assert (s.reward, s.correct) == (0.0, 0.0)


async def maybe_reward(completions, **kwargs):
    """An async reward function that has nothing to say about replies without a digit."""
    return [1.0 if any(c.isdigit() for c in completions[0][0]["content"]) else None]


def returns_a_float(completions, **kwargs):
    return 0.5  # TRL wants a list: a bug


def returns_nan(completions, **kwargs):
    return [float("nan")]


def test_reward_functions_async_none_and_bad_returns():
    from rlexp.judges.reward_functions import RewardFunctions

    judge = RewardFunctions([f"{__name__}.maybe_reward", "my_rewards.accuracy"])
    assert asyncio.run(judge.score(_sample("7", length=1))).reward == 2.0
    s = asyncio.run(judge.score(_sample("none", length=1)))
    assert s.reward == 0.0 and s.reward_components == {"accuracy": 0.0}  # None adds nothing
    with pytest.raises(TypeError, match="must return a list with one value per completion"):
        asyncio.run(RewardFunctions([f"{__name__}.returns_a_float"]).score(_sample("7", length=1)))
    with pytest.raises(ValueError, match="returns_nan returned nan"):
        asyncio.run(RewardFunctions([f"{__name__}.returns_nan"]).score(_sample("7", length=1)))


@pytest.mark.parametrize("functions, message", [
    ("[my_rewards.accuracy,my_rewards.nope]", "judge.functions: cannot import 'my_rewards.nope'"),
    (None, "judge.functions is required"),
])
def test_reward_functions_are_checked_before_anything_starts(functions, message):
    overrides = ["judge=reward_functions"] + ([f"judge.functions={functions}"] if functions else [])
    with pytest.raises(ConfigError, match=message):
        validate(_compose(*overrides))
