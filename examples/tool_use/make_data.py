#!/usr/bin/env python3
"""The tool-use example's model, tokenizer, chat template and data (examples/tool_use/run.sh),
deterministic:
  make_data.py OUT_DIR [--train 40000] [--eval 500] [--tool-share 0.5] [--shape small|tiny]

The task is multiplying two 3-digit numbers, which a small model cannot do in its head but can do
with the calculator of examples/agents/calculator.py. The SFT conversations are the harness's own
(its system message, its `calculate` tool schema, the same user prompt): a share --tool-share of
them call the tool and answer with its result, the rest answer at once with the right product
(which the model cannot learn to compute). So the SFT model calls the tool about that often, and
GRPO through `rollout.loop: openai_agent` (reward 1 when the answer holds the product) has
something to teach: to call the tool every time, and to copy its numbers right.

OUT_DIR/model      a Qwen2-shaped causal LM from random weights (small: hidden 384, 6 layers, ~9.5M;
                   tiny: 2 layers of 64, for the CPU smoke test) with a byte-level tokenizer (one
                   token per character; <|im_start|>, <|im_end|>, <tool_call>, </tool_call> are
                   tokens of their own) and a compact Hermes-style chat template: the tools are
                   listed by name and parameters in the system turn, a call is Qwen2.5's
                   <tool_call>{"name": ..., "arguments": {...}}</tool_call> (agent.tool_call_parser:
                   hermes), a tool's answer a user turn of <tool_response>.
OUT_DIR/sft.jsonl  --train conversations {"messages", "tools"} for tiller sft (offline.tools_key)
OUT_DIR/rl.jsonl   other problems as {"input", "label"} for tiller train (the harness's prompt)
OUT_DIR/eval.jsonl --eval held-out problems, for eval.py
"""
import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agents"))
from calculator import SYSTEM, TOOLS  # noqa: E402  (the harness's own system message and tool)

TEMPLATE = r"""{%- macro tool_list() -%}
{{- '\nTools:' -}}
{%- for tool in tools -%}
{%- set f = tool.function if tool.function is defined else tool -%}
{{- ' ' + f.name + '(' + (f.parameters.properties | list | join(', ') if f.parameters is defined else '') + ')' -}}
{%- endfor -%}
{%- endmacro -%}
{%- if messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content -}}
{%- if tools %}{{ tool_list() }}{% endif -%}
{{- '<|im_end|>\n' -}}
{%- elif tools -%}
{{- '<|im_start|>system' + tool_list() + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content %}{{ '\n' + message.content }}{% endif -%}
{%- if message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set f = call.function if call.function is defined else call -%}
{{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""


def prompt(a, b):
    return f"What is {a} * {b}?"


def conversation(a, b, tool):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(a, b)}]
    if tool:
        msgs += [{"role": "assistant", "content": "",
                  "tool_calls": [{"id": "call_0", "type": "function",
                                  "function": {"name": "calculate", "arguments": {"expression": f"{a}*{b}"}}}]},
                 {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)}]
    msgs.append({"role": "assistant", "content": f"The answer is {a * b}."})
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=40000)
    ap.add_argument("--rl", type=int, default=20000)
    ap.add_argument("--eval", type=int, default=500)
    ap.add_argument("--tool-share", type=float, default=0.5)
    ap.add_argument("--shape", choices=["small", "tiny"], default="small")
    args = ap.parse_args()
    # 900 x 900 distinct problems exist; at most 600,000 are drawn (the draw below must end).
    if not (0 <= args.tool_share <= 1 and min(args.eval, args.train, args.rl) > 0
            and args.eval + args.train + args.rl <= 600000):
        sys.exit("make_data.py: --tool-share must be in [0, 1], and --train, --rl, --eval > 0 with at most 600000 "
                 "problems in all")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    pairs = set()
    while len(pairs) < args.eval + args.train + args.rl:
        pairs.add((rng.randint(100, 999), rng.randint(100, 999)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    held, sft, rl = pairs[:args.eval], pairs[args.eval:args.eval + args.train], pairs[args.eval + args.train:]
    with open(out / "sft.jsonl", "w") as f:
        for a, b in sft:
            f.write(json.dumps({"messages": conversation(a, b, rng.random() < args.tool_share), "tools": TOOLS}) + "\n")
    for name, rows in (("rl.jsonl", rl), ("eval.jsonl", held)):
        with open(out / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"input": prompt(a, b), "label": str(a * b)}) + "\n")

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    # No merges: the 256 bytes and the special tokens, so each digit is a token, and a text has one
    # tokenization (the harness's re-rendered turns never drift from the sampled tokens).
    trainer = trainers.BpeTrainer(vocab_size=256 + len(special), special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([prompt(1, 2)], trainer)
    # As Qwen2.5's: the tool-call tags are tokens of their own, not special (decoded with the text).
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False)])
    model_dir = out / "model"
    model_dir.mkdir(exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "model_max_length": 1024, "chat_template": TEMPLATE}))
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    shape = {"small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                           intermediate_size=1024),
             "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=176)}[args.shape]
    end, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=pad, eos_token_id=end, pad_token_id=pad, rope_theta=10000.0, **shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[end, pad], pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    example = hf.apply_chat_template(conversation(*sft[0], True), tools=TOOLS, tokenize=False)
    print(json.dumps({"sft": len(sft), "rl": len(rl), "eval": len(held), "vocab": tok.get_vocab_size(),
                      "params": sum(p.numel() for p in model.parameters()),
                      "tokens_per_conversation": len(hf(example)["input_ids"]), "example": example}))


if __name__ == "__main__":
    main()
