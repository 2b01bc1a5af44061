"""What a run checks of its teacher before any engine starts (rlexp/preflight.py): the
teacher's model directory, its vocabulary against the student's (a different one is refused
unless `teacher.align` maps it through the text), and (teacher=openai) that the server answers,
serves `teacher.model` and uses the tokenizer the run reads its scores with (served.py). It
reads tokenizer.json files and asks the server: no torch or vLLM, and transformers only for a
directory without a tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlexp.errors import ConfigError, config_error_unwrapped


def check_teacher(cfg: DictConfig, student_path: str) -> None:
    """ConfigError, one line, for a teacher that cannot score this run's samples."""
    node = cfg.get("teacher")
    if node is None:
        return
    for key in ("model_path", "model"):
        if key in node.keys() and OmegaConf.is_missing(node, key):
            what = "the teacher's model directory" if key == "model_path" else "the served model's name"
            raise ConfigError(f"teacher.{key} is required (teacher={_choice(node)}): {what}")
    teacher_path = node.get("model_path") or node.get("tokenizer")
    if node.get("align") and teacher_path is None:
        raise ConfigError("teacher.align=true needs the teacher's tokenizer: "
                          "set teacher.tokenizer=<its directory>")
    if teacher_path is not None:
        if not (Path(teacher_path) / "config.json").is_file() and "model_path" in node:
            raise ConfigError(f"teacher.model_path={teacher_path}: no model directory (config.json) there")
        check_vocabularies(student_path, str(teacher_path), bool(node.get("align")))
    if "base_url" in node:
        from rlexp.teachers.openai import CHECK_TIMEOUT_S
        from rlexp.teachers.served import check_served_tokenizer

        with config_error_unwrapped():
            teacher = instantiate(node)
        try:
            length = OmegaConf.select(cfg, "rollout.max_model_len")
            teacher.check(length + 1 if isinstance(length, int) else "<n>")  # a sequence and one token
            check_served_tokenizer(teacher, student_path, CHECK_TIMEOUT_S)
        finally:
            teacher.shutdown()


def check_vocabularies(student_path: str, teacher_path: str, align: bool) -> None:
    """The teacher scores the student's token ids only if both tokenizers map every token to
    the same id; otherwise only `align` (re-tokenize the text, align.py) can use it."""
    student, teacher = vocabulary(student_path), vocabulary(teacher_path)
    if student is None or teacher is None or student == teacher or align:
        return
    differ = sorted(set(student.items()) ^ set(teacher.items()))[:2]
    raise ConfigError(f"the teacher's vocabulary ({teacher_path}: {len(teacher)} tokens) differs from "
                      f"the student's ({student_path}: {len(student)} tokens), e.g. {differ}: set "
                      "teacher.align=true to map the teacher's logprobs onto the student's tokens "
                      "through the text")


def vocabulary(path: str) -> dict[str, int] | None:
    """token -> id of a directory's tokenizer.json (its model's vocabulary and added tokens);
    None when there is no tokenizer.json to read."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    spec = json.loads(file.read_text())
    vocab = dict(spec.get("model", {}).get("vocab", {}))
    vocab |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    return vocab


def _choice(node: DictConfig) -> str:
    return "local" if "model_path" in node.keys() else "openai"
