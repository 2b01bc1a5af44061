"""An example user agent for `agent=openai`: plain OpenAI-client code, two attempts.

    python -m rlexp.run agent=openai agent.entrypoint=rlexp.examples.openai_agent:solve
"""

from rlexp.judges.math_exact import extract_answer, normalize


async def solve(client, task) -> float:
    messages = list(task["messages"])
    for attempt in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        text = reply.choices[0].message.content or ""
        if extract_answer(text) == normalize(task["answer"]):
            return 1.0 if attempt == 0 else 0.5
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "No. Again."}]
    return 0.0
