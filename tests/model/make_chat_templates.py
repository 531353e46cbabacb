#!/usr/bin/env python3
"""Makes the chat-template fixtures: tokenizers in five published chat formats, each with its Jinja
template in tokenizer_config.json, and what transformers' apply_chat_template makes of a set of
conversations (text and ids), for tiller's chat templates to equal (tests/model/tokenizer_test.cpp).

  make_chat_templates.py OUT_DIR

OUT_DIR/<name>/          tokenizer.json (byte-level BPE trained here, the format's special tokens),
                         tokenizer_config.json (chat_template, bos/eos), generation_config.json
OUT_DIR/reference.json   per template: cases {messages, tools, add_generation_prompt, kwargs, text, ids}
                         and observations {prompt_messages, turn, observation, role, text}

The templates are written here in the formats their models publish (Qwen2.5, Llama-3.1, Mistral
v0.3, Gemma 2, DeepSeek-V3, and Qwen3's thinking switch, rendered with apply_chat_template's extra
kwargs): default system prompts, tool schemas, tool turns, trimming and the
errors they raise. chatml and llama3 are the plain formats tiller also writes itself, to show its
built-in ones equal them. Skips the work when OUT_DIR/stamp holds this script's hash.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

OUT = Path(sys.argv[1])
STAMP = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
if (OUT / "stamp").exists() and (OUT / "stamp").read_text() == STAMP:
    print(f"chat template fixtures in {OUT} are current")
    sys.exit(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{%- for message in loop_messages | rejectattr("role", "equalto", "tool") | rejectattr("role", "equalto", "tool_results") | selectattr("tool_calls", "undefined") %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

DEEPSEEK = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}"
    "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen3's thinking switch (its published template's generation prompt): enable_thinking=False
# writes an empty <think></think> block, so the model answers without reasoning.
QWEN3 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")

TEMPLATES = {
    # name: template, special tokens (the first is BOS, then the EOS, then the rest), stop tokens
    "qwen2.5": (QWEN25, [None, "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_call>", "</tool_call>"],
                ["<|im_end|>", "<|endoftext|>"]),
    "llama3.1": (LLAMA31, ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|end_of_text|>", "<|eom_id|>", "<|python_tag|>"],
                 ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                          "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], ["</s>"]),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], ["<eos>", "<end_of_turn>"]),
    "deepseek": (DEEPSEEK, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                            "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"], ["<｜end▁of▁sentence｜>"]),
    "qwen3": (QWEN3, [None, "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>"],
              ["<|im_end|>", "<|endoftext|>"]),
    "chatml": (CHATML, [None, "<|im_end|>", "<|im_start|>", "<|endoftext|>"], ["<|im_end|>"]),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"], ["<|eot_id|>"]),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

U1 = {"role": "user", "content": "What is 17 + 25? Answer with a number."}
A1 = {"role": "assistant", "content": "17 + 25 = 42."}
U2 = {"role": "user", "content": "  And times two — café?  "}
A2 = {"role": "assistant", "content": "84, naïvely."}
SYS = {"role": "system", "content": "You are terse.\nAnswer in one line."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call12345", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "17*3"}}}]}
RESULT = {"role": "tool", "content": "51", "tool_call_id": "call12345", "name": "calculate"}

# Which conversations each format takes (Gemma has no system or tool role; Mistral's tool turns
# need call ids; DeepSeek's tool calls carry their arguments as text).
CASES = {
    "plain": [([U1], None, True), ([U1, A1, U2], None, True), ([U1, A1], None, False), ([U1, A1, U2, A2], None, False)],
    "system": [([SYS, U1], None, True), ([SYS, U1, A1, U2, A2], None, False)],
    "tools": [([U1], [WEATHER, CALC], True), ([SYS, U1], [CALC], True)],
    "tool_turns": [([U1, CALL, RESULT], [CALC], True), ([U1, CALL, RESULT, A1], [CALC], False)],
    "tool_result": [([U1, {"role": "assistant", "content": "Let me compute."}, {"role": "tool", "content": "51"}], None, True)],
    # The template's own variables (data.chat_template_kwargs), as apply_chat_template(**kwargs).
    "thinking": [([U1], None, True, {"enable_thinking": False}), ([SYS, U1], None, True, {"enable_thinking": True}),
                 ([U1, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n42."}, U2], None, True,
                  {"enable_thinking": False})],
}
SUPPORTS = {
    "qwen2.5": ["plain", "system", "tools", "tool_turns", "tool_result"],
    "llama3.1": ["plain", "system", "tools", "tool_turns", "tool_result"],
    "mistral": ["plain", "system", "tools", "tool_turns"],
    "gemma": ["plain"],
    "deepseek": ["plain", "system", "tool_result"],
    "qwen3": ["plain", "system", "tool_result", "thinking"],
    "chatml": ["plain", "system"],
    "llama3": ["plain", "system"],
}
# Multi-turn rollouts: a prompt, the model's turn, an environment's answer in `role`.
OBSERVATIONS = {"qwen2.5": "tool", "llama3.1": "tool", "mistral": "user", "gemma": "user", "deepseek": "tool", "qwen3": "tool",
                "chatml": "user", "llama3": "user"}


def corpus():
    lines = []
    for case_list in CASES.values():
        for msgs, tools, *_ in case_list:
            lines += [m["content"] for m in msgs]
            if tools:
                lines.append(json.dumps(tools))
    lines += [QWEN25, LLAMA31, "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( )",
              "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 You are Qwen, created by Alibaba Cloud."]
    return lines * 3


def make_tokenizer(specials):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, show_progress=False,
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def main():
    from transformers import AutoTokenizer
    OUT.mkdir(parents=True, exist_ok=True)
    ref = {}
    for name, (template, specials, stops) in TEMPLATES.items():
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        tok = make_tokenizer([s for s in specials if s is not None])
        tok.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": specials[1],
                  "model_max_length": 4096}
        if specials[0] is not None:
            config["bos_token"] = specials[0]
        (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(s) for s in stops]}))
        hf = AutoTokenizer.from_pretrained(str(d))
        cases = []
        for kind in SUPPORTS[name]:
            for msgs, tools, gen, *rest in CASES[kind]:
                kwargs = rest[0] if rest else {}
                text = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs)
                ids = list(hf(text, add_special_tokens=False)["input_ids"])
                cases.append({"kind": kind, "messages": msgs, "tools": tools, "add_generation_prompt": gen,
                              "kwargs": kwargs, "text": text, "ids": ids})
        observations = []
        role = OBSERVATIONS[name]
        for prompt in ([U1], [U1, A1, U2]):
            obs = {"role": role, "content": "The result is 51."}
            if role == "tool":
                obs["tool_call_id"] = "call12345"
            # The model's turn as it samples it: Mistral's writes the space after [/INST] itself.
            turn = " It is 51." if name == "mistral" else "It is 51."
            whole = hf.apply_chat_template(prompt + [{"role": "assistant", "content": turn}, obs],
                                           add_generation_prompt=True, tokenize=False)
            observations.append({"prompt_messages": prompt, "turn": turn, "observation": obs["content"],
                                 "role": role, "text": whole})
        ref[name] = {"cases": cases, "observations": observations, "stop_tokens": stops}
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1), encoding="utf-8")
    (OUT / "stamp").write_text(STAMP)
    print(f"chat template fixtures written to {OUT}")


if __name__ == "__main__":
    main()
