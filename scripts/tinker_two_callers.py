"""Two callers, one experiment: rlexp's GRPO run by Hydra (`python -m rlexp.run`) and by a Tinker
user's script (examples/tinker/grpo.py, the official SDK) through `rlexp tinker`, with the same
task, model, LoRA, group size, learning rate and seeds; their reward curves side by side.

    .venv/bin/python scripts/tinker_two_callers.py OUT [--seeds 0 1 2] [--steps 20] [--rank 8]
                                                   [--lr 2e-3] [--plot docs/tinker_two_callers.png]

For each seed: the Hydra run (the default experiment with `trainer.lora.rank`, a constant lr
and `seed`); the same run's prompts, answers and per-group sampling seeds, drawn by its own
DataManager, as the script's TASK file; then the script against one server (`rlexp tinker`, the
default tiny model) for every seed. Both log to OUT/mlflow.db. Prints each caller's reward per
step (mean over seeds) and, last, `ratio:` the Tinker script's mean reward over the last half
of the steps to the Hydra runs'."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hydra import initialize_config_module
from hydra.utils import instantiate

from rlexp.agents.single_turn import request_seed
from rlexp.chat.render import render_prompt
from rlexp.check import compose_config

ROOT = Path(__file__).resolve().parents[1]
TINKER_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
BASE_MODEL = "rlexp/tiny-chat"  # conf/tinker.yaml's tinker.base_model
EXPERIMENT = "two-callers"  # the Hydra runs' MLflow experiment
HYDRA, TINKER = "Hydra run (python -m rlexp.run)", "Tinker script (examples/tinker/grpo.py)"


def hydra_overrides(seed: int, steps: int, rank: int, lr: float, *extra: str) -> list[str]:
    """The Hydra run: the default experiment, LoRA `rank`, a constant `lr`; `extra` overrides
    (another model or data size: the server must serve the same model). The seed varies the
    data order, the samples and the adapters' init, not the model: the tiny model's recipe
    takes the run's seed by default (conf/model/tiny.yaml), the server's is seed 0's."""
    return [f"seed={seed}", "model.seed=0", "model.task_seed=0", f"trainer.total_steps={steps}",
            f"trainer.lora.rank={rank}", f"trainer.optimizer.lr={lr}", "trainer.lr_schedule=constant",
            "trainer.ref_kl_every_n_steps=0", "checkpoint.every_n_steps=0", *extra]


def write_task(overrides: list[str], steps: int, path: Path) -> None:
    """What the run of `overrides` samples at each step: its prompts (token ids), answers and
    engine seeds, drawn by its own DataManager and agent, and its rollout settings."""
    from transformers import AutoTokenizer

    with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
        cfg, _ = compose_config(overrides)
    tokenizer = AutoTokenizer.from_pretrained(instantiate(cfg.model))
    data = instantiate(cfg.data)
    settings = {"group_size": data.samples_per_prompt, "max_tokens": cfg.rollout.max_response_tokens,
                "temperature": cfg.rollout.temperature}
    with path.open("w") as f:
        for _ in range(steps):
            groups = [{"prompt": render_prompt(tokenizer, g[0].prompt), "answer": g[0].answer,
                       "seed": request_seed(cfg.rollout.seed, g[0])}  # the engine seed of its first sample
                      for g in data.sample_groups(data.prompts_per_step)]
            f.write(json.dumps({"groups": groups} | settings) + "\n")


def run_hydra(out: Path, overrides: list[str], seed: int) -> None:
    cmd = [sys.executable, "-m", "rlexp.run", *overrides, *logged(out, f"hydra_{seed}"),
           f"logger.experiment_name={EXPERIMENT}", f"run_name=hydra-seed-{seed}"]
    _run(cmd, out / f"hydra_seed_{seed}.log", cwd=ROOT)


def _run(cmd: list[str], log: Path, **kwargs) -> None:
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {done.returncode}; the end of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-20:]))


def logged(out: Path, name: str) -> list[str]:
    return [f"logger.tracking_uri=sqlite:///{out}/mlflow.db", f"logger.artifact_location={out}/artifacts",
            f"hydra.run.dir={out}/{name}"]


def hydra_rewards(out: Path) -> dict[int, list[float]]:
    """Each Hydra run's reward of its step's samples (`rollout/reward_mean`), by seed."""
    from mlflow.tracking import MlflowClient

    from rlexp.compare_plots import history

    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    return {int(r.info.run_name.rsplit("-", 1)[1]): [m.value for m in history(client, r.info.run_id,
                                                                                  "rollout/reward_mean")]
            for r in runs}


def start_server(out: Path, *overrides: str) -> tuple[subprocess.Popen, str]:
    """`rlexp tinker` on a free port, its state, MLflow store and logs under `out`, with
    `overrides` (conf/tinker.yaml); (the process, its URL) once it serves."""
    cmd = [sys.executable, "-m", "rlexp.tinker", "tinker.port=0", f"tinker.state_dir={out}/tinker_state",
           *logged(out, "tinker"), *overrides]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(out / "server.log", "w"),
                              text=True)
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("rlexp tinker: serving"):
            return server, line.split(" on ")[1].split()[0]
    raise RuntimeError(f"the Tinker server did not start: see {out / 'server.log'}")


def run_tinker(url: str, base_model: str, task: Path, out: Path, seed: int, rank: int,
               lr: float) -> list[dict]:
    """examples/tinker/grpo.py on `task` (LoRA `rank`, `lr`, its adapter's init by `seed`):
    what it reports per step (reward, tokens, replies)."""
    rewards = out / f"tinker_seed_{seed}.jsonl"
    cmd = [str(TINKER_PYTHON), str(ROOT / "examples" / "tinker" / "grpo.py"), url, base_model, str(task),
           str(rewards), "--rank", str(rank), "--lr", str(lr), "--seed", str(seed)]
    env = os.environ | {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    _run(cmd, out / f"tinker_seed_{seed}.log", env=env)
    return [json.loads(line) for line in rewards.read_text().splitlines()]


def plot(curves: dict[str, dict[int, list[float]]], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for caller, by_seed in curves.items():
        rows = list(zip(*by_seed.values()))
        steps = range(1, len(rows) + 1)
        ax.plot(steps, [statistics.mean(r) for r in rows], label=f"{caller} (mean of {len(by_seed)} seeds)")
        ax.fill_between(steps, [min(r) for r in rows], [max(r) for r in rows], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward of the step's samples")
    ax.set_title(f"GRPO, tiny model, LoRA rank {args.rank}, lr {args.lr:g}: band = min..max over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        overrides = hydra_overrides(seed, args.steps, args.rank, args.lr)
        run_hydra(out, overrides, seed)
        write_task(overrides, args.steps, out / f"task_seed_{seed}.jsonl")
    server, url = start_server(out, f"rollout.max_lora_rank={max(args.rank, 8)}")
    try:
        steps = {s: run_tinker(url, BASE_MODEL, out / f"task_seed_{s}.jsonl", out, s, args.rank, args.lr)
                 for s in args.seeds}
        tinker = {s: [step["reward_mean"] for step in reported] for s, reported in steps.items()}
    finally:
        server.terminate()
        server.wait(timeout=120)
    curves = {HYDRA: hydra_rewards(out), TINKER: tinker}
    for caller, by_seed in curves.items():
        print(caller, json.dumps({s: [round(r, 3) for r in v] for s, v in sorted(by_seed.items())}))
    if args.plot:
        plot(curves, args.plot, args)
    half = args.steps // 2
    late = [statistics.mean(v[half:]) for v in curves[TINKER].values()]
    hydra_late = [statistics.mean(v[half:]) for v in curves[HYDRA].values()]
    print(f"mean reward over steps {half + 1}..{args.steps}: Tinker {statistics.mean(late):.3f} "
          f"(seeds {[round(x, 3) for x in late]}), Hydra {statistics.mean(hydra_late):.3f} "
          f"(seeds {[round(x, 3) for x in hydra_late]})")
    print(f"ratio: {statistics.mean(late) / statistics.mean(hydra_late):.3f}")


if __name__ == "__main__":
    main()
