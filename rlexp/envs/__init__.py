"""Environments from other libraries, run in their own Python (their own venv) as child
processes that speak to rlexp over pipes and HTTP: verifiers environments, OpenEnv servers."""
