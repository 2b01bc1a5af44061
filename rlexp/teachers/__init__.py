"""On-policy distillation's teachers: a model that scores the student's sampled tokens
(rlexp.protocols.Teacher). `local`: the teacher in its own vLLM engine (local.py); `openai`:
any OpenAI-compatible server that returns prompt logprobs (openai.py). scoring.py scores each
completed sample as it comes out of the agent; align.py maps a teacher with another tokenizer
onto the student's tokens through the text; check.py refuses a bad teacher before any engine
starts, served.py a server whose tokenizer is not the one the run reads its scores with;
serve.py is the command that starts a teacher server."""
