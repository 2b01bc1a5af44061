"""The Tinker server's training models: create (or create from a checkpoint), the calls that
train them, and their checkpoints. Each model has its TrainingModel (training.py), its Lane
(its calls, in order, on its thread: futures.py) and its MLflow run (tracking.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlexp.tinker import datums, losses, wire
from rlexp.tinker.errors import BadRequest, not_found
from rlexp.tinker.futures import Futures, Lane
from rlexp.tinker.proto import ForwardBackwardRequest, forward_output
from rlexp.tinker.sampler import KEEP_EPHEMERAL, PROBE_FILE
from rlexp.tinker.store import Store
from rlexp.tinker.tracking import ModelRun
from rlexp.tinker.training import AdamStep, TrainingModel
from rlexp.tinker.wire import MISSING
from rlexp.trainer.batch import TrainBatch

log = logging.getLogger(__name__)
LORA_PARTS = {"train_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
              "train_mlp": ["gate_proj", "up_proj", "down_proj"], "train_unembed": ["lm_head"]}
PROBE_TOKENS = 64
MAX_LORA_RANK = 1024


@dataclass
class Model:
    lane: Lane
    training: TrainingModel | None = None  # None until built
    run: ModelRun | None = None
    ephemeral: int = 0  # unnamed sampler weights saved so far
    saves: int = 0  # unnamed states saved so far
    last_call: float = field(default_factory=time.time)


class Models:
    """`adapter_rank`: the largest LoRA rank the engine serves as an adapter (rollout.max_lora_rank;
    0: none, every sampler is a whole model), `adapts_unembedding`: and of the unembedding too
    (server.served_adapter); `max_models`: training models at once (each holds its own trainer:
    a copy of the base model, its adapter, its optimizer state)."""

    def __init__(self, base_model: str, store: Store, futures: Futures,
                 build: Callable[[str, dict[str, Any], int | None], tuple[TrainingModel, ModelRun]],
                 vocab_size: int, max_tokens: int, adapter_rank: int = 0, max_models: int = 8,
                 adapts_unembedding: bool = False):
        self.base_model, self.store, self.futures, self.build = base_model, store, futures, build
        self.vocab_size, self.max_tokens = vocab_size, max_tokens  # of a datum's model_input
        self.adapter_rank, self.max_models = adapter_rank, max_models
        self.adapts_unembedding = adapts_unembedding
        self.models: dict[str, Model] = {}
        self._creations: dict[str, tuple[str, str]] = {}  # model id -> (body digest, request id)
        self.released: dict[str, str] = {}  # model id -> why its session ended

    def get(self, model_id: Any, where: str = "model_id") -> Model:
        """The model a new call is for (410 once its session has ended)."""
        why = self.released.get(model_id) if isinstance(model_id, str) else None
        if why is not None:
            raise BadRequest(f"model {model_id} was released: its session {why}; load one of its saved "
                             "states into a new model to go on", where, 410)
        if not isinstance(model_id, str) or model_id not in self.models:
            raise not_found("model_id", str(model_id), where)
        model = self.models[model_id]
        model.last_call = time.time()
        return model

    def of_session(self, session_id: str) -> list[str]:
        return [m for m in self.models if m.startswith(f"{session_id}:")]

    async def release(self, model_id: str, why: str, status: str = "FINISHED") -> None:
        """Free a model's trainer once the calls it has queued have run (its session ended: `why`);
        its saved states stay on disk, and its MLflow run ends with `status`."""
        model = self.models[model_id]
        self.released[model_id] = why  # no new call from now; the queued ones still run

        def free() -> None:
            if model.run is not None:
                model.run.end(status)
            model.training = None

        await model.lane.run_now(free)
        model.lane.close(f"its session {why}")
        del self.models[model_id]
        log.info("tinker: released model %s (its session %s)", model_id, why)

    def runs_in(self, run_id: str) -> bool:
        """A model of this server logs to MLflow run `run_id`."""
        return any(m.run is not None and m.run.run_id == run_id for m in self.models.values())

    def ready(self, model_id: Any) -> TrainingModel:
        """A queued call's trainer (a call queued before its model's release still runs)."""
        model = self.models[model_id]
        if model.training is None:
            raise BadRequest(f"model {model_id} is still being created", "model_id", 409)
        return model.training

    # ---- creating ------------------------------------------------------------------------------

    def create(self, model_id: str, raw: bytes, meta: dict[str, Any], seed: int | None,
               load: tuple[Path, bool] | None = None) -> str:
        """A new model `model_id` (built on its own thread; `load`: from a checkpoint, with or
        without its optimizer state). A repeat of the same request is the same call."""
        digest = hashlib.sha256(raw).hexdigest()
        if model_id in self._creations:
            if self._creations[model_id][0] != digest:
                raise BadRequest(f"model {model_id} already exists (model_seq_id used twice)", "model_seq_id")
            return self._creations[model_id][1]
        if model_id in self.store.runs() and load is None:
            raise BadRequest(f"model {model_id} already exists on this server", "model_seq_id")
        if len(self.models) >= self.max_models:
            raise BadRequest(f"this server trains at most {self.max_models} models at once "
                             f"(tinker.max_models), and has {len(self.models)}", "tinker.max_models")
        model = self.models[model_id] = Model(Lane(self.futures, model_id))

        def build() -> dict[str, Any]:
            if load is None or not (self.store.run_dir(model_id) / "meta.json").exists():
                self.store.create(model_id, meta)
            model.training, model.run = self.build(model_id, meta, seed)
            if load is None:
                return {"model_id": model_id, "type": "create_model"}
            model.training.load(*load)
            return {"model_id": model_id, "path": str(load[0]), "type": "load_weights"}

        request_id = model.lane.submit(None, raw, build)
        self._creations[model_id] = (digest, request_id)
        return request_id

    def meta(self, body: dict[str, Any], base_model: str) -> tuple[dict[str, Any], int | None]:
        """The model's record from a create_model body (LoRA config: rank 0 = full fine-tuning)."""
        if base_model != self.base_model:
            raise BadRequest(f"base_model {base_model!r} is not served here (this server trains "
                             f"{self.base_model!r})", "base_model")
        lora = wire.get(body, "lora_config", dict, {})
        rank = wire.nonneg(lora, "rank", int, 0, "lora_config.") if lora else 0
        if rank > MAX_LORA_RANK:
            raise BadRequest(f"lora_config.rank {rank} is over {MAX_LORA_RANK}", "lora_config.rank")
        parts = {k: wire.get(lora, k, bool, True, "lora_config.") for k in LORA_PARTS}
        # sampled as an adapter, else merged (server.served_adapter)
        as_adapter = not parts["train_unembed"] or self.adapts_unembedding
        if rank > self.adapter_rank > 0 and as_adapter:
            raise BadRequest(f"lora_config.rank {rank}: this server's engine serves adapters up to rank "
                             f"{self.adapter_rank} (rollout.max_lora_rank)", "lora_config.rank")
        if rank and not any(parts.values()):
            raise BadRequest("lora_config trains nothing: set one of train_attn, train_mlp, train_unembed",
                             "lora_config")
        optimizer = wire.get(body, "optimizer_config", dict, {"type": "adamw"})
        if optimizer.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config.type {optimizer.get('type')!r} is not served (adamw only)",
                             "optimizer_config.type")
        meta = {"base_model": base_model, "lora_rank": rank, "lora_parts": parts,
                "user_metadata": wire.get(body, "user_metadata", dict, {})}
        return meta, wire.get(lora, "seed", int, None, "lora_config.") if lora else None

    # ---- training calls ------------------------------------------------------------------------

    def forward_backward(self, raw: bytes) -> tuple[str, str]:
        request = ForwardBackwardRequest()
        try:
            request.ParseFromString(raw)
        except Exception:  # protobuf's DecodeError, or a message nested too deep
            raise BadRequest("the forward_backward body is not a ForwardBackwardRequest protobuf") from None
        model = self.get(request.model_id)
        seq = request.seq_id if request.seq_id > 0 else None
        with model.lane.numbered(seq):  # a 400 before the call is queued
            v2 = request.loss_fn_config_v2
            config: dict[str, Any] = {k: (v.text if v.WhichOneof("value") == "text" else v.number)
                                      for k, v in v2.items()} or dict(request.loss_fn_config)
            spec, values = losses.spec(request.loss_fn, config)
            rows = datums.rows(request.data, spec, self.vocab_size, self.max_tokens)
        backward = not request.forward_only

        def call() -> bytes:
            training = self.ready(request.model_id)
            out = training.forward(rows, request.loss_fn, values, backward)
            self._log(model, f"tinker/{'forward_backward' if backward else 'forward'}",
                      {"tokens": out.tokens, "seconds": out.seconds}, out.metrics)
            return forward_output(out.logprobs, out.metrics)

        return model.lane.submit(seq, raw, call), request.model_id

    def optim_step(self, body: dict[str, Any], raw: bytes) -> str:
        model_id = wire.get(body, "model_id", str)
        model, seq = self.get(model_id), wire.get(body, "seq_id", int, None)
        with model.lane.numbered(seq):
            adam = adam_step(body)

        def call() -> dict[str, Any]:
            training = self.ready(model_id)
            metrics = training.optim_step(adam)
            self._log(model, "tinker/optim_step", {"learning_rate": adam.learning_rate}, metrics)
            return {"metrics": metrics, "type": "optim_step"}

        return model.lane.submit(seq, raw, call)

    def _log(self, model: Model, prefix: str, values: dict[str, float], metrics: dict[str, float]) -> None:
        if model.run is None or model.training is None:
            return
        named = {f"{prefix}/{k.split(':')[0]}": v for k, v in metrics.items()}
        model.run.metrics(named | {f"{prefix}/{k}": v for k, v in values.items()}, model.training.steps)

    # ---- checkpoints ---------------------------------------------------------------------------

    def save_state(self, body: dict[str, Any], raw: bytes) -> str:
        model_id = wire.get(body, "model_id", str)
        model, seq = self.get(model_id), wire.get(body, "seq_id", int, None)
        with model.lane.numbered(seq):
            model.saves += 1
            name = wire.check_name(wire.get(body, "path", str, f"state-{model.saves}"), "path")
            overwrite = wire.get(body, "overwrite", bool, False)
            ttl = wire.nonneg(body, "ttl_seconds", int, None)
            directory = self.store.checkpoint_dir(model_id, "weights", name)
            if directory.exists() and not overwrite:
                raise BadRequest(f"checkpoint {name!r} of {model_id} exists (send overwrite=true)", "path")

        def call() -> dict[str, Any]:
            training = self.ready(model_id)
            directory.mkdir(parents=True, exist_ok=True)
            training.save(directory)
            path = self.store.saved(model_id, "weights", name, ttl)
            if model.run is not None:
                model.run.checkpoint(directory, name)
            return {"path": path, "type": "save_weights"}

        return model.lane.submit(seq, raw, call)

    def save_for_sampler(self, body: dict[str, Any], raw: bytes,
                         on_saved: Callable[[str, int, Path], str]) -> str:
        """Named (`path`): a tinker:// path of sampler weights; else a sampling session of
        them (`on_saved(model_id, sampling_session_seq_id, directory)` registers it: its id)."""
        model_id = wire.get(body, "model_id", str)
        model, seq = self.get(model_id), wire.get(body, "seq_id", int, None)
        with model.lane.numbered(seq):
            name, sampling_seq = body.get("path"), None
            if name is None:
                sampling_seq = wire.nonneg(body, "sampling_session_seq_id", int, MISSING)
                model.ephemeral += 1
                name = f"ephemeral-{model.ephemeral}"
            wire.check_name(wire.get(body, "path", str, name), "path")
            directory = self.store.checkpoint_dir(model_id, "sampler_weights", name)
            ttl = wire.nonneg(body, "ttl_seconds", int, None)

        def call() -> dict[str, Any]:
            training = self.ready(model_id)
            training.save_sampler_weights(directory)
            (directory / PROBE_FILE).write_text(json.dumps(probe(training)))
            if sampling_seq is not None:
                session = on_saved(model_id, sampling_seq, directory)
                self._drop_old_ephemeral(model_id, model.ephemeral)
                return {"sampling_session_id": session, "type": "save_weights_for_sampler"}
            return {"path": self.store.saved(model_id, "sampler_weights", name, ttl),
                    "type": "save_weights_for_sampler"}

        return model.lane.submit(seq, raw, call)

    def _drop_old_ephemeral(self, model_id: str, latest: int) -> None:
        old = self.store.checkpoint_dir(model_id, "sampler_weights", f"ephemeral-{latest - KEEP_EPHEMERAL}")
        if old.is_dir():
            import shutil

            shutil.rmtree(old, ignore_errors=True)


def adam_step(body: dict[str, Any]) -> AdamStep:
    """optim_step's `adam_params` (all six fields as the SDK sends them), checked."""
    if "optimizer_params" in body:
        raise BadRequest("optimizer_params (a non-Adam optimizer) is not served: send adam_params",
                         "optimizer_params")
    params = body.get("adam_params")
    if not isinstance(params, dict):
        raise BadRequest("adam_params is missing", "adam_params")
    adam = AdamStep(**{k: wire.get(params, k, float, v, "adam_params.") for k, v in vars(AdamStep()).items()})
    if adam.learning_rate < 0 or adam.eps < 0 or adam.weight_decay < 0 or not (
            0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
        raise BadRequest(f"adam_params out of range: {vars(adam)}", "adam_params")
    return adam


def probe(training: TrainingModel) -> dict[str, list]:
    """A fixed token sequence and the trainer's logprobs of it (temperature 1), to verify the
    engine's copy of these weights (sampler.py)."""
    n = min(PROBE_TOKENS, training.max_tokens)
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, training.vocab_size, (n + 1,), generator=seeded).tolist()
    batch = TrainBatch.of_tokens([tokens[:-1]], [tokens[1:]], [[1.0] * n], [[0.0] * n], training.layout)
    logprobs = training.trainer.learner.policy.logprobs(batch)[0, :n].cpu().tolist()
    return {"tokens": tokens, "logprobs": logprobs}
