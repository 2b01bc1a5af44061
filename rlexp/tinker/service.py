"""The Tinker API's state and calls, HTTP aside (app.py maps the routes onto these): sessions,
training models (models.py), sampling sessions (sampler.py), futures (futures.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlexp.sample import SamplingConfig
from rlexp.tinker import wire
from rlexp.tinker.errors import BadRequest, not_found
from rlexp.tinker.futures import failure, settle
from rlexp.tinker.models import Models
from rlexp.tinker.sampler import Sampler
from rlexp.tinker.store import Store

MAX_SAMPLES = 256  # num_samples of one request
MAX_TOPK = 20  # vLLM's max_logprobs


# How a session's finish reason ends its models' MLflow runs; a session that stops heartbeating
# (its client gone) is ended as interrupted.
RUN_STATUS = {"success": "FINISHED", "errored": "FAILED", "interrupted": "KILLED"}


@dataclass
class Session:
    user_metadata: dict[str, Any]
    last_seen: float = field(default_factory=time.time)
    ended: str | None = None  # why it ended (finished by its client, or expired)


@dataclass(frozen=True)
class SamplingSession:
    base_model: str
    weights: Path | None  # None: the base model's
    model_path: str | None


class Service:
    def __init__(self, base_model: str, models: Models, sampler: Sampler, store: Store, vocab_size: int,
                 max_model_len: int, poll_s: float, tokenizer_dir: str, session_timeout_s: float = 300):
        """`tokenizer_dir`: the served model's directory, which a client's `get_tokenizer()`
        loads with no model hub (AutoTokenizer.from_pretrained of the `tokenizer_id` reported);
        `session_timeout_s`: a session with no heartbeat and no call for this long has ended
        (its client is gone) and its models are released."""
        self.session_timeout_s = session_timeout_s
        self.base_model, self.models, self.sampler, self.store = base_model, models, sampler, store
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size, self.max_model_len, self.poll_s = vocab_size, max_model_len, poll_s
        self.futures = models.futures
        self.sessions: dict[str, Session] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self._boot = uuid.uuid4().hex[:6]  # session ids of a restarted server never repeat older ones
        self._session_ids = itertools.count(1)
        self._sequence_ids = itertools.count(1)

    # ---- sessions ------------------------------------------------------------------------------

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = f"{self._boot}-{next(self._session_ids)}"
        self.sessions[session_id] = Session(wire.get(body, "user_metadata", dict, {}))
        return {"type": "create_session", "session_id": session_id}

    def session(self, session_id: Any, where: str = "session_id") -> Session:
        """A live session (410 once ended: the SDK's heartbeat stops on it)."""
        if not isinstance(session_id, str) or session_id not in self.sessions:
            raise not_found("session", str(session_id), where)
        s = self.sessions[session_id]
        if s.ended is not None:
            raise BadRequest(f"session {session_id} {s.ended}", where, 410)
        s.last_seen = time.time()
        return s

    async def finish(self, session_id: str, body: dict[str, Any]) -> None:
        """The client's ServiceClient.close(status): the session ends, its models are released."""
        session = self.session(session_id, "session_id")
        reason = wire.get(wire.get(body, "reason", dict, {"type": "success"}), "type", str, "success",
                          "reason.")
        if reason not in RUN_STATUS:
            raise BadRequest(f"reason.type {reason!r} is not one of {sorted(RUN_STATUS)}", "reason.type")
        await self._end(session_id, session, f"was finished by its client ({reason})", RUN_STATUS[reason])

    async def expire(self, now: float | None = None) -> list[str]:
        """End the sessions whose clients are gone (no heartbeat or call for session_timeout_s)."""
        now, expired = time.time() if now is None else now, []
        for session_id, session in list(self.sessions.items()):
            calls = [self.models.models[m].last_call for m in self.models.of_session(session_id)]
            if session.ended is None and now - max([session.last_seen, *calls]) > self.session_timeout_s:
                why = f"expired: no heartbeat or call for {self.session_timeout_s:g} s"
                await self._end(session_id, session, why, "KILLED")
                expired.append(session_id)
        return expired

    async def _end(self, session_id: str, session: Session, why: str, status: str) -> None:
        session.ended = why
        models = self.models.of_session(session_id)
        await asyncio.gather(*(self.models.release(m, why, status) for m in models))

    # ---- training models -----------------------------------------------------------------------

    def create_model(self, body: dict[str, Any], raw: bytes) -> dict[str, Any]:
        session_id = wire.get(body, "session_id", str)
        self.session(session_id)
        model_id = f"{session_id}:train:{wire.nonneg(body, 'model_seq_id', int, wire.MISSING)}"
        meta, seed = self.models.meta(body, wire.get(body, "base_model", str))
        return {"request_id": self.models.create(model_id, raw, meta, seed), "model_id": model_id}

    def load_weights(self, body: dict[str, Any], raw: bytes) -> dict[str, Any]:
        """Create-via-load (session_id, model_seq_id) or, deprecated, into a model (model_id)."""
        if body.get("session_id") is None:  # into a model: a refused request still takes its number
            model_id, seq = wire.get(body, "model_id", str), wire.get(body, "seq_id", int, None)
            with self.models.get(model_id).lane.numbered(seq):
                return self._load_checked(body, raw, seq)
        return self._load_checked(body, raw, None)

    def _load_checked(self, body: dict[str, Any], raw: bytes, seq: int | None) -> dict[str, Any]:
        source, kind, name = wire.tinker_path(wire.get(body, "path", str))
        if kind != "weights":
            raise BadRequest("load_weights needs a training state (tinker://<model>/weights/<name>)", "path")
        directory = self.store.existing(source, kind, name)
        optimizer = wire.get(body, "optimizer", bool)
        if body.get("session_id") is not None:
            session_id = wire.get(body, "session_id", str)
            self.session(session_id)
            model_id = f"{session_id}:train:{wire.nonneg(body, 'model_seq_id', int, wire.MISSING)}"
            meta = {k: v for k, v in self.store.meta(source).items() if k in ("base_model", "lora_rank",
                                                                               "lora_parts", "user_metadata")}
            if wire.get(body, "base_model", str, meta["base_model"]) != meta["base_model"]:
                raise BadRequest(f"base_model differs from the checkpoint's {meta['base_model']!r}",
                                 "base_model")
            # a model of an earlier server process (restarted since) goes on in its MLflow run;
            # one that lives here keeps its run, and the loaded copy gets a run of its own
            run_id = self.store.meta(source).get("mlflow_run_id")
            if run_id is not None and not self.models.runs_in(run_id):
                meta["mlflow_run_id"] = run_id
            request_id = self.models.create(model_id, raw, meta, None, (directory, optimizer))
            return {"request_id": request_id, "model_id": model_id}
        model_id = wire.get(body, "model_id", str)
        model = self.models.get(model_id)

        def call() -> dict[str, Any]:
            self.models.ready(model_id).load(directory, optimizer)
            return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

        return {"request_id": model.lane.submit(seq, raw, call), "model_id": model_id}

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = wire.get(body, "model_id", str)
        self.models.get(model_id)
        training = self.models.ready(model_id)
        return {"type": "get_info", "model_id": model_id,
                # vocab_size: the model's rows (token ids 0..vocab_size-1), which can be more than
                # the tokenizer's entries; the SDK's ModelData drops it, the wire carries it
                "model_data": {"arch": "rlexp", "model_name": self.base_model,
                               "tokenizer_id": self.tokenizer_dir, "vocab_size": self.vocab_size},
                "is_lora": training.lora_rank > 0, "lora_rank": training.lora_rank or None,
                "model_name": self.base_model}

    def register_sampler(self, model_id: str, seq: int, directory: Path) -> str:
        session_id = f"{model_id.rsplit(':train:', 1)[0]}:sample:{seq}"
        self.samplers[session_id] = SamplingSession(self.base_model, directory, None)
        return session_id

    # ---- sampling ------------------------------------------------------------------------------

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session_id = wire.get(body, "session_id", str)
        self.session(session_id)
        sampler_id = f"{session_id}:sample:{wire.nonneg(body, 'sampling_session_seq_id', int, wire.MISSING)}"
        model_path = wire.get(body, "model_path", str, None)
        weights = None
        if model_path is not None:
            source, kind, name = wire.tinker_path(model_path, "model_path")
            if kind != "sampler_weights":
                raise BadRequest("a sampler reads sampler weights (tinker://<model>/sampler_weights/<name>); "
                                 "save them with save_weights_for_sampler", "model_path")
            weights = self.store.existing(source, kind, name, "model_path")
        elif wire.get(body, "base_model", str) != self.base_model:
            raise BadRequest(f"base_model {body['base_model']!r} is not served here ({self.base_model!r})",
                             "base_model")
        self.samplers[sampler_id] = SamplingSession(self.base_model, weights, model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        if sampler_id not in self.samplers:
            raise not_found("sampler", sampler_id, "sampler_id")
        s = self.samplers[sampler_id]
        return {"sampler_id": sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def sample(self, body: dict[str, Any]) -> dict[str, Any]:
        sampler_id = wire.get(body, "sampling_session_id", str)
        if sampler_id not in self.samplers:
            raise not_found("sampling session", sampler_id, "sampling_session_id")
        self.session(sampler_id.rsplit(":sample:", 1)[0], "sampling_session_id")
        prompt = wire.tokens(body.get("prompt"), "prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if not prompt or bad is not None:
            raise BadRequest(f"prompt: token id {bad} is out of the vocabulary (0..{self.vocab_size - 1})"
                             if prompt else "prompt has no tokens", "prompt")
        n = wire.get(body, "num_samples", int, 1)
        if not 1 <= n <= MAX_SAMPLES:
            raise BadRequest(f"num_samples must be 1..{MAX_SAMPLES}, got {n}", "num_samples")
        for key in ("prompt_alt_tokens_k", "target_prompt_logprobs"):
            if body.get(key):
                raise BadRequest(f"{key} is not served by rlexp", key)
        top_prompt, top_sample = (wire.nonneg(body, k, int, 0) for k in ("topk_prompt_logprobs",
                                                                          "topk_sample_logprobs"))
        if max(top_prompt, top_sample) > MAX_TOPK:
            raise BadRequest(f"top-k logprobs beyond {MAX_TOPK} are not served", "topk_prompt_logprobs")
        sampling = self._sampling(wire.get(body, "sampling_params", dict), len(prompt), top_sample)
        last_n = wire.nonneg(body, "prompt_logprobs_last_n", int, None)
        call = self.sampler.sample(self.samplers[sampler_id].weights, prompt, n, sampling,
                                   wire.get(body, "prompt_logprobs", bool, False), top_prompt, last_n)
        request_id, future = self.futures.new()
        task = asyncio.ensure_future(call)
        task.add_done_callback(lambda t: settle(future, t))
        return {"request_id": request_id, "sample_sequence_ids": [f"seq-{next(self._sequence_ids)}"
                                                                   for _ in range(n)]}

    def _sampling(self, p: dict[str, Any], prompt_len: int, top_sample: int) -> SamplingConfig:
        at = "sampling_params."
        room = self.max_model_len - prompt_len
        max_tokens = wire.get(p, "max_tokens", int, room, at)
        if not 1 <= max_tokens <= room:
            raise BadRequest(f"{at}max_tokens {max_tokens}: the prompt's {prompt_len} tokens leave room for "
                             f"1..{room} (max_model_len {self.max_model_len})", f"{at}max_tokens")
        temperature = wire.nonneg(p, "temperature", float, 1.0, at)
        top_p = wire.get(p, "top_p", float, 1.0, at)
        top_k = wire.get(p, "top_k", int, -1, at)
        if not 0 < top_p <= 1 or top_k == 0 or top_k < -1:
            raise BadRequest(f"{at}top_p must be in (0, 1] and top_k -1 or >= 1", f"{at}top_p")
        stop = p.get("stop")
        words = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
        if stop is not None and not isinstance(stop, (str, list)) or not (
                all(isinstance(w, str) for w in words) or all(type(w) is int for w in words)):
            raise BadRequest(f"{at}stop must be a string, a list of strings or a list of token ids",
                             f"{at}stop")
        texts = tuple(w for w in words if isinstance(w, str))
        return SamplingConfig(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              seed=wire.get(p, "seed", int, None, at), top_logprobs=top_sample,
                              top_k=max(top_k, 0), stop=texts,
                              stop_token_ids=tuple(w for w in words if type(w) is int),
                              ignore_eos=stop is not None and not words)

    # ---- futures -------------------------------------------------------------------------------

    async def retrieve(self, body: dict[str, Any]) -> tuple[str, Any]:
        """("pending", None), ("failed", error body), ("bytes", protobuf) or ("json", result)."""
        future = self.futures.get(wire.get(body, "request_id", str))
        try:
            await asyncio.wait_for(asyncio.shield(future), self.poll_s)
        except asyncio.TimeoutError:
            return "pending", None
        except Exception:  # noqa: BLE001 - the call's failure, read below
            pass
        if (error := future.exception()) is not None:
            return "failed", failure(error)
        result = future.result()
        return ("bytes" if isinstance(result, bytes) else "json"), result

