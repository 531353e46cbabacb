"""An agent with a calculator tool, in plain Python with the `openai` client (docs/agents.md): the
model may call `calculate` (Qwen2.5's <tool_call> format, agent.tool_call_parser: hermes); the
harness evaluates each call and sends the result back as a tool message, for up to four replies;
the reward is 1 when the final reply holds the label (the answer), else 0.
    python3 examples/envs/make_calculator_prompts.py data/calculator/prompts.jsonl 2000
    mpirun -np 3 build/bin/tiller train -c configs/gpu/<a 1-GPU GRPO config> --set rollout.loop=openai_agent \
      --set agent.harness=examples/agents/calculator.py:run --set data.prompts=data/calculator/prompts.jsonl \
      --set agent.tool_call_parser=hermes --set roles.actor.model=Qwen/Qwen2.5-1.5B-Instruct \
      --set rollout.max_turns=4 --set rollout.max_response_tokens=1024 --set reward.type=env

It needs a model whose chat template takes tools (Qwen2.5's, or the one examples/tool_use/ trains
from random weights with this harness's system message and tool; the built-in chatml has no place
for them, and the endpoint refuses the request saying so) and a context for the tools' description
(~750 tokens with the quickstart's tiny tokenizer and Qwen2.5's template, which is too small for it).
`conversation()` is the loop itself, which examples/tool_use/eval.py runs greedy. Chat requests are
re-rendered from the messages, so a model whose text does not re-tokenize to its own tokens drifts
(agent.drift: error stops the job there; split and drop go on).
"""
import ast
import json
import operator

import httpx
from openai import OpenAI

_http = httpx.Client(timeout=120)

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("not arithmetic")


def calculate(arguments):
    try:
        expression = json.loads(arguments).get("expression", "")
        value = _eval(ast.parse(str(expression), mode="eval").body)
        return str(int(value) if float(value).is_integer() else round(value, 6))
    except Exception as e:  # the model's call was malformed: it reads the error, as from any tool
        return f"error: {type(e).__name__}"


SYSTEM = "Use the calculate tool for arithmetic, then answer."


def conversation(client, model, prompt, **sampling):
    """The agent's turns for one problem: (messages, the final reply's text, tool calls made)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    reply, calls = None, 0
    for _ in range(4):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=128,
                                               **sampling).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(call.function.arguments)})
    return messages, ((reply.content or "") if reply else ""), calls


def run(base_url, api_key, model, prompt, label):
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=_http)
    _, answer, _ = conversation(client, model, prompt)
    return 1.0 if str(label) and str(label) in answer else 0.0
