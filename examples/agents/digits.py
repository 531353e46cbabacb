"""A token-faithful agent on the quickstart's toy task (docs/agents.md): three turns through the
`openai` client's completions API with token ids, "Now more:" between them; the reward is the
share of digits in what the model wrote, over all its turns.

Each next prompt is the last prompt, the reply's token ids (`return_token_ids`) and the tokens of
the agent's own text (`/tokenize`), so it always extends the sample's tokens: no retokenization
drift, whatever the model writes.
    mpirun -np 3 build/bin/tiller train -c configs/quickstart_agent.yaml
"""
import httpx
from openai import OpenAI

# One connection pool for every sample's client (each harness call runs on a thread of its own).
_http = httpx.Client(timeout=120)


def _tokenize(base_url, api_key, text):
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    r = _http.post(f"{root}/tokenize", json={"prompt": text, "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {api_key}"})
    r.raise_for_status()
    return r.json()["tokens"]


def _extra(choice, key):
    value = getattr(choice, key, None)
    return value if value is not None else (choice.model_extra or {}).get(key)


def run(base_url, api_key, model, prompt):
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=_http)
    ids = _tokenize(base_url, api_key, prompt)
    more = _tokenize(base_url, api_key, " Now more:")
    text = ""
    for turn in range(3):
        choice = client.completions.create(model=model, prompt=ids, max_tokens=16,
                                           extra_body={"return_token_ids": True}).choices[0]
        text += choice.text
        ids = ids + _extra(choice, "token_ids") + (more if turn < 2 else [])
    return sum(c.isdigit() for c in text) / max(1, len(text))
