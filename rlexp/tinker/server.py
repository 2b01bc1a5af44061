"""`rlexp tinker` / `python -m rlexp.tinker`: the Tinker API server, configured by Hydra like a
run (conf/tinker.yaml: model, trainer, LoRA, precision, rollout, tracking). Point the `tinker`
SDK at it with TINKER_BASE_URL=http://<host>:<port> and any TINKER_API_KEY starting with
`tml-` (the server checks it only when `tinker.api_key` is set)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import uvicorn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import rlexp.config  # noqa: F401 - registers the ${rlexp.*} resolvers the configs use
from rlexp.chat.server import _is_loopback
from rlexp.tinker.app import create_app
from rlexp.tinker.base import served_copy
from rlexp.tinker.futures import Futures
from rlexp.tinker.models import LORA_PARTS, Models
from rlexp.tinker.sampler import Sampler
from rlexp.tinker.service import Service
from rlexp.tinker.store import Store
from rlexp.tinker.tracking import ModelRun
from rlexp.tinker.training import ServedAdapter, TrainingModel
from rlexp.trainer.sync_check import resolve_bound

log = logging.getLogger(__name__)


def build(cfg: DictConfig) -> Service:
    """The service: the served copy of the model, its vLLM engine, the model store. Call it in
    the event loop that will serve it (the engine's)."""
    from transformers import AutoConfig

    t = cfg.tinker
    state = Path(t.state_dir)
    base_dir = served_copy(Path(instantiate(cfg.model)), state / "base")
    config = AutoConfig.from_pretrained(base_dir)
    vocab_size, positions = config.vocab_size, config.max_position_embeddings
    engine = instantiate(cfg.rollout, model_path=str(base_dir))
    store, futures = Store(state), Futures()
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)

    seeding = threading.Lock()  # models are built on their own threads; torch's generator is global

    def build_model(model_id: str, meta: dict[str, Any], seed: int | None) -> tuple[TrainingModel, ModelRun]:
        targets = [m for part, on in meta["lora_parts"].items() if on for m in LORA_PARTS[part]]
        lora = {"rank": meta["lora_rank"], "alpha": cfg.trainer.lora.alpha, "target_modules": targets}
        with seeding:
            torch.manual_seed(cfg.seed if seed is None else seed)  # the LoRA adapters' initialisation
            trainer = instantiate(cfg.trainer, model_path=str(base_dir), lora=lora)
        adapter = served_adapter(meta, lora, cfg.rollout.max_lora_rank, engine.adapts_unembedding)
        training = TrainingModel(model_id, trainer, t.base_model, meta["lora_rank"], vocab_size,
                                 positions - 1, cfg.trainer.micro_batch_tokens, adapter)
        params = {"tinker": {"model_id": model_id, "base_model": t.base_model, "model_dir": str(base_dir),
                             "lora": lora | {"seed": seed}, "user_metadata": meta.get("user_metadata")},
                  "trainer": trainer_cfg}
        run = ModelRun(cfg.logger.tracking_uri, t.experiment_name, model_id, params,
                       {"rlexp.tinker.model_id": model_id}, cfg.logger.artifact_location, t.log_checkpoints,
                       run_id=store.meta(model_id).get("mlflow_run_id"))
        store.record(model_id, mlflow_run_id=run.run_id)
        return training, run

    models = Models(t.base_model, store, futures, build_model, vocab_size, positions - 1,
                    cfg.rollout.max_lora_rank, t.max_models, engine.adapts_unembedding)

    def on_sync(weights: Path, figures: dict[str, float]) -> None:
        model = models.models.get(weights.parent.parent.name)
        if model is not None and model.run is not None and model.training is not None:
            model.run.metrics(figures, model.training.steps)

    bound = resolve_bound(cfg.trainer.sync_check.bound, [cfg.trainer.dtype, cfg.rollout.dtype])
    sampler = Sampler(engine, base_dir, float("inf") if bound is None else bound, on_sync,
                      cfg.rollout.max_cpu_loras)
    return Service(t.base_model, models, sampler, store, vocab_size, cfg.rollout.max_model_len, t.poll_s,
                   str(base_dir.resolve()), t.session_timeout_s)


def served_adapter(meta: dict[str, Any], lora: dict[str, Any], engine_rank: int,
                   adapts_unembedding: bool) -> ServedAdapter | None:
    """A LoRA model's sampler weights are its adapter where the engine serves adapters, and
    where it trains the unembedding (Tinker's default) only if the engine adapts that too
    (vLLM does for Llama's classes, not for Qwen2's: `VLLMEngine.adapts_unembedding`). Else the
    model is sampled as a whole model, merged (one engine load per switch)."""
    merged = meta["lora_parts"]["train_unembed"] and not adapts_unembedding
    if not meta["lora_rank"] or not engine_rank or merged:
        return None
    return ServedAdapter(meta["lora_rank"], lora["alpha"], tuple(lora["target_modules"]))


async def serve(cfg: DictConfig) -> None:
    t = cfg.tinker
    if not _is_loopback(t.host) and not t.api_key:
        raise ValueError(f"refusing to serve the Tinker API on {t.host} without tinker.api_key "
                         "(only loopback addresses may go without one)")
    service = build(cfg)
    app = create_app(service, t.api_key, int(t.max_body_mb * 2**20))
    server = SignalledServer(uvicorn.Config(app, host=t.host, port=t.port, log_level="warning",
                                            lifespan="off", access_log=False))
    task = server.serve()
    log.info("tinker: serving %s", t.base_model)
    reaper = asyncio.ensure_future(_expire_sessions(service))
    try:
        await _announce(server, task, t.host, t.base_model)
    finally:
        reaper.cancel()
        for model in service.models.models.values():
            model.lane.close()
            if model.run is not None:
                model.run.end("FINISHED" if server.stopped_by is None else "KILLED")
        service.sampler.engine.shutdown()
    if server.stopped_by is not None:  # die of it, as uvicorn would have, now that all is ended
        signal.raise_signal(server.stopped_by)


class SignalledServer(uvicorn.Server):
    """uvicorn's server, which stops serving at SIGINT or SIGTERM and keeps the signal in
    `stopped_by`. uvicorn itself raises the signal again as `serve` returns, which ends the
    process before the caller's cleanup (the models' MLflow runs stayed RUNNING)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopped_by = sig
        super().handle_exit(sig, frame)


async def _expire_sessions(service: Service) -> None:
    """Release the models of clients that went away without closing their session."""
    while True:
        await asyncio.sleep(min(service.session_timeout_s / 4, 30))
        for session_id in await service.expire():
            log.warning("tinker: session %s expired (no heartbeat or call for %g s): its models released",
                        session_id, service.session_timeout_s)


async def _announce(server: uvicorn.Server, serving: Any, host: str, base_model: str) -> None:
    task = asyncio.ensure_future(serving)
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"rlexp tinker: serving {base_model} on http://{host}:{port} "
              f"(TINKER_BASE_URL=http://{host}:{port})", flush=True)
    await task
