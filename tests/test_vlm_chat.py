"""Images through chat sessions (the multi-turn, tool and openai agents, and the HTTP server),
on the tiny vision-language model's tokenizer and processor and a scripted engine (through
real vLLM: test_vlm.py): each image's tokens sit in the sample where the processor puts them,
the engine gets every image of the conversation in order, the trainer gets their pixel inputs,
and a request whose pictures differ from the history's is a prefix break."""

from __future__ import annotations

import asyncio
import copy

import httpx
import openai
import pytest
import torch
from PIL import Image, ImageDraw

from rlexp.chat.client import SessionStore
from rlexp.chat.images import data_url, load_image_url, openai_messages
from rlexp.errors import SessionError
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vlm(vlm_path):
    from transformers import AutoProcessor, AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm_path), AutoProcessor.from_pretrained(vlm_path)


def _picture(color: str, quarter_color: str = "white", size=(64, 64)) -> Image.Image:
    img = Image.new("RGB", size, color)
    ImageDraw.Draw(img).rectangle((0, 0, size[0] // 2 - 1, size[1] // 2 - 1), fill=quarter_color)
    return img


def _same_pixels(a, b) -> bool:
    return a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def _rendered_at_once(processor, messages, images, reply: str) -> list[int]:
    """The processor's tokens for the whole conversation rendered at once, ending in `reply`."""
    bare = [{**m, "content": [{"type": "image"} if p.get("type") in ("image", "image_url") else p
                              for p in m["content"]]} if isinstance(m["content"], list)
            else {**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    text = processor.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
    return processor(text=text + reply + "<end_of_utterance>", images=images,
                     add_special_tokens=False)["input_ids"][0]


def test_the_openai_client_sends_image_urls_and_the_sample_has_each_image_in_place(vlm, tmp_path):
    """Two user turns over HTTP, from the official client: a PNG data URL, then a local path."""
    tokenizer, processor = vlm
    first, second = _picture("white", "red"), _picture("blue", "green", (48, 64))
    second.save(tmp_path / "second.png")
    engine = ScriptedEngine(tokenizer, ["2", "1"])
    store = SessionStore(engine, tokenizer, max_context=256)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(first)}},
                                             {"type": "text", "text": "How many?"}]}]

    async def go():
        from rlexp.chat.server import ChatServer

        server = ChatServer(store)
        await server.start()
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            sid = (await client.post("/sessions", cast_to=httpx.Response)).json()["session_id"]
            for url in (None, str(tmp_path / "second.png")):
                if url:
                    picture = {"type": "image_url", "image_url": {"url": url}}
                    question = {"type": "text", "text": "And here?"}
                    messages.append({"role": "user", "content": [question, picture]})
                r = await client.chat.completions.create(model="policy", messages=messages,
                                                         extra_body={"session_id": sid})
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
            return store.close(sid)
        finally:
            await server.stop()

    session = asyncio.run(go())
    (sample,) = session.to_samples(Sample(group_id=0, prompt=[], answer="1"))
    assert session.prefix_breaks == 0
    assert [len(i) for i in engine.images] == [1, 2]
    assert all(_same_pixels(a, b) for a, b in zip(engine.images[1], (first, second)))
    expected = _rendered_at_once(processor, messages[:-1], [first, second], "1")
    assert sample.tokens == list(expected)  # as if the processor had rendered it all at once
    assert sample.tokens == engine.calls[1][0] + engine.calls[1][1]  # and as the engine saw it
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    at = [i for i, t in enumerate(sample.tokens) if t == image_id]
    assert len(at) == 8 and not any(sample.loss_mask[i] for i in at)  # 4 tokens a picture, prompt only
    assert sample.mm_infer_info["spans"] == [[at[0], at[3] + 1], [at[4], at[7] + 1]]  # for the traces
    pixels = processor.image_processor([[first, second]], return_tensors="pt")
    for key in ("pixel_values", "pixel_attention_mask"):
        assert torch.equal(sample.mm_train_info[key], pixels[key][0])
    assert len(sample.mm_infer_info["images"]) == 2


async def _two_turns(store, pictures, replies_seen=1):
    """User with a picture, the reply, user with `pictures[1]` as the first picture instead."""
    async with store.record() as rec:
        messages = [{"role": "user", "content": [{"type": "image", "image": pictures[0]},
                                                 {"type": "text", "text": "How many?"}]}]
        for picture in pictures[1:]:
            r = await rec.client.chat.completions.create(messages=messages)
            messages = copy.deepcopy(messages)
            messages[0]["content"][0]["image"] = picture
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "Sure?"}]
        await rec.client.chat.completions.create(messages=messages)
    return rec


def test_a_different_picture_under_the_same_text_is_a_prefix_break(vlm):
    tokenizer, _ = vlm
    same = asyncio.run(_two_turns(SessionStore(ScriptedEngine(tokenizer, ["2", "3"]), tokenizer, 256),
                                  [_picture("white", "red"), _picture("white", "red")]))
    assert same.session.prefix_breaks == 0
    assert len(same.samples(Sample(group_id=0, prompt=[], answer=""))) == 1
    other = asyncio.run(_two_turns(SessionStore(ScriptedEngine(tokenizer, ["2", "3"]), tokenizer, 256),
                                   [_picture("white", "red"), _picture("white", "blue")]))
    samples = other.samples(Sample(group_id=0, prompt=[], answer=""))
    assert other.session.prefix_breaks == 1 and len(samples) == 2
    assert _same_pixels(samples[1].mm_infer_info["images"][0], _picture("white", "blue"))


def test_the_published_smolvlm_template_breaks_the_prefix_at_every_assistant_turn(vlm):
    """It writes a past reply `Assistant: text` but cues one with `Assistant:`; rlexp's copy
    writes the reply as generated (rlexp/models/vlm.py)."""
    tokenizer, _ = vlm
    published = copy.deepcopy(tokenizer)
    published.chat_template = tokenizer.chat_template.replace("message['role'] == 'assistant' or ", "")
    assert published.chat_template != tokenizer.chat_template
    pictures = [_picture("white", "red")] * 3
    ours = asyncio.run(_two_turns(SessionStore(ScriptedEngine(tokenizer, ["2", "3", "4"]), tokenizer, 256),
                                  pictures))
    theirs = asyncio.run(_two_turns(SessionStore(ScriptedEngine(published, ["2", "3", "4"]), published, 256),
                                    pictures))
    assert (ours.session.prefix_breaks, theirs.session.prefix_breaks) == (0, 2)


BAD_IMAGES = [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "not a local path"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "PIL cannot decode"),
    ({"type": "image_url", "image_url": {"url": "/no/such/picture.png"}}, "image file not found: /no/such"),
    ({"type": "image_url", "image_url": {"url": "PICTURE", "detail": "high"}}, "'auto'"),
    ({"type": "image", "image": "a.png"}, "send an 'image_url' part"),
]


@pytest.mark.parametrize("part,phrase", BAD_IMAGES, ids=[p for _, p in BAD_IMAGES])
def test_a_bad_image_is_a_400_naming_the_part(vlm, part, phrase):
    tokenizer, _ = vlm
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, 256)
    sid = store.open()
    if part["type"] == "image_url" and part["image_url"]["url"] == "PICTURE":
        part["image_url"]["url"] = data_url(_picture("red"))
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    with pytest.raises(SessionError) as e:
        asyncio.run(store.chat(sid, body))
    assert e.value.status == 400 and phrase in str(e.value)
    assert (e.value.param or "").startswith("messages.[0].content.[1]")
    assert not store.get(sid).branches  # nothing recorded


def test_a_text_model_refuses_an_image(tokenizer):
    store = SessionStore(ScriptedEngine(tokenizer, []), tokenizer, 256)
    picture = {"type": "image_url", "image_url": {"url": data_url(_picture("red"))}}
    body = {"messages": [{"role": "user", "content": [picture, {"type": "text", "text": "hi"}]}]}
    with pytest.raises(SessionError, match="takes no images") as e:
        asyncio.run(store.chat(store.open(), body))
    assert e.value.status == 400


def test_openai_messages_carry_each_picture_as_a_lossless_data_url():
    picture = _picture("white", "purple", (40, 30))
    (m,) = openai_messages([{"role": "user", "content": [{"type": "image", "image": picture},
                                                         {"type": "text", "text": "hi"}]}])
    assert m["content"][0]["type"] == "image_url" and m["content"][1] == {"type": "text", "text": "hi"}
    assert _same_pixels(load_image_url(m["content"][0]["image_url"]["url"]), picture)


def test_zoom_returns_the_quarter_enlarged_and_errors_as_text():
    from rlexp.tools.zoom import Zoom

    picture = _picture("blue", "red")
    zoom = Zoom()
    image, text = asyncio.run(zoom('{"quarter": "top-left"}', images=[picture]))
    assert image["image"].size == picture.size and set(image["image"].getdata()) == {(255, 0, 0)}
    assert text == {"type": "text", "text": "The top-left quarter of picture 0."}
    corner, _ = asyncio.run(zoom('{"quarter": "bottom-right", "image": 0}', images=[picture]))
    assert set(corner["image"].getdata()) == {(0, 0, 255)}
    for args, phrase in (('{"quarter": "middle"}', "'quarter' must be"), ("{", "not JSON"),
                         ('{"quarter": "top-left", "image": 1}', "0 .. 0")):
        result = asyncio.run(zoom(args, images=[picture]))
        assert isinstance(result, str) and result.startswith("error:") and phrase in result


def test_the_tool_agent_sends_the_zoomed_picture_back_to_the_engine(vlm):
    from rlexp.agents.tool import ToolAgent
    from rlexp.data.images import zoom
    from rlexp.judges.math_exact import MathExactJudge

    tokenizer, processor = vlm
    call = '<tool_call>{"name": "zoom", "arguments": {"quarter": "top-left"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "1"], max_model_len=1024)  # the tool specs take ~300 tokens
    agent = ToolAgent(engine, tokenizer, MathExactJudge(), tools=("zoom",))
    picture = _picture("white", "red")
    task = Sample(group_id=0, prompt=[{"role": "user", "content": [
        {"type": "image", "image": picture}, {"type": "text", "text": "How many?"}]}], answer="1")
    (sample,) = asyncio.run(agent.rollout(task))
    zoomed = zoom(picture, "top-left")
    assert [len(i) for i in engine.images] == [1, 2] and _same_pixels(engine.images[1][1], zoomed)
    assert sample.metadata["metrics"]["tool/calls_mean"] == 1.0 and sample.correct
    tool_turn = next(t for t in sample.trace.turns if t["role"] == "tool")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    start, end = tool_turn["span"]
    assert sample.tokens[start:end].count(image_id) == 4
    pixels = processor.image_processor([[picture, zoomed]], return_tensors="pt")
    assert torch.equal(sample.mm_train_info["pixel_values"], pixels["pixel_values"][0])
