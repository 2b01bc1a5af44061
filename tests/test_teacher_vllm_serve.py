"""teacher=openai against vLLM's own OpenAI server on the tiny model, started with the command
the docs give (rlexp/teachers/serve.py): its scores are a transformers forward's, its top-k the
likeliest ids, and the same as teacher=local's, down to the distillation advantages; a student
with another tokenizer (rlexp/models/tiny_bpe.py) is refused before any engine starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlexp.errors import ConfigError
from rlexp.models.tiny_bpe import build_bpe_model
from rlexp.sample import TeacherScores
from rlexp.teachers.openai import CHECK_TIMEOUT_S, OpenAITeacher
from rlexp.teachers.scoring import own_tokens
from rlexp.teachers.serve import SERVE_ENV, serve_argv, serve_command
from rlexp.teachers.served import check_served_tokenizer
from tests.distill_helpers import ROOT, distill_run, refused, student
from tests.teacher_helpers import free_port, score

SERVER_START_FAILSAFE_S = 300  # turns a server that never comes up into a failure (~25 s alone on 2 cores)


@pytest.fixture(scope="module")
def vllm_server(tiny_model_path, tmp_path_factory) -> Iterator[str]:
    """The docs' command (`serve_argv`, this interpreter as `python`) on the tiny model, serving
    "tiny"; yields its base_url. Its IPC sockets in a directory of its own."""
    port, temp = free_port(), tmp_path_factory.mktemp("vllm-serve")
    log = (temp / "server.log").open("w")
    env = os.environ | SERVE_ENV | {"VLLM_RPC_BASE_PATH": str(temp)}
    argv = serve_argv(tiny_model_path, "tiny", port, max_model_len=256)
    proc = subprocess.Popen([sys.executable, *argv[1:]], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
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
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(health).status_code == 200:
                    return
            time.sleep(0.5)
    pytest.fail(f"the server is not up after {SERVER_START_FAILSAFE_S} s:\n{log.read_text()[-3000:]}")


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
    """teacher=openai on vLLM's server: each token's logprob is a transformers forward's, and
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

    local_scores = asyncio.run(in_engine())
    for a, b in zip(served, local_scores):
        assert len(a.logprobs) == len(b.logprobs)
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
        assert [set(t) for t in a.top] == [set(t) for t in b.top]
    for s, a, b in zip(sequences, served, local_scores):
        if len(s) < 5:
            continue
        mask = [0] * 3 + [1] * (len(s) - 3)
        student = [-0.1 * (i % 7) for i in range(len(s))]
        adv = [distill_advantages(student, own_tokens(x, mask, 0), mask) for x in (a, b)]
        assert adv[0].abs().sum() > 0
        assert (adv[0] - adv[1]).abs().max().item() < 1e-5


def test_the_docs_give_the_command_the_server_is_started_with():
    command = serve_command()
    assert command.startswith("VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m vllm.entrypoints.openai.api_server")
    for doc in ("docs/distillation.md", "conf/teacher/openai.yaml"):
        text = (ROOT / doc).read_text()
        assert command in text and "vllm serve <" not in text, doc


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_servers_tokenizer_is_compared_with_the_students(vllm_server, tiny_model_path, tmp_path):
    """The server's /tokenize and /detokenize: the tiny student's own tokenizer passes; a student
    with another (the BPE), or a teacher.tokenizer that is not the served one, is refused in one
    line; a whole run with that student exits 2 before any engine starts."""
    bpe = str(build_bpe_model(tmp_path / "bpe"))

    def check(student_dir: str, **kwargs: Any) -> None:
        check_served_tokenizer(OpenAITeacher(vllm_server, "tiny", **kwargs), student_dir, CHECK_TIMEOUT_S)

    check(tiny_model_path)
    check(bpe, tokenizer=tiny_model_path, align=True)
    root = vllm_server.removesuffix("/v1")
    with httpx.Client(timeout=10.0, trust_env=False) as http:  # a probe may be longer than --max-model-len
        long = http.post(f"{root}/tokenize", json={"model": "tiny", "prompt": "12+17=29\n" * 64,
                                                   "add_special_tokens": False}).json()
        back = http.post(f"{root}/detokenize", json={"model": "tiny", "tokens": long["tokens"]}).json()
    assert long["count"] == 9 * 64 > long["max_model_len"] == 256 and back["prompt"] == "12+17=29\n" * 64
    with pytest.raises(ConfigError, match=rf"^teacher=openai: the tokenizer served at {re.escape(root)} is "
                                          rf"not the student's \({re.escape(bpe)}\): the server's id of "):
        check(bpe)
    with pytest.raises(ConfigError, match=rf"is not teacher.tokenizer={re.escape(bpe)}: "):
        check(tiny_model_path, tokenizer=bpe, align=True)
    res, _ = distill_run(tmp_path, *student(bpe), "teacher=openai", f"teacher.base_url={vllm_server}",
                         "teacher.model=tiny", "recipe=distill")
    line = refused(res)
    assert "is not the student's" in line and "set teacher.tokenizer=<" in line
    assert "teacher.align=true" in line
