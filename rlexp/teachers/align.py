"""A teacher with another tokenizer mapped onto the student's tokens through the text.

The teacher cannot score the student's token ids, so the student's tokens are decoded to
text, the teacher re-tokenizes that text and scores its own tokens, and its logprobs are put
back on the student's tokens, as Hugging Face TRL's `GOLDTrainer` does ("universal logit
distillation" across tokenizers: both tokenizations' spans of the text, walked together) and
slime's on-policy distillation with a teacher of another family.

The rule. Walking the two tokenizations' span ends, a group is closed whenever both sides end
at the same character: a group is student tokens S and teacher tokens T covering exactly the
same text, as small as the tokenizations allow (1:1 wherever they agree). The chain rule gives
log p_teacher(text of the group | text before) = sum_{j in T} lp_j, where lp_j is
`teacher.logprobs[j - 1]`, the teacher's logprob of its token j. Each student token of a group
gets lp_t = sum_{j in T} lp_j / |S|, so that the group's summed per-token reverse KL is
    sum_{t in S} (logp_student(t) - lp_t) = log p_student(group text) - log p_teacher(group text),
exact per group and for a 1:1 group per token. A group is scored only when all its student
tokens are trained (loss_mask 1: a group mixing prompt and response text would charge the
response with the prompt's logprobs) and none of its teacher tokens is the teacher's token 0
(which has no logprob); any other token gets 0.0, scored 0.

Spans are characters. A student token whose bytes are part of a character (byte-level BPE
splits a multi-byte character) gets an empty span and joins the group of the token that
completes the character; bytes that are no UTF-8 become one U+FFFD each, and their group is
not scored (the teacher would score another text). Text the teacher's tokens skip (a character
outside its vocabulary) leaves its group unscored. Top-k alternatives need one vocabulary, so
`top_ids` / `top_logprobs` stay None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlexp.errors import TeacherError
from rlexp.sample import PromptLogprobs, TeacherScores

Spans = list[tuple[int, int]]
Ends = list[int | None]  # per token: the character its group may close at; None: never


@dataclass(frozen=True)
class Alignment:
    """`teacher_ids`: the student's text as the teacher tokenizes it; `groups`: (student token
    positions, teacher token positions) covering the same characters, in order."""

    teacher_ids: list[int]
    groups: list[tuple[range, range]]


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-level alphabet: each piece character back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(shifted)}


def _byte_pieces(tokenizer: Any, token_ids: list[int]) -> list[bytes] | None:
    """Each token's bytes, from its byte-level piece (an added token: its text); None when
    the tokenizer is not byte-level."""
    from tokenizers import decoders

    if not isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
        return None
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    to_byte = _unicode_to_byte()
    pieces = []
    for i, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(token_ids)):
        if i in added:
            pieces.append(added[i].encode())
        elif piece is None or any(c not in to_byte for c in piece):
            return None
        else:
            pieces.append(bytes(to_byte[c] for c in piece))
    return pieces


def _byte_level_spans(pieces: list[bytes]) -> tuple[str, Spans, Ends, set[int]]:
    """(text, spans, ends, tokens holding bytes that are no UTF-8) of byte-level pieces."""
    chars = b"".join(pieces).decode("utf-8", "surrogateescape")  # a bad byte: one lone surrogate
    floor = [0]  # per byte offset: the characters wholly before it
    boundary = [True]  # per byte offset: whether a character starts (or the text ends) there
    bad_byte: list[bool] = []
    for k, c in enumerate(chars):
        escaped = "\udc80" <= c <= "\udcff"
        width = 1 if escaped else len(c.encode())
        floor += [k] * (width - 1) + [k + 1]
        boundary += [False] * (width - 1) + [True]
        bad_byte += [escaped] * width
    spans: Spans = []
    ends: Ends = []
    bad, start = set(), 0
    for t, piece in enumerate(pieces):
        end = start + len(piece)
        if any(bad_byte[start:end]):
            bad.add(t)
        ends.append(floor[end] if boundary[end] else None)
        whole = boundary[start] and boundary[end] and t not in bad
        spans.append((floor[start], floor[end]) if whole else (floor[end], floor[end]))
        start = end
    text = "".join("\ufffd" if "\udc80" <= c <= "\udcff" else c for c in chars)
    return text, spans, ends, bad


def _decoded_spans(tokenizer: Any, token_ids: list[int]) -> tuple[str, Spans, Ends, set[int]]:
    """Spans by cumulative decoding (a tokenizer that is not byte-level; quadratic): a token
    whose prefix's text does not extend the previous prefix's, or ends in U+FFFD, is a part."""
    spans: Spans = []
    ends: Ends = []
    good = ""  # the longest prefix text that every later prefix extends
    for k in range(len(token_ids)):
        text = tokenizer.decode(token_ids[:k + 1], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        whole = text.startswith(good) and not text.endswith("\ufffd")
        spans.append((len(good), len(text)) if whole else (len(good), len(good)))
        ends.append(len(text) if whole else None)
        good = text if whole else good
    return good, spans, ends, set()


def _student_pieces(tokenizer: Any, token_ids: list[int]) -> tuple[str, Spans, Ends, set[int]]:
    """`student_spans` with, per token, the character a group may close at, and the tokens
    whose group cannot be scored."""
    pieces = _byte_pieces(tokenizer, token_ids)
    return _byte_level_spans(pieces) if pieces is not None else _decoded_spans(tokenizer, token_ids)


def student_spans(tokenizer: Any, token_ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `token_ids` (special tokens as text, spaces as decoded) and each token's
    character span in it; a token that is part of a character (or holds bytes that are no
    UTF-8) gets an empty span."""
    text, spans, _, _ = _student_pieces(tokenizer, token_ids)
    return text, spans


def _teacher_ends(offsets: Spans) -> tuple[Ends, set[int]]:
    """Per teacher token the character its group may close at (None for a byte of a character
    that the next token continues: both carry that character's offsets), and the tokens after
    text that no teacher token covers."""
    ends: Ends = []
    gaps: set[int] = set()
    covered = 0
    for j, (start, end) in enumerate(offsets):
        if start > covered:
            gaps.add(j)
        covered = max(covered, end)
        continues = j + 1 < len(offsets) and offsets[j + 1][0] < end
        ends.append(None if continues else end)
    return ends, gaps


def _walk(s_ends: Ends, t_ends: Ends) -> list[tuple[range, range]]:
    """The groups: from where the last one closed, take a token of each side, then the next
    token of the side that ends first (or cannot close), until both end at one character."""
    groups: list[tuple[range, range]] = []
    i = j = 0
    while i < len(s_ends) and j < len(t_ends):
        i0, j0 = i, j
        i, j = i + 1, j + 1
        while s_ends[i - 1] is None or s_ends[i - 1] != t_ends[j - 1]:
            se, te = s_ends[i - 1], t_ends[j - 1]
            if se is None or (te is not None and se < te):
                if i == len(s_ends):
                    return groups
                i += 1
            elif j == len(t_ends):
                return groups
            else:
                j += 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def align(student_ids: list[int], student_tokenizer: Any, teacher_tokenizer: Any) -> Alignment:
    """The student's tokens decoded, the text re-tokenized by the teacher (a transformers fast
    tokenizer; no special tokens added, those in the text recognised), and the groups of the
    two tokenizations covering the same text (groups the teacher cannot score are left out)."""
    text, _, s_ends, bad = _student_pieces(student_tokenizer, student_ids)
    enc = teacher_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    t_ends, gaps = _teacher_ends(offsets)
    groups = [(s, t) for s, t in _walk(s_ends, t_ends) if bad.isdisjoint(s) and gaps.isdisjoint(t)]
    return Alignment(list(enc["input_ids"]), groups)


def scores_on_student(alignment: Alignment, teacher: PromptLogprobs,
                      loss_mask: list[int]) -> tuple[TeacherScores, int, int]:
    """The teacher's logprobs of `alignment.teacher_ids` on the student's tokens by the rule in
    the module docstring: (scores, trained tokens aligned, trained tokens)."""
    n = len(alignment.teacher_ids)
    if len(teacher.logprobs) != max(n - 1, 0):
        raise TeacherError(f"the teacher scored {len(teacher.logprobs)} positions of {n} tokens "
                           f"(expected {max(n - 1, 0)})")
    logprobs = [0.0] * len(loss_mask)
    scored = [0] * len(loss_mask)
    for s, t in alignment.groups:
        if t.start == 0 or not all(loss_mask[i] for i in s):
            continue
        share = sum(teacher.logprobs[j - 1] for j in t) / len(s)
        for i in s:
            logprobs[i], scored[i] = share, 1
    return TeacherScores(logprobs, scored), sum(scored), sum(1 for m in loss_mask if m)
