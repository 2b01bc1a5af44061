"""The HTTP server on real vLLM (tests/server_vllm/): one engine for the whole package.

Its tests are split into modules by what they test, and all of them need the engine: the
fixture is package-scoped so that the engine starts once for them all, as it did when they
were one module."""

import pytest

from tests.server_vllm.helpers import chat_server_on_vllm


@pytest.fixture(scope="package")
def vllm_server(tiny_model_path, tokenizer):
    """One real vLLM engine behind the HTTP server for the package, on an event loop in a
    background thread, so that tests can call it with blocking clients."""
    with chat_server_on_vllm(tiny_model_path, tokenizer) as server:
        yield server
