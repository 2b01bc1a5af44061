"""teacher=openai (rlexp/teachers/openai.py): its checks of a server's replies, against a small
HTTP server on loopback that answers as told (the scenario is the first part of the url's
path). Its scores against vLLM's own OpenAI server: test_teacher_vllm_serve.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest

from rlexp.console import quiet_third_party
from rlexp.errors import ConfigError, TeacherError
from rlexp.teachers.openai import OpenAITeacher, parse_reply
from rlexp.teachers.serve import serve_command
from tests.teacher_helpers import free_port, score, serving

TOKENS = [5, 6, 7, 8, 9]


def vllm_like_reply(prompt: list[int], top_k: int) -> dict[str, Any]:
    """A reply as vLLM's gives it: entry i holds token i (rank 7) and the ids of ranks 1 .. top_k."""
    entries: list[Any] = [None]
    for i, token in enumerate(prompt[1:], start=1):
        entry = {str(token): {"logprob": -0.5 * i - 0.01 * token, "rank": 7, "decoded_token": "x"}}
        entry |= {str(100 + r): {"logprob": -0.1 * r, "rank": r, "decoded_token": "y"}
                  for r in range(1, top_k + 1)}
        entries.append(entry)
    return {"object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": entries}]}


class FakeServer:
    """Answers `/<scenario>/v1/completions` the way `scenario` says; records what it was sent."""

    def __init__(self) -> None:
        self.release = threading.Event()  # ends the hanging answers
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def answer(self, scenario: str, body: dict[str, Any]) -> tuple[int, str] | None:
        reply = vllm_like_reply(body["prompt"], body["prompt_logprobs"])
        entries = reply["choices"][0]["prompt_logprobs"]
        if scenario == "hang":
            self.release.wait(30)
            return None
        if scenario == "slow":
            with self.lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            time.sleep(0.05)  # the server's work; keeps requests overlapping
            with self.lock:
                self.in_flight -= 1
        mutate = {
            "truncated": lambda: entries.pop(),
            "missing": lambda: entries.__setitem__(2, {"999": {"logprob": -1.0, "rank": 1}}),
            "nan": lambda: entries[1][str(body["prompt"][1])].__setitem__("logprob", math.nan),
            "inf": lambda: entries[3][str(body["prompt"][3])].__setitem__("logprob", -math.inf),
            "positive": lambda: entries[2][str(body["prompt"][2])].__setitem__("logprob", 0.5),
            "no-prompt-logprobs": lambda: reply["choices"][0].pop("prompt_logprobs"),
        }
        if scenario in mutate:
            mutate[scenario]()
        if scenario == "status500":
            return 500, '{"error": {"message": "EngineCore died", "code": 500}}'
        if scenario == "not-json":
            return 200, "<html>proxy says hello</html>"
        return 200, json.dumps(reply)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send(200, json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    fake.headers.append(dict(self.headers))
                answer = fake.answer(self.path.split("/")[1], body)
                if answer is not None:
                    self.send(*answer)

            def send(self, status: int, text: str) -> None:
                with contextlib.suppress(OSError):  # the client may have given up (timeout)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(text.encode())))
                    self.end_headers()
                    self.wfile.write(text.encode())

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeServer, str]]:
    """(the fake, its root url): a scenario's base_url is f"{root}/<scenario>/v1"."""
    server = FakeServer()
    with serving(server.handler()) as root:
        try:
            yield server, root
        finally:
            server.release.set()  # a handler held by a scenario lets go before the server stops


def teacher(root: str, scenario: str, **kwargs: Any) -> OpenAITeacher:
    return OpenAITeacher(f"{root}/{scenario}/v1", "tiny", **kwargs)


def test_a_good_reply_is_each_tokens_logprob_and_the_top_k_by_rank(fake):
    server, root = fake
    t = teacher(root, "ok", top_k=2, api_key="sk-test")
    [scores] = score(t, TOKENS)
    assert scores.logprobs == [-0.5 * i - 0.01 * tok for i, tok in enumerate(TOKENS[1:], start=1)]
    assert scores.top == [{101: -0.1, 102: -0.2}] * 4  # the actual token (rank 7) is not among them
    assert server.bodies[-1] == {"model": "tiny", "prompt": TOKENS, "max_tokens": 1, "temperature": 1.0,
                                 "prompt_logprobs": 2, "echo": False}
    assert server.headers[-1]["Authorization"] == "Bearer sk-test"
    [plain] = score(teacher(root, "ok"), TOKENS)
    assert plain.logprobs == scores.logprobs and plain.top is None


def test_the_top_k_holds_the_actual_token_when_it_is_among_them():
    reply = vllm_like_reply([5, 6], 2)
    reply["choices"][0]["prompt_logprobs"][1] = {"6": {"logprob": -0.2, "rank": 2},
                                                 "101": {"logprob": -0.1, "rank": 1}}
    assert parse_reply(reply, [5, 6], 2).top == [{101: -0.1, 6: -0.2}]
    assert parse_reply(vllm_like_reply([5], 2), [5], 2).logprobs == []


@pytest.mark.parametrize("scenario, problem", [
    ("truncated", "4 prompt_logprobs entries for 5 tokens (truncated)"),
    ("missing", "no logprob of the actual token 7 at position 2"),
    ("nan", "non-finite logprob nan for token 6 at position 1"),
    ("inf", "non-finite logprob -inf for token 8 at position 3"),
    ("positive", "positive logprob 0.5 for token 7 at position 2"),
    ("no-prompt-logprobs", "no choices[0].prompt_logprobs"),
    ("not-json", "replied with a body that is not JSON: <html>proxy says hello</html>"),
    ("status500", "answered HTTP 500 to 5 tokens: {\"error\": {\"message\": \"EngineCore died\""),
])
def test_a_bad_reply_is_a_teacher_error_naming_what_was_wrong(fake, scenario, problem):
    _, root = fake
    with pytest.raises(TeacherError) as raised:
        score(teacher(root, scenario, top_k=1), TOKENS)
    message = str(raised.value)
    assert problem in message and f"{root}/{scenario}/v1/completions" in message and "\n" not in message


def test_a_server_that_hangs_is_a_teacher_error_after_timeout_s(fake):
    _, root = fake
    timed_out = r"/hang/v1/completions did not answer within 0.5 s \(teacher.timeout_s\)"
    with pytest.raises(TeacherError, match=timed_out):
        score(teacher(root, "hang", timeout_s=0.5), TOKENS)


def test_no_more_than_max_concurrency_requests_are_in_flight(fake):
    server, root = fake
    results = score(teacher(root, "slow", max_concurrency=2), *([TOKENS] * 8))
    assert len(results) == 8 and 1 <= server.most_in_flight <= 2


def test_check_refuses_a_closed_port_and_a_model_not_served_in_one_line(fake):
    _, root = fake
    port = free_port()  # nothing listens there once the probe socket is closed
    with pytest.raises(ConfigError) as raised:
        OpenAITeacher(f"http://127.0.0.1:{port}/v1", "tiny").check()
    message = str(raised.value)
    assert message.startswith(f"teacher=openai: http://127.0.0.1:{port}/v1 is unreachable (ConnectError")
    start = serve_command(name="tiny", port=port)
    assert f"start the teacher's server (e.g. `{start}`) or set teacher.base_url" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"^teacher.model=other is not served by .*; it serves tiny$"):
        OpenAITeacher(f"{root}/ok/v1", "other").check()
    teacher(root, "ok").check()


def test_shutdown_closes_the_client_from_its_loop_from_sync_code_and_after_the_loop_ended(fake):
    _, root = fake
    t = teacher(root, "ok")

    async def inside() -> httpx.AsyncClient:
        await t.score(TOKENS)
        client = t._client
        t.shutdown()
        await asyncio.sleep(0)  # the close is a task of this loop
        return client

    assert asyncio.run(inside()).is_closed
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(t.score(TOKENS))
        client = t._client
        t.shutdown()  # the loop lives, not running
        assert client is not None and client.is_closed
    finally:
        loop.close()
    asyncio.run(t.score(TOKENS))
    with warnings.catch_warnings():  # a closed loop's connections are only dropped
        warnings.simplefilter("ignore", ResourceWarning)
        t.shutdown()
        t.shutdown()


def test_a_teacher_request_logs_nothing_at_info_once_third_party_logs_are_quieted(fake, caplog, monkeypatch):
    """httpx logs each request at INFO ("HTTP Request: POST ..."): one line per sample scored,
    unless quieted as `python -m rlexp.run` does (rlexp/console.py)."""
    _, root = fake
    for name, value in (("VLLM_LOGGING_LEVEL", "WARNING"), ("PYTHONWARNINGS", ""), ("TQDM_DISABLE", "1")):
        monkeypatch.setenv(name, value)  # what quiet_third_party sets, restored afterwards
    monkeypatch.setattr(logging.getLogger("vllm.engine.arg_utils"), "filters", [])
    loggers = [logging.getLogger(name) for name in ("httpx", "httpcore")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.NOTSET)
        with caplog.at_level(logging.INFO):
            score(teacher(root, "ok"), TOKENS)
        assert any(r.name == "httpx" and "/ok/v1/completions" in r.getMessage() for r in caplog.records)
        caplog.clear()
        quiet_third_party()
        with caplog.at_level(logging.INFO):
            score(teacher(root, "ok"), TOKENS, TOKENS)
        assert [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
