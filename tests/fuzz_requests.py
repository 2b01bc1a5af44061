"""Random request bodies for the server fuzz (tests/server_vllm/test_random_requests.py): whole random JSON,
valid requests with one field replaced, sampling fields at their bounds, near-valid
structured outputs and tools, random messages, raw bytes, and streamed variants of these."""

from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10)
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
          "stop", "stream", "tools", "tool_choice", "session_id", "prompt", "add_generation_prompt",
          "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
          "response_format", "parallel_tool_calls", "user", "metadata", "echo", "best_of", "suffix"]
SCHEMA_KEYS = ["type", "properties", "required", "enum", "items", "maxLength", "minimum"]
SCHEMA = st.dictionaries(st.sampled_from(SCHEMA_KEYS), JSON, max_size=3) | st.just({"type": "object"})
# near-valid values of the structured fields, on their own or with a forced call
STRUCTURED = {
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
    | st.builds(lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                SCHEMA),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "127", "128", "99999", "-1", "x"]),
                                  st.sampled_from([-101, -100, 0, 5.5, 100, 101]) | JSON, max_size=3),
    "tools": st.lists(st.builds(lambda params, strict: {"type": "function", "function": {
        "name": "f", "parameters": params, "strict": strict}}, SCHEMA, st.booleans() | JSON), max_size=2),
}
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.text(max_size=8)
    | JSON,
    "content": st.text(max_size=30) | JSON, "tool_calls": JSON, "name": st.text(max_size=8)})
NUMBERS = [0, 1, -1, 2, 16, 17, 490, 491, 10**9, 2**63 - 1, 2**63, 2**64, 0.5, 1e-9, 2.0, 2.5, True]
VALID_CHAT = {"model": "policy", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4}
VALID_COMPLETION = {"model": "policy", "prompt": "12+34=", "max_tokens": 4}


@st.composite
def requests(draw):
    """(path, JSON body or raw bytes): whole random bodies, and valid requests with one field
    replaced by a random value or random messages."""
    path = draw(st.sampled_from(["/chat/completions"] * 4 + ["/completions", "/../tokenize"]))
    kind = draw(st.sampled_from(["random", "field", "number", "number", "messages", "bytes", "structured",
                                 "stream", "stream"]))
    base = dict(VALID_COMPLETION if path == "/completions" else VALID_CHAT)
    if kind == "stream":  # the same kinds of request, streamed (stream_options near-valid too)
        options = st.sampled_from([{"include_usage": True}, {"include_usage": False}, {}]) | JSON
        base |= {"stream": True} | draw(st.sampled_from([{}]) | st.builds(lambda o: {"stream_options": o},
                                                                           options))
        kind = draw(st.sampled_from(["field", "number", "structured", "valid"]))
        if kind == "valid":
            return path, base
    if kind == "random":
        return path, draw(JSON)
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "messages":
        return path, base | {"messages": draw(st.lists(MESSAGE, max_size=3))}
    if kind == "structured":  # constraints and tools, near-valid, on their own or forced
        field = draw(st.sampled_from(sorted(STRUCTURED)))
        extra = draw(st.sampled_from([{}, {"tool_choice": "required"}, {"tool_choice": "none"},
                                      {"parallel_tool_calls": False}]))
        return path, base | {field: draw(STRUCTURED[field])} | (extra if field == "tools" else {})
    if kind == "number":  # a sampling field at or around its bounds
        field = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                                      "seed", "frequency_penalty", "presence_penalty", "top_logprobs"]))
        value = draw(st.sampled_from(NUMBERS) | st.integers(-(10**20), 10**20) | st.floats())
        return path, base | {field: value}
    return path, base | {draw(st.sampled_from(FIELDS) | st.text(max_size=8)): draw(JSON)}
