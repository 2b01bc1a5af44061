"""rlexp/teachers/align.py: a teacher with another tokenizer mapped onto the student's tokens
through the text; rlexp/models/tiny_bpe.py: the tiny BPE teacher tokenizer and model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlexp.data import arithmetic
from rlexp.errors import TeacherError
from rlexp.models.tiny import _conversation, _encode_conversation, build_char_tokenizer, tool_call_text
from rlexp.models.tiny_bpe import build_bpe_model, build_bpe_tokenizer
from rlexp.sample import PromptLogprobs
from rlexp.teachers.align import align, scores_on_student, student_spans


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


def _teacher(n: int, seed: int = 0) -> PromptLogprobs:
    """Distinct logprobs for a teacher sequence of n tokens."""
    rng = random.Random(seed)
    return PromptLogprobs([-rng.uniform(0.1, 5.0) for _ in range(n - 1)])


def _encoded(tokenizer, question: str, answer: str, fmt: str) -> tuple[list[int], list[int]]:
    """The tiny task's conversation as the warm-start builds it: (token ids, loss mask)."""
    ids, labels = _encode_conversation(tokenizer, _conversation(question, answer, fmt))
    return ids, [int(label != -100) for label in labels]


def test_same_tokenizer_is_one_to_one_and_exact(char):
    ids, mask = _encoded(char, "12+34=", "46", "answer")
    alignment = align(ids, char, char)
    assert alignment.teacher_ids == ids
    assert alignment.groups == [(range(k, k + 1), range(k, k + 1)) for k in range(len(ids))]
    teacher = _teacher(len(ids))
    scores, aligned, trained = scores_on_student(alignment, teacher, mask)
    assert trained == sum(mask) == 3  # "4", "6", <|im_end|>
    assert aligned == trained
    for t in range(len(ids)):
        assert scores.scored[t] == mask[t]
        assert scores.logprobs[t] == (teacher.logprobs[t - 1] if mask[t] else 0.0)
    assert scores.top_ids is None and scores.top_logprobs is None


def test_char_student_bpe_teacher_groups_cover_the_same_text(char, bpe):
    ids, mask = _encoded(char, "12+34=", "46", "tool")
    text, spans = student_spans(char, ids)
    assert text == char.decode(ids, skip_special_tokens=False) and "<tool_call>" in text
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a < b == c for (a, b), (c, _) in zip(spans, spans[1:]))  # contiguous, none empty
    assert [text[a:b] for a, b in spans] == [char.decode([i], skip_special_tokens=False) for i in ids]
    alignment = align(ids, char, bpe)
    assert alignment.teacher_ids == bpe.encode(text, add_special_tokens=False)
    assert len(alignment.teacher_ids) < len(ids)
    # every bpe token is whole characters: one group per teacher token, the student's in order
    assert [t for _, t in alignment.groups] == [range(j, j + 1) for j in range(len(alignment.teacher_ids))]
    assert [i for s, _ in alignment.groups for i in s] == list(range(len(ids)))
    for s, t in alignment.groups:
        assert char.decode([ids[i] for i in s]) == bpe.decode([alignment.teacher_ids[j] for j in t])


def test_many_to_one_group_shares_the_teacher_logprob(char, bpe):
    ids, mask = _encoded(char, "7*8=", "56", "tool")
    alignment = align(ids, char, bpe)
    teacher = _teacher(len(alignment.teacher_ids))
    scores, aligned, trained = scores_on_student(alignment, teacher, mask)
    (s, t), = [(s, t) for s, t in alignment.groups if char.decode([ids[i] for i in s]) == "calculator"]
    assert len(s) == 10 and len(t) == 1
    lp = teacher.logprobs[t[0] - 1]
    assert [scores.logprobs[i] for i in s] == [lp / 10] * 10 and [scores.scored[i] for i in s] == [1] * 10
    assert math.isclose(sum(scores.logprobs[i] for i in s), lp)
    # "assistant" in the header: 9:1, prompt text, not scored
    (s, t), = [(s, t) for s, t in alignment.groups if char.decode([ids[i] for i in s]) == "assistant"][:1]
    assert len(s) == 9 and len(t) == 1 and not any(scores.scored[i] for i in s)
    assert aligned == trained == sum(mask)
    assert sum(scores.logprobs) == pytest.approx(sum(teacher.logprobs[j - 1] for s, t in alignment.groups
                                                     if all(mask[i] for i in s) for j in t))


def test_aligned_share_on_arithmetic_samples(char, bpe):
    train, _ = arithmetic.split(20, "+-*", 50, 0)
    aligned = trained = multi = 0
    for k, (question, answer) in enumerate(train[:60]):
        ids, mask = _encoded(char, question, answer, "tool" if k % 2 else "answer")
        alignment = align(ids, char, bpe)
        multi += sum(len(s) > 1 for s, _ in alignment.groups)
        teacher = _teacher(len(alignment.teacher_ids), seed=k)
        scores, a, t = scores_on_student(alignment, teacher, mask)
        assert sum(scores.scored) == a and t == sum(mask)
        assert all(lp == 0.0 for lp, m in zip(scores.logprobs, scores.scored) if not m)
        aligned, trained = aligned + a, trained + t
    assert multi > 0  # the tokenizations do differ
    assert aligned / trained >= 0.95


def test_group_mixing_prompt_and_response_is_not_scored(char, bpe):
    ids = char.encode(tool_call_text("1+2="), add_special_tokens=False)
    text = char.decode(ids)
    start = text.index("calculator")
    mask = [0] * (start + 4) + [1] * (len(ids) - start - 4)  # the reply starts inside "calculator"
    alignment = align(ids, char, bpe)
    scores, aligned, trained = scores_on_student(alignment, _teacher(len(alignment.teacher_ids)), mask)
    assert scores.scored[start:start + 10] == [0] * 10 and scores.logprobs[start:start + 10] == [0.0] * 10
    assert scores.scored[start + 10] == 1  # '",' after it: a group of its own
    assert aligned == trained - 6


def test_teacher_token_zero_has_no_logprob(char, bpe):
    ids = char.encode("user\n1+1=", add_special_tokens=False)
    alignment = align(ids, char, bpe)
    assert alignment.groups[0] == (range(0, 4), range(0, 1))  # "user": the teacher's token 0
    teacher = _teacher(len(alignment.teacher_ids))
    scores, aligned, trained = scores_on_student(alignment, teacher, [1] * len(ids))
    assert scores.scored == [0] * 4 + [1] * (len(ids) - 4)
    assert scores.logprobs[4:] == teacher.logprobs and (aligned, trained) == (len(ids) - 4, len(ids))
    with pytest.raises(TeacherError, match="expected"):
        scores_on_student(alignment, PromptLogprobs(teacher.logprobs[:-1]), [1] * len(ids))


def test_multi_byte_characters(char, bpe):
    ids = bpe.encode("x=é∑y", add_special_tokens=False)  # é: 2 byte tokens, ∑: 3
    text, spans = student_spans(bpe, ids)
    assert text == "x=é∑y" and len(ids) == 8
    assert spans == [(0, 1), (1, 2), (2, 2), (3, 3), (3, 3), (3, 3), (4, 4), (4, 5)]
    alignment = align(ids, bpe, bpe)  # the same bytes: each character's bytes one group
    assert [(len(s), len(t)) for s, t in alignment.groups] == [(1, 1), (1, 1), (2, 2), (3, 3), (1, 1)]
    teacher = _teacher(len(ids))
    scores, aligned, trained = scores_on_student(alignment, teacher, [1] * len(ids))
    e_acute = (teacher.logprobs[1] + teacher.logprobs[2]) / 2
    assert scores.logprobs[2] == scores.logprobs[3] == pytest.approx(e_acute)
    assert (aligned, trained) == (len(ids) - 1, len(ids))
    # the char teacher has no "é" nor "∑": their text goes unscored, counted as not aligned
    alignment = align(ids, bpe, char)
    teacher = _teacher(len(alignment.teacher_ids))
    scores, aligned, trained = scores_on_student(alignment, teacher, [1] * len(ids))
    assert scores.scored[1:] == [1] + [0] * 6 and trained == 8
    # a byte that is no UTF-8 (a reply cut inside a character): an empty span, never scored
    cut = bpe.encode("aé", add_special_tokens=False)[:-1] + bpe.encode("b", add_special_tokens=False)
    text, spans = student_spans(bpe, cut)
    assert text == "a\ufffdb" and spans[1][0] == spans[1][1]
    alignment = align(cut, bpe, bpe)
    assert [(s, t) for s, t in alignment.groups] == [(range(0, 1), range(0, 1)), (range(2, 3), range(4, 5))]


def test_token_ending_inside_a_character_closes_no_group(bpe):
    from transformers import Qwen2Tokenizer

    byte_symbols = [bpe.convert_ids_to_tokens(b) for b in range(256)]  # tiny_bpe: byte b is id b
    vocab = {sym: b for b, sym in enumerate(byte_symbols)} | {"aÃ": 256, "<|endoftext|>": 257}
    student = Qwen2Tokenizer(vocab=vocab, merges=[("a", "Ã")])
    ids = [256, vocab["©"]]  # "a" with é's first byte, then é's second byte
    assert student_spans(student, ids) == ("aé", [(1, 1), (2, 2)])  # neither holds whole characters
    alignment = align(ids, student, bpe)
    assert bpe.convert_ids_to_tokens(alignment.teacher_ids) == ["a", "Ã", "©"]
    assert alignment.groups == [(range(0, 2), range(0, 3))]  # not "aÃ" with "a"


def test_tokenizer_that_is_not_byte_level_is_spanned_by_decoding():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁a": 1, "=": 2, "b": 3, "▁": 4, "c": 5, "▁ab": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = [1, 2, 3, 4, 5]  # "a=b c"
    assert student_spans(sp, ids) == ("a=b c", [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])
    assert [(len(s), len(t)) for s, t in align([1, 3, 2], sp, sp).groups] == [(2, 1), (1, 1)]  # "ab": one


def test_bpe_tokenizer_differs_is_deterministic_and_loads_back(tmp_path, char, bpe):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    assert bpe.get_vocab() != char.get_vocab()
    assert {"assistant", "calculator"} <= set(bpe.get_vocab())
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert bpe.convert_tokens_to_ids(list(specials)) != char.convert_tokens_to_ids(list(specials))
    assert bpe.chat_template == char.chat_template and bpe.eos_token == char.eos_token == "<|im_end|>"
    assert build_bpe_tokenizer().get_vocab() == bpe.get_vocab()
    out = build_bpe_model(tmp_path / "teacher", seed=0)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded.get_vocab() == bpe.get_vocab()
    messages = _conversation("12+34=", "46", "tool")
    rendered = bpe.apply_chat_template(messages, tokenize=False)
    assert loaded.apply_chat_template(messages, tokenize=False) == rendered
    for text in [rendered, "x=é∑y\n\n  done", "You are a helpful assistant."]:
        assert loaded.encode(text, add_special_tokens=False) == bpe.encode(text, add_special_tokens=False)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen2" and config.vocab_size >= len(bpe)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    assert model.get_input_embeddings().weight.shape[0] == config.vocab_size
