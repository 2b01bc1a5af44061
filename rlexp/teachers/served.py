"""teacher=openai: the served model's tokenizer against the one the run reads its scores with
(`teacher.tokenizer`, or the student's when unset), asked of the server before any engine
starts. The teacher scores token ids: a server whose ids mean other tokens would score the
student's ids read as its own, so a difference is refused.

vLLM's OpenAI server answers, at its root (the base_url without its `/v1`):

    POST /tokenize   {"model": m, "prompt": text, "add_special_tokens": false, "return_token_strs": true}
                     -> {"tokens": [id, ...], "token_strs": [str, ...], "count": n, "max_model_len": n}
    POST /detokenize {"model": m, "tokens": [id, ...]} -> {"prompt": text}

Two probes, needing no transformers here (the directory's tokenizer.json, read with the
`tokenizers` library): the server's tokens of a text (the local decoding of the vocabulary's
first `CHUNK` ids) must be local tokens, each with the same id; and every id of the local
vocabulary, `CHUNK` at a time, must decode to the same text on the server (special tokens
kept). The server's ids of the text are not compared with a local encoding of it: transformers
builds some tokenizers' pre-tokenizers from their class rather than from tokenizer.json
(rlexp/models/tiny_bpe.py), so the same tokenizer may split a text differently here.

A server whose `/tokenize` does not answer as vLLM's does (an HTTP error such as 404, or a
reply without a token list: not vLLM) cannot be asked. Then `teacher.tokenizer` says which
tokenizer it serves; without it the run is refused unless `teacher.same_tokenizer=true` states
that it serves the student's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from rlexp.errors import ConfigError
from rlexp.teachers.openai import _one_line

if TYPE_CHECKING:
    from rlexp.teachers.openai import OpenAITeacher

CHUNK = 8192  # ids per /detokenize request


class Differs(ValueError):
    """How the served tokenizer differs from the local one."""


def check_served_tokenizer(teacher: OpenAITeacher, student_path: str, timeout_s: float) -> None:
    """ConfigError, one line, when the served tokenizer is not the one the run reads the
    teacher's scores with, or cannot be asked and nothing says which it is."""
    local_path = str(teacher.tokenizer_path or student_path)
    mine = "the student's" if teacher.tokenizer_path is None else "teacher.tokenizer's"
    try:
        vocab, decode = local_tokenizer(local_path)
    except Exception as e:  # a directory without a tokenizer: whatever transformers raises
        where = "the student's model directory" if teacher.tokenizer_path is None else "teacher.tokenizer"
        raise ConfigError(f"{where} {local_path}: no tokenizer to compare with the served model's "
                          f"({type(e).__name__}: {_one_line(str(e), 200)})") from None
    ids = sorted(set(vocab.values()))
    root = server_root(teacher.base_url)
    with httpx.Client(headers=teacher._headers(), timeout=timeout_s, trust_env=False) as http:
        ask = _Asker(http, root, teacher.model)
        probe = decode(ids[:CHUNK])
        served = ask.tokenize(probe)
        if served is None:
            if teacher.tokenizer_path is None and not teacher.same_tokenizer:
                raise ConfigError(
                    f"teacher=openai: {root}/tokenize {ask.why}, so the served model's tokenizer cannot be "
                    f"compared with the student's ({student_path}): set teacher.tokenizer=<the served "
                    "model's tokenizer directory> (and teacher.align=true if it is not the student's), or "
                    "teacher.same_tokenizer=true if the server uses the student's tokenizer")
            return
        try:
            same_tokens(served, vocab, mine)
            for start in range(0, len(ids), CHUNK):
                chunk = ids[start:start + CHUNK]
                same_text(ask.detokenize(chunk), decode(chunk), chunk, mine)
        except Differs as e:
            raise ConfigError(_differs(teacher, root, local_path, str(e))) from None


def _differs(teacher: OpenAITeacher, root: str, local_path: str, how: str) -> str:
    if teacher.tokenizer_path is None:
        return (f"teacher=openai: the tokenizer served at {root} is not the student's ({local_path}): {how}; "
                "set teacher.tokenizer=<the served model's tokenizer directory> and teacher.align=true to "
                "map the teacher's logprobs onto the student's tokens through the text")
    return (f"teacher=openai: the tokenizer served at {root} is not teacher.tokenizer={local_path}: {how}; "
            "set teacher.tokenizer to the served model's tokenizer directory")


class _Asker:
    """POSTs to the server's tokenizer endpoints; `why` says why /tokenize could not be asked."""

    def __init__(self, http: httpx.Client, root: str, model: str):
        self.http, self.root, self.model, self.why = http, root, model, ""

    def tokenize(self, text: str) -> list[tuple[int, str | None]] | None:
        """(id, token or None) of each of the server's tokens of `text`; None: not vLLM's reply."""
        reply = self._post("tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False,
                                        "return_token_strs": True})
        if reply.status_code != 200:
            self.why = f"answered HTTP {reply.status_code} ({_one_line(reply.text, 120)})"
            return None
        try:
            body = reply.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not _ids(body.get("tokens")) or (text and not body["tokens"]):
            self.why = f"replied {_one_line(reply.text, 120)}, not vLLM's token list"
            return None
        tokens: list[int] = body["tokens"]
        strs = body.get("token_strs")
        names: list[str | None] = [None] * len(tokens)
        if isinstance(strs, list) and len(strs) == len(tokens):
            names = strs
        return list(zip(tokens, names))

    def detokenize(self, ids: list[int]) -> str:
        reply = self._post("detokenize", {"model": self.model, "tokens": ids})
        body = self._body(reply, "detokenize")
        if not isinstance(body.get("prompt"), str):
            raise ConfigError(f"teacher=openai: {self.root}/detokenize replied {_one_line(reply.text)}, "
                              "not vLLM's {\"prompt\": text}")
        return body["prompt"]

    def _post(self, endpoint: str, body: dict[str, Any]) -> httpx.Response:
        url = f"{self.root}/{endpoint}"
        try:
            return self.http.post(url, json=body)
        except httpx.HTTPError as e:
            raise ConfigError(f"teacher=openai: {url} did not answer "
                              f"({_one_line(f'{type(e).__name__}: {e}', 200)})") from None

    def _body(self, reply: httpx.Response, endpoint: str) -> dict[str, Any]:
        url = f"{self.root}/{endpoint}"
        if reply.status_code != 200:
            raise ConfigError(f"teacher=openai: {url} answered HTTP {reply.status_code}: "
                              f"{_one_line(reply.text)}")
        try:
            body = reply.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ConfigError(f"teacher=openai: {url} replied with {_one_line(reply.text)}, "
                              "not a JSON object")
        return body


def same_tokens(served: list[tuple[int, str | None]], vocab: dict[str, int],
                mine: str = "the student's") -> None:
    """Each of the server's tokens is a local token with the same id (where the server names
    its tokens)."""
    for token_id, token in served:
        if token is not None and token not in vocab:
            raise Differs(f"the server has a token {token!r} (id {token_id}) that {mine} lacks")
        if token is not None and vocab[token] != token_id:
            raise Differs(f"the server's id of {token!r} is {token_id}, {mine} {vocab[token]}")


def same_text(served: str, local: str, ids: list[int], mine: str = "the student's") -> None:
    """The server decodes `ids` as the local tokenizer does (or with transformers' cleanup of
    the spaces before punctuation, which a non-BPE tokenizer may be configured with)."""
    if served in (local, _cleaned(local)):
        return
    at = next((i for i, (a, b) in enumerate(zip(served, local)) if a != b), min(len(served), len(local)))
    raise Differs(f"ids {ids[0]}..{ids[-1]} decode to {_snippet(served[at:])} on the server, "
                  f"{_snippet(local[at:])} with {mine} (from character {at})")


def local_tokenizer(path: str) -> tuple[dict[str, int], Callable[[list[int]], str]]:
    """(token -> id, decode) of a directory's tokenizer: its tokenizer.json with the `tokenizers`
    library; transformers' only where there is none."""
    file = Path(path) / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(file))
        return fast.get_vocab(with_added_tokens=True), lambda ids: fast.decode(ids, skip_special_tokens=False)
    from transformers import AutoTokenizer

    slow = AutoTokenizer.from_pretrained(path)
    return dict(slow.get_vocab()), lambda ids: str(slow.decode(ids, skip_special_tokens=False,
                                                                 clean_up_tokenization_spaces=False))


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def server_root(base_url: str) -> str:
    """The server's root: the OpenAI base_url without its trailing `/v1`."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _cleaned(text: str) -> str:
    """transformers' `clean_up_tokenization`."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _snippet(text: str, limit: int = 24) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
