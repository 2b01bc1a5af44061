"""teacher=openai's check of the served model's tokenizer (rlexp/teachers/served.py), against a
small HTTP server on loopback that answers vLLM's `/tokenize` and `/detokenize` with the tiny
model's character tokenizer or the BPE of rlexp/models/tiny_bpe.py, or not at all (the
scenario is the first part of the url's path). Against vLLM's own server:
test_teacher_vllm_serve.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from rlexp.errors import ConfigError
from rlexp.teachers import served
from rlexp.teachers.openai import OpenAITeacher
from tests.distill_helpers import distill_run, refused, student
from tests.teacher_helpers import serving


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    """The two tokenizers' directories (tokenizer.json and its config, no model)."""
    from rlexp.models.tiny import build_char_tokenizer
    from rlexp.models.tiny_bpe import build_bpe_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    build_char_tokenizer().save_pretrained(root / "char")
    build_bpe_tokenizer().save_pretrained(root / "bpe")
    return {"char": str(root / "char"), "bpe": str(root / "bpe")}


class Fake:
    """scenario -> (the tokenizer /tokenize uses, the one /detokenize uses, whether /tokenize
    names its tokens); a scenario not listed has no tokenizer endpoints (HTTP 404)."""

    def __init__(self, dirs: dict[str, str]):
        char, bpe = (Tokenizer.from_file(f"{dirs[k]}/tokenizer.json") for k in ("char", "bpe"))
        self.scenarios = {"char": (char, char, True), "bpe": (bpe, bpe, True),
                          "bpe-unnamed": (bpe, bpe, False), "tokenize-bpe": (bpe, char, True),
                          "tail": (char, char, True)}
        self.detokenized: list[list[int]] = []

    def answer(self, scenario: str, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
        if scenario == "llama-cpp" and endpoint == "tokenize":  # its /tokenize reads "content"
            return 200, {"tokens": []}
        if scenario not in self.scenarios or endpoint not in ("tokenize", "detokenize"):
            return 404, {"detail": "Not Found"}
        tokenize, detokenize, named = self.scenarios[scenario]
        if endpoint == "tokenize":
            encoded = tokenize.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
            reply = {"tokens": encoded.ids, "count": len(encoded.ids), "max_model_len": 256}
            return 200, reply | ({"token_strs": encoded.tokens} if named else {})
        self.detokenized.append(body["tokens"])
        ids = [97 if i == 98 and scenario == "tail" else i for i in body["tokens"]]
        return 200, {"prompt": detokenize.decode(ids, skip_special_tokens=False)}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                _, scenario, endpoint = self.path.split("/")
                self.send(*fake.answer(scenario, endpoint, body))

            def send(self, status: int, reply: Any) -> None:
                text = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture(scope="module")
def fake(dirs) -> Iterator[tuple[Fake, str]]:
    """(the fake, its root url): a scenario's base_url is f"{root}/<scenario>/v1"."""
    server = Fake(dirs)
    with serving(server.handler()) as root:
        yield server, root


def check(root: str, scenario: str, student_dir: str, **kwargs: Any) -> None:
    served.check_served_tokenizer(OpenAITeacher(f"{root}/{scenario}/v1", "tiny", **kwargs), student_dir, 5.0)


def refusal(root: str, scenario: str, student_dir: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as raised:
        check(root, scenario, student_dir, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and f"{root}/{scenario}" in message
    return message


def test_a_server_with_the_students_tokenizer_passes_and_every_id_is_decoded(fake, dirs, monkeypatch):
    server, root = fake
    vocab = json.loads(Path(dirs["char"], "tokenizer.json").read_text())
    ids = sorted(set(vocab["model"]["vocab"].values()) | {t["id"] for t in vocab["added_tokens"]})
    server.detokenized.clear()
    check(root, "char", dirs["char"])
    assert server.detokenized == [ids]
    monkeypatch.setattr(served, "CHUNK", 32)
    server.detokenized.clear()
    check(root, "char", dirs["char"])
    assert [i for chunk in server.detokenized for i in chunk] == ids and len(server.detokenized) == 4
    check(root, "bpe", dirs["bpe"])


def test_another_tokenizer_is_refused_in_one_line_naming_the_fix(fake, dirs):
    _, root = fake
    for scenario, student_dir, differ in (
            ("bpe", dirs["char"], "the server's id of '<|endoftext|>' is 323, the student's 0"),
            ("char", dirs["bpe"], "the server's id of 'Ċ' is 98, the student's 10")):
        message = refusal(root, scenario, student_dir)
        assert message == (f"teacher=openai: the tokenizer served at {root}/{scenario} is not the student's "
                           f"({student_dir}): {differ}; set teacher.tokenizer=<the served model's tokenizer "
                           "directory> and teacher.align=true to map the teacher's logprobs onto the "
                           "student's tokens through the text")


def test_each_probe_alone_finds_the_difference(fake, dirs, monkeypatch):
    """The decoded vocabulary (the server names no tokens), the server's tokens of a text (its
    decoding agrees), and an id past the first chunk (the tokenized text is the first chunk's)."""
    _, root = fake
    assert "ids 0..98 decode to '\\x00\\x01" in refusal(root, "bpe-unnamed", dirs["char"])
    assert "the server's id of '<|endoftext|>' is 323" in refusal(root, "tokenize-bpe", dirs["char"])
    monkeypatch.setattr(served, "CHUNK", 32)
    message = refusal(root, "tail", dirs["char"])
    assert "ids 96..98 decode to ' ' on the server, '\\n' with the student's (from character 2)" in message


def test_teacher_tokenizer_is_compared_with_the_server_instead(fake, dirs):
    _, root = fake
    check(root, "bpe", dirs["char"], tokenizer=dirs["bpe"], align=True)
    message = refusal(root, "char", dirs["char"], tokenizer=dirs["bpe"], align=True)
    assert f"is not teacher.tokenizer={dirs['bpe']}: " in message
    assert message.endswith("set teacher.tokenizer to the served model's tokenizer directory")


def test_a_server_without_tokenize_needs_teacher_tokenizer_or_same_tokenizer(fake, dirs):
    _, root = fake
    message = refusal(root, "openai-only", dirs["char"])
    assert message.startswith(f"teacher=openai: {root}/openai-only/tokenize answered HTTP 404 "
                              f"({{\"detail\": \"Not Found\"}}), so the served model's tokenizer cannot be "
                              f"compared with the student's ({dirs['char']}): ")
    assert "set teacher.tokenizer=<" in message and "or teacher.same_tokenizer=true if" in message
    other = refusal(root, "llama-cpp", dirs["char"])
    assert "/tokenize replied {\"tokens\": []}, not vLLM's token list, so" in other
    check(root, "openai-only", dirs["char"], same_tokenizer=True)
    check(root, "llama-cpp", dirs["char"], same_tokenizer=True)
    check(root, "openai-only", dirs["char"], tokenizer=dirs["bpe"], align=True)
    assert "is not the student's" in refusal(root, "bpe", dirs["char"], same_tokenizer=True)


@pytest.mark.parametrize("scenario, overrides, said", [
    ("openai-only", [], "tokenize answered HTTP 404"),
    ("bpe", ["teacher.same_tokenizer=true"], "is not the student's"),
])
def test_a_run_is_refused_before_any_engine(fake, tmp_path, tiny_model_path, scenario, overrides, said):
    """A whole run: exit code 2, one line; `teacher.same_tokenizer` is a key of teacher=openai,
    and a server that answers is still asked."""
    _, root = fake
    res, _ = distill_run(tmp_path, *student(tiny_model_path), "teacher=openai", "teacher.model=tiny",
                         f"teacher.base_url={root}/{scenario}/v1", "recipe=distill", *overrides)
    line = refused(res)
    assert said in line and "teacher.tokenizer=" in line
