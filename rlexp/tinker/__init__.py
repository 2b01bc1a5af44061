"""The Tinker API server (`rlexp tinker`): the `tinker` SDK's training and sampling calls served
by rlexp's own update stages and vLLM engine (docs/tinker.md). server.py builds it; app.py is the
HTTP side, service.py and models.py the state and the calls, training.py the update."""
