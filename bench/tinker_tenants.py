"""Many tenants on one Tinker server: LoRA models sampled as adapters on the engine's one base
model against sampled as whole merged models (one engine load per switch), driven by the
official `tinker` SDK (.venv-tinker) against `python -m rlexp.tinker`.

    .venv/bin/python bench/tinker_tenants.py [--rank 8 --rounds 6 --tokens 32] [key=value ...]

One server. Its tenants: four LoRA models of attention + MLP (`train_unembed=False`: sampled
as adapters) and two full fine-tunes (rank 0: sampled as whole models, as a LoRA model is where
the engine cannot adapt what it trains); each takes one Adam step of its own, so no two share
weights.

- **Switch**: `--rounds` rounds of a 1-token sample from each of two tenants in turn (every
  request another model's weights), per kind; seconds per request, median; and the same
  requests to one tenant (no switch), for what the switch itself costs.
- **Tokens/s** with 1, 2 and 4 adapter tenants sampled at once: each tenant 4 requests of 4
  samples of `--tokens` tokens (ignore_eos), all sent together; with 1 tenant, the base model
  too (no adapter), for the adapters' own cost. Best of 3.
- **Memory**: the resident memory of the server and its processes (vLLM's engine core) after
  each adapter tenant is created (each holds a trainer: its adapter and optimizer state, on the
  frozen base the LoRA trainers share), and after its adapter is loaded into the engine.

key=value overrides go to the server (conf/tinker.yaml), e.g. model=smollm2. Printed last:
`ratio:` merged seconds / adapter seconds per request switching between two models.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from tinker_throughput import SDK_PYTHON, start_server

CLIENT = """
import json, os, sys, time
import tinker
from tinker import types
url, pid = sys.argv[1], sys.argv[2]
rank, rounds, tokens = (int(a) for a in sys.argv[3:6])
service = tinker.ServiceClient(base_url=url)

def tree(p):  # the server and every process under it (vLLM's engine core)
    threads = os.listdir(f"/proc/{p}/task")
    kids = [c for t in threads for c in open(f"/proc/{p}/task/{t}/children").read().split()]
    return [p] + [q for c in kids for q in tree(c)]

def rss_mb():
    total = 0
    for p in tree(pid):
        fields = dict(line.split(":", 1) for line in open(f"/proc/{p}/status"))
        total += int(fields["VmRSS"].split()[0])
    return total / 1024

def tenant(i, lora_rank):  # rank 0: full fine-tuning, sampled as the whole model
    tc = service.create_lora_training_client(base_model="rlexp/tiny-chat", rank=lora_rank, seed=i,
                                             train_unembed=False)
    d = types.Datum(model_input=types.ModelInput.from_ints([10 + i, 11, 12, 13]),
                    loss_fn_inputs={"target_tokens": [11, 12, 13, 14 + i], "weights": [1.0] * 4})
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return tc

prompt = types.ModelInput.from_ints([10, 11, 12, 13])
memory = [("start", rss_mb())]
adapters = []
for i in range(4):
    adapters.append(tenant(i, rank).save_weights_and_get_sampling_client())
    memory.append((f"tenant {i + 1} trainer", rss_mb()))
    adapters[-1].sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()
    memory.append((f"tenant {i + 1} adapter loaded", rss_mb()))
merged = [tenant(10 + i, 0).save_weights_and_get_sampling_client() for i in range(2)]

def per_request(samplers):  # one 1-token sample from each in turn: seconds each, median
    one = types.SamplingParams(max_tokens=1, seed=0, temperature=1.0)
    seconds = []
    for _ in range(rounds):
        for s in samplers:
            t0 = time.perf_counter()
            s.sample(prompt, 1, one).result()
            seconds.append(time.perf_counter() - t0)
    return sorted(seconds)[len(seconds) // 2]

def throughput(samplers):
    params = types.SamplingParams(max_tokens=tokens, seed=1, temperature=1.0, stop=[])  # ignore_eos
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        futures = [s.sample(prompt, 4, params) for s in samplers for _ in range(4)]
        n = sum(len(q.tokens) for f in futures for q in f.result().sequences)
        best = max(best, n / (time.perf_counter() - t0))
    return best

per_request(adapters[:2]), per_request(merged)  # warm-up: every weight set loaded once
out = {"switch_adapter_s": per_request(adapters[:2]), "switch_merged_s": per_request(merged),
       "same_adapter_s": per_request(adapters[:1]), "same_merged_s": per_request(merged[:1]),
       "memory_mb": memory,
       "tokens_per_s": {"base": throughput([service.create_sampling_client(base_model="rlexp/tiny-chat")])}}
for k in (1, 2, 4):
    out["tokens_per_s"][f"{k} adapter tenant(s)"] = throughput(adapters[:k])
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=32)
    args, overrides = p.parse_known_args()
    root = Path(tempfile.mkdtemp(prefix="rlexp-tinker-tenants-"))
    proc, url = start_server(root, overrides)
    try:
        (root / "client.py").write_text(CLIENT)
        env = os.environ | {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
        cmd = [str(SDK_PYTHON), str(root / "client.py"), url, str(proc.pid), str(args.rank), str(args.rounds),
               str(args.tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"the client failed:\n{done.stderr[-3000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait()
    print(f"LoRA rank {args.rank}, {args.rounds} rounds, {args.tokens} tokens per sample, "
          f"overrides {overrides or 'none'}")
    for name, mb in out["memory_mb"]:
        print(f"server + engine RSS {name:>26}: {mb:8.0f} MB")
    for name, rate in out["tokens_per_s"].items():
        print(f"sampled tokens/s, {name:>20}: {rate:8.0f}")
    for kind in ("adapter", "merged"):
        print(f"1-token request, {kind:>7}: {out[f'switch_{kind}_s']:.3f} s switching between two models, "
              f"{out[f'same_{kind}_s']:.3f} s on one")
    print(f"ratio: {out['switch_merged_s'] / out['switch_adapter_s']:.2f}")


if __name__ == "__main__":
    main()
