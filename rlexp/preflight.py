"""What a run checks first, importing nothing heavy (no torch, transformers' models, vLLM or
MLflow), so that bad input fails in about a second instead of after ten seconds of imports:

1. the config: every `_target_` and its arguments, read from rlexp's source (rlexp/signatures.py);
2. the data: the files are read and every row checked (file, line, key);
3. prompt lengths, with the model directory's own tokenizer.json and chat template.

The full config check (rlexp.config.validate) runs again after the imports, for what the
source cannot tell; lengths are counted there with transformers' tokenizer only where the
directory has no tokenizer.json or template this reads. Tests check both paths agree."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from rlexp.chat import tool_prompt
from rlexp.chat.render import encode, render_chat
from rlexp.config import validate, validate_data, validate_lengths
from rlexp.data.manager import DataManager
from rlexp.errors import ConfigError
from rlexp.evaluator import Evaluator
from rlexp.tools import tool_specs

log = logging.getLogger("rlexp")


@dataclass
class Inputs:
    data: DataManager
    eval_data: DataManager
    evaluator: Evaluator
    model_path: str
    lengths_checked: bool = False  # by the light tokenizer: the loop need not count them again


def load_inputs(cfg: DictConfig) -> Inputs:
    """The train and eval data and the model directory (built on first use for model=tiny)."""
    try:
        source = instantiate(cfg.data.source)
    except InstantiationException as e:
        raise ConfigError(f"data.source: {e.__cause__ or e}") from e
    data = instantiate(cfg.data, source=source, split="train")
    evaluator = instantiate(cfg.evaluator)
    n_source = len(source.problems("eval"))
    if evaluator.prompts is not None and evaluator.prompts > n_source:
        raise ConfigError(f"evaluator.prompts={evaluator.prompts} is more than the eval split has "
                          f"({n_source}); use null for the whole split")
    eval_data = instantiate(cfg.data, source=source, split="eval",
                            prompts_per_step=evaluator.prompts or n_source,
                            samples_per_prompt=evaluator.samples_per_prompt)
    validate_data(cfg, len(data), len(eval_data))
    return Inputs(data, eval_data, evaluator, model_path=instantiate(cfg.model))


def check_lengths(cfg: DictConfig, inputs: Inputs, tokenizer) -> None:
    """Prompts as the agent will send them: with its tools' specs where it has tools."""
    tools = tool_specs(cfg.agent.get("tools") or [])
    path = tool_prompt.resolve(tokenizer, cfg.agent.get("tool_prompt", "template"))
    for split, dm in (("train", inputs.data), ("eval", inputs.eval_data)):
        lengths = [(len(encode(tokenizer, render_chat(tokenizer, p.messages, tools, tool_prompt=path))),
                    p.where or f"{split} prompt {i}") for i, p in enumerate(dm.problems)]
        validate_lengths(cfg, lengths, split)


def preflight(cfg: DictConfig) -> Inputs:
    validate(cfg, static=True)
    inputs = load_inputs(cfg)
    tokenizer = LightTokenizer.load(inputs.model_path)
    if tokenizer is not None:
        check_lengths(cfg, inputs, tokenizer)
        inputs.lengths_checked = True
    return inputs


class LightTokenizer:
    """A model directory's fast tokenizer (tokenizer.json) and chat template, rendered as
    transformers renders it (same jinja2 settings and globals), without importing transformers."""

    def __init__(self, backend, template, special_tokens: dict[str, Any], chat_template: str):
        self.backend_tokenizer, self.template, self.special_tokens = backend, template, special_tokens
        self.chat_template = chat_template  # the source, as on a transformers tokenizer

    @classmethod
    def load(cls, model_path: str) -> LightTokenizer | None:
        """None where the directory has no tokenizer.json or chat template this can render."""
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        path = Path(model_path)
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
            source = config.get("chat_template")
            if (path / "chat_template.jinja").is_file():
                source = (path / "chat_template.jinja").read_text()
            if isinstance(source, list):  # named templates
                source = {t["name"]: t["template"] for t in source}.get("default")
            if not isinstance(source, str):
                return None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            template = env.from_string(source)
            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # a layout this does not read: the full check after the imports covers it
            log.debug("preflight: no light tokenizer for %s (%s)", model_path, e)
            return None
        special = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}
        return cls(backend, template, special, source)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs) -> str:
        assert not tokenize
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens, **kwargs)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise ValueError(message)
