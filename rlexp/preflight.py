"""What a run checks first, importing nothing heavy (no torch, transformers' models, vLLM or
MLflow), so that bad input fails in about a second instead of after ten seconds of imports
(measured: the docstrings of rlexp/signatures.py and LightTokenizer):

1. the config: every `_target_` and its arguments, read from rlexp's source (rlexp/signatures.py);
2. the data: the files are read and every row checked (file, line, key), images decoded;
3. data with images needs a vision-language model directory (from its JSON files);
4. prompt lengths, with the model directory's own tokenizer.json and chat template; a prompt
   with images, with the directory's processor (ImageTokens), which imports transformers, so
   only data with images pays for it, and only after the checks above.

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
from omegaconf import DictConfig, OmegaConf

from rlexp.chat import tool_prompt
from rlexp.chat.render import encode, render_chat
from rlexp.config import validate, validate_data, validate_lengths
from rlexp.config_components import member
from rlexp.data.hub import snapshot_commit
from rlexp.data.manager import DataManager
from rlexp.data.sources import PromptSource
from rlexp.errors import ConfigError, config_error_unwrapped
from rlexp.evaluator import Evaluator
from rlexp.messages import split_images
from rlexp.teachers.check import check_teacher
from rlexp.tools import tool_specs

log = logging.getLogger("rlexp")


@dataclass
class Inputs:
    data: DataManager
    eval_data: DataManager
    evaluator: Evaluator
    model_path: str
    model_commit: str | None = None  # the hub commit a model=local hub id resolved to
    data_commit: str | None = None  # the hub commit data=hub resolved to (a source's `commit`)
    lengths_checked: bool = False  # by the light tokenizer: the loop need not count them again
    has_images: bool = False  # some prompt has images (the full config check asks the components)


def load_inputs(cfg: DictConfig) -> Inputs:
    """The train and eval data and the model directory (built on first use for model=tiny; a hub
    id's snapshot for model=local)."""
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
    model_path = _model_path(cfg)
    data_commit = member(source, "data.source._target_", PromptSource, "commit")
    inputs = Inputs(data, eval_data, evaluator, model_path=model_path,
                    model_commit=snapshot_commit(model_path), data_commit=data_commit)
    _pin_revision(cfg.model, inputs.model_commit)
    _pin_revision(cfg.data.source, inputs.data_commit)
    return inputs


def _pin_revision(node: DictConfig, commit: str | None) -> None:
    """A hub id resolved at a branch or tag (null: main) is kept in the config, which the run
    saves and logs, as the commit it resolved to: a resumed run reads that same snapshot,
    wherever the branch has moved since."""
    if commit is not None and "revision" in node:
        node.revision = commit


def _model_path(cfg: DictConfig) -> str:
    """The model's directory from its `_target_` (model=local resolves a hub id here, once, on
    the driver); a ConfigError it raises (a missing directory, a hub id not in the cache offline)
    reaches the user as its one line."""
    with config_error_unwrapped():
        return instantiate(cfg.model)


def check_lengths(cfg: DictConfig, inputs: Inputs, tokenizer) -> None:
    """Prompts as the agent will send them: with its tools' specs where it has tools; a prompt
    with images as the model's processor expands it (ImageTokens), named with its counts."""
    tools = tool_specs(cfg.agent.get("tools") or [])
    path = tool_prompt.resolve(tokenizer, cfg.agent.get("tool_prompt", "template"))
    images = ImageTokens.load(cfg, inputs) if _has_images(inputs) else None
    for split, dm in (("train", inputs.data), ("eval", inputs.eval_data)):
        lengths = []
        for i, p in enumerate(dm.problems):
            where = p.where or f"{split} prompt {i}"
            if images is not None and split_images(p.messages)[1]:
                lengths.append(images.length(p.messages, where, tools, path))
            else:
                text = render_chat(tokenizer, p.messages, tools, tool_prompt=path)
                lengths.append((len(encode(tokenizer, text)), where))
        validate_lengths(cfg, lengths, split)


def check_vision(cfg: DictConfig, inputs: Inputs) -> None:
    """Data with images needs a vision-language model: a `vision_config` in the directory's
    config.json and an image processor. Read from its JSON files (nothing heavy imported)."""
    if not _has_images(inputs):
        return
    reason = _not_vision(Path(inputs.model_path))
    if reason:
        source = OmegaConf.select(cfg, "data.source._target_")
        path = OmegaConf.select(cfg, "data.source.train_path", default=None)
        raise ConfigError(f"data.source ({source}{f', train_path={path}' if path else ''}) has images, "
                          f"but the model at {inputs.model_path} is not a vision-language model "
                          f"({reason}); use one, e.g. model=vlm")


def _not_vision(path: Path) -> str | None:
    """Why the model directory `path` takes no images, or None."""
    if "vision_config" not in _json_or_empty(path / "config.json"):
        return "its config.json has no vision_config"
    if not (path / "preprocessor_config.json").is_file() and \
            "image_processor" not in _json_or_empty(path / "processor_config.json"):
        return ("it has no image processor: no preprocessor_config.json, no image_processor in "
                "processor_config.json")
    return None


def _json_or_empty(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _has_images(inputs: Inputs) -> bool:
    return any(split_images(p.messages)[1] for dm in (inputs.data, inputs.eval_data) for p in dm.problems)


class ImageTokens:
    """Lengths of prompts with images as the single-turn agent renders them
    (rlexp/chat/images.py): the processor's chat template, each image's placeholder expanded
    by the processor into that image's tokens. An image's expansion depends on its size only,
    so it is measured once per size (a blank image of that size), and a prompt's length is its
    text's tokens plus its images' expansions; the sum is checked against the processor's own
    count of the first prompt, and where they differ every prompt goes through the processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.placeholder: str | None = getattr(processor, "image_token", None)
        self._placeholder_tokens = len(encode(processor.tokenizer, self.placeholder or "")) or 1
        self._expansion: dict[tuple[int, int], int] = {}
        self._summed: bool | None = None  # the sum is the processor's count (set at the first prompt)

    @classmethod
    def load(cls, cfg: DictConfig, inputs: Inputs) -> ImageTokens:
        """The model directory's processor (transformers, no weights), after check_vision."""
        check_vision(cfg, inputs)
        from transformers import AutoProcessor

        try:
            return cls(AutoProcessor.from_pretrained(inputs.model_path))
        except Exception as e:  # a processor transformers cannot build here
            raise ConfigError(f"{inputs.model_path}: cannot load its processor to count image tokens "
                              f"({type(e).__name__}: {' '.join(str(e).split())})") from e

    def length(self, messages: list[dict[str, Any]], where: str, tools: list | None = None,
               path: tool_prompt.ToolPath = "template") -> tuple[int, str]:
        """(the prompt's tokens, `where` with its text and image tokens and its images)."""
        bare, images = split_images(messages)
        text = render_chat(self.processor.tokenizer, bare, tools, tool_prompt=path)
        n_text = len(encode(self.processor.tokenizer, text)) - len(images) * self._placeholder_tokens
        if self._summed is None:
            self._summed = bool(self.placeholder) and self._sum(n_text, images) == self._full(text, images)
        n = self._sum(n_text, images) if self._summed else self._full(text, images)
        return n, f"{where}: {n_text} text + {n - n_text} image tokens for {len(images)} image(s)"

    def _sum(self, n_text: int, images: list[Any]) -> int:
        return n_text + sum(self._expanded(image.size) for image in images)

    def _expanded(self, size: tuple[int, int]) -> int:
        """The tokens the processor makes of one image of `size` (its placeholder included)."""
        if size not in self._expansion:
            from PIL import Image

            blank = Image.new("RGB", size)
            self._expansion[size] = self._full(str(self.placeholder), [blank])
        return self._expansion[size]

    def _full(self, text: str, images: list[Any]) -> int:
        return len(self.processor(text=text, images=images, add_special_tokens=False)["input_ids"][0])


def preflight(cfg: DictConfig) -> Inputs:
    validate(cfg, static=True)
    inputs = load_inputs(cfg)
    check_teacher(cfg, inputs.model_path)  # its vocabulary, its server: before any engine starts
    inputs.has_images = _has_images(inputs)
    check_vision(cfg, inputs)
    tokenizer = LightTokenizer.load(inputs.model_path)
    if tokenizer is not None:
        check_lengths(cfg, inputs, tokenizer)
        inputs.lengths_checked = True
    return inputs


class LightTokenizer:
    """A model directory's fast tokenizer (tokenizer.json) and chat template, rendered as
    transformers renders it (same jinja2 settings and globals), without importing transformers.

    Measured 2026-11-26 on a busy 2-core CPU machine (transformers 5.19, medians of 3 fresh
    processes, after `import rlexp.preflight`, loading model=tiny's directory, rendering and
    encoding one prompt): this 0.03 s; `transformers.AutoTokenizer.from_pretrained` 7.6 s.
    transformers' own template compiler alone (`python -c "from
    transformers.utils.chat_template_utils import _compile_jinja_template"`) takes 2.1 s, more
    than the 2 s a bad config may take to fail (`python -m rlexp.run trainer.workers=0`:
    0.7-0.9 s). tests/test_preflight.py checks both render alike."""

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
