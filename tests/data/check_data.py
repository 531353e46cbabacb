#!/usr/bin/env python3
"""scripts/data/prepare_data.py on small files written here in the published schemas of GSM8K,
MATH, HH-RLHF and UltraFeedback (binarized, as parquet); the answers it extracts; the MATH reward
(examples/rewards/math_equiv.py) against math-verify itself on a few hundred answer pairs; and one
quickstart-sized step of tiller train / sft / dpo on each recipe's output.

  check_data.py TILLER MPIRUN SCRATCH
"""
import json
import random
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

TILLER, MPIRUN, SCRATCH = sys.argv[1], sys.argv[2], Path(sys.argv[3])
REPO = Path(__file__).resolve().parents[2]
PREPARE = REPO / "scripts" / "data" / "prepare_data.py"
MODEL = SCRATCH / "tiny-qwen2"


def fail(msg):
    print(f"FAIL (data): {msg}", file=sys.stderr)
    sys.exit(1)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path):
    return [json.loads(l) for l in path.read_text(encoding="utf-8").split("\n") if l]


def prepare(kind, *inputs):
    out = SCRATCH / kind
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([sys.executable, str(PREPARE), kind, *map(str, inputs), "--out", str(out)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        fail(f"prepare_data {kind}: {p.stdout}")
    return out


def tiller(command, np_, config, *sets):
    args = [MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", str(np_), TILLER, command, "-c",
            str(REPO / "configs" / config), "--set", f"roles.actor.model={MODEL}", "--set", "checkpoint.dir=",
            "--set", "eval.prompts=", "--set", "data.apply_chat_template=true", "--set", "data.chat_template=chatml"]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"tiller {command} on the recipe's output: exit {p.returncode}:\n{p.stdout[-3000:]}")
    return p.stdout


SCRATCH.mkdir(parents=True, exist_ok=True)
subprocess.run([sys.executable, str(REPO / "scripts" / "make_quickstart.py"), str(MODEL), str(SCRATCH / "qs.jsonl")],
               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

# --- GSM8K (openai/gsm8k, main): question, answer with <<calculator>> notes and "#### n" ---------
gsm = write_jsonl(SCRATCH / "gsm8k_train.jsonl", [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?",
     "answer": "He has 3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "A farm sells 1,000 eggs a day for 2 days. How many eggs?",
     "answer": "1,000*2=<<1000*2=2000>>2,000 eggs.\n#### 2,000"},
    {"question": "No final answer here.", "answer": "It is unclear."},
])
out = gsm_out = prepare("gsm8k", gsm)
prompts, sft = read_jsonl(out / "prompts.jsonl"), read_jsonl(out / "sft.jsonl")
if [p["label"] for p in prompts] != ["7", "2000"] or any(p["data_source"] != "gsm8k" for p in prompts):
    fail(f"gsm8k labels {[p['label'] for p in prompts]}")
if "<<" in sft[0]["messages"][1]["content"] or not sft[0]["messages"][1]["content"].endswith("#### 7"):
    fail(f"gsm8k SFT response {sft[0]['messages'][1]['content']!r}")
if "####" not in prompts[0]["input"][0]["content"]:
    fail("gsm8k prompt lacks the answer-format instruction")
print(f"gsm8k: {len(prompts)} prompts (labels 7, 2000; the record without '####' skipped), {len(sft)} SFT conversations")
tiller("train", 3, "quickstart.yaml", f"data.prompts={out / 'prompts.jsonl'}", "roles.critic.enabled=false",
       "algo.advantage_estimator=group_norm", "rollout.batch_size=2", "train.train_batch_size=2", "train.num_steps=1",
       "rollout.max_prompt_tokens=256", f"run.output_dir={SCRATCH / 'gsm8k_run'}",
       "reward.type=python", f"reward.python={REPO / 'examples' / 'rewards' / 'gsm8k.py'}:compute_score")
tiller("sft", 1, "sft_quickstart.yaml", f"offline.data={out / 'sft.jsonl'}", "offline.eval_samples=0",
       "offline.epochs=1", "offline.max_tokens=256", "train.train_batch_size=2", f"run.output_dir={SCRATCH / 'gsm8k_sft'}")
print("gsm8k: one GRPO step (gsm8k.py reward) and one SFT epoch ran on the recipe's files")

# --- MATH (hendrycks): problem, solution with \boxed{} (nested braces), level, type ---------------
math = write_jsonl(SCRATCH / "math_test.jsonl", [
    {"problem": "What is $1/2 + 0$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Algebra"},
    {"problem": "Solve $x > 1$ for the interval.", "solution": "So $x \\in \\boxed{(1, \\infty)}$.", "level": "Level 2",
     "type": "Algebra"},
    {"problem": "Nested?", "solution": "$\\boxed{\\sqrt{\\frac{a}{b}}}$", "level": "Level 3", "type": "Algebra"},
])
out = prepare("math", math)
labels = [p["label"] for p in read_jsonl(out / "prompts.jsonl")]
if labels != ["\\frac{1}{2}", "(1, \\infty)", "\\sqrt{\\frac{a}{b}}"]:
    fail(f"MATH labels {labels}")
print(f"math: labels {labels}")
tiller("train", 3, "quickstart.yaml", f"data.prompts={out / 'prompts.jsonl'}", "roles.critic.enabled=false",
       "algo.advantage_estimator=group_norm", "rollout.batch_size=3", "train.train_batch_size=3", "train.num_steps=1",
       "rollout.max_prompt_tokens=256", f"run.output_dir={SCRATCH / 'math_run'}", "reward.type=python",
       f"reward.python={REPO / 'examples' / 'rewards' / 'math_equiv.py'}:compute_score")
print("math: one GRPO step ran with the math-verify reward")

# The MATH reward against math-verify on a few hundred pairs made here: equal fractions, decimals,
# \dfrac, intervals, and wrong answers.
sys.path.insert(0, str(REPO / "examples" / "rewards"))
import math_equiv  # noqa: E402
from math_verify import parse, verify  # noqa: E402

rng = random.Random(5)
pairs = []
for _ in range(150):
    a, b = rng.randint(1, 20), rng.choice([2, 4, 5, 8, 10])
    f = Fraction(a, b)
    forms = [f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", f"{float(f):g}", f"\\frac{{{f.numerator}}}{{{f.denominator}}}"]
    pairs.append((rng.choice(forms), rng.choice(forms)))  # equal
    pairs.append((rng.choice(forms), f"\\frac{{{a + 1}}}{{{b}}}"))  # not equal
for _ in range(30):
    lo, hi = rng.randint(-5, 5), rng.randint(6, 9)
    pairs.append((f"[{lo}, {hi})", f"[{lo},{hi})"))
    pairs.append((f"[{lo}, {hi})", f"({lo}, {hi}]"))
agree = 0
for gold, answer in pairs:
    want = 1.0 if verify(parse(f"${gold}$"), parse(f"The answer is $\\boxed{{{answer}}}$.")) else 0.0
    got = math_equiv.compute_score("math", f"The answer is $\\boxed{{{answer}}}$.", gold)
    if got != want:
        fail(f"math_equiv({answer!r} vs {gold!r}) = {got}, math-verify says {want}")
    agree += 1
equal = sum(math_equiv.compute_score("math", f"$\\boxed{{{a}}}$", g) for g, a in pairs)
if not 150 <= equal <= 240:
    fail(f"{equal} of {len(pairs)} pairs equal: the pairs do not exercise both verdicts")
print(f"math: math_equiv.py agrees with math-verify on all {agree} answer pairs ({equal:.0f} equal)")

# --- HH-RLHF (Anthropic/hh-rlhf): chosen, rejected transcripts -----------------------------------
hh = write_jsonl(SCRATCH / "hh.jsonl", [
    {"chosen": "\n\nHuman: How do I bake bread?\n\nAssistant: Mix flour, water, yeast and salt, then bake.",
     "rejected": "\n\nHuman: How do I bake bread?\n\nAssistant: I don't know."},
    {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a color.\n\nAssistant: Blue.",
     "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a color.\n\nAssistant: No."},
] * 4)
out = prepare("hh-rlhf", hh)
pairs_hh = read_jsonl(out / "pairs.jsonl")
if len(pairs_hh) != 8 or [m["role"] for m in pairs_hh[1]["prompt"]] != ["user", "assistant", "user"] or \
        pairs_hh[1]["chosen"] != [{"role": "assistant", "content": "Blue."}]:
    fail(f"hh-rlhf pairs {pairs_hh[:2]}")
tiller("dpo", 1, "dpo_quickstart.yaml", f"offline.data={out / 'pairs.jsonl'}", "offline.eval_samples=0",
       "offline.epochs=1", "offline.max_tokens=128", "train.train_batch_size=4", f"run.output_dir={SCRATCH / 'hh_dpo'}")
print(f"hh-rlhf: {len(pairs_hh)} pairs (multi-turn prompts kept as messages); one DPO epoch ran")

# --- UltraFeedback binarized (parquet): prompt, chosen/rejected message lists, scores ------------
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

uf_rows = [{"prompt": "Write a haiku.", "prompt_id": "p1",
            "chosen": [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Leaves fall, slow."}],
            "rejected": [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "No."}],
            "score_chosen": 8.5, "score_rejected": 3.0}] * 4
uf = SCRATCH / "ultrafeedback.parquet"
pq.write_table(pa.Table.from_pylist(uf_rows), uf)
out = prepare("ultrafeedback", uf)
pairs_uf = read_jsonl(out / "pairs.jsonl")
if len(pairs_uf) != 4 or pairs_uf[0]["margin"] != 5.5 or pairs_uf[0]["prompt"] != [uf_rows[0]["chosen"][0]]:
    fail(f"ultrafeedback pairs {pairs_uf[:1]}")
tiller("train-rm", 1, "rm_quickstart.yaml", f"offline.data={out / 'pairs.jsonl'}", "offline.eval_samples=0",
       "offline.epochs=1", "offline.max_tokens=128", "train.train_batch_size=4", f"run.output_dir={SCRATCH / 'uf_rm'}")
print(f"ultrafeedback: {len(pairs_uf)} pairs from parquet (margin 5.5); one reward-model epoch ran")

# configs/real's 1-GPU GSM8K config itself, on CPU at toy size: its model by hub id from a Hugging
# Face cache laid out here (the tiny model, with a Qwen2.5-style template and its default system
# prompt), the recipe's prompts, verl's GSM8K reward in Python and its evaluation on the engine.
hub = SCRATCH / "hub"
shutil.rmtree(hub, ignore_errors=True)
commit = "0123456789abcdef0123456789abcdef01234567"
snap = hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / commit
shutil.copytree(MODEL, snap)
(hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs").mkdir()
(hub / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs" / "main").write_text(commit)
tc_path = snap / "tokenizer_config.json"
tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
tc["chat_template"] = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
tc_path.write_text(json.dumps(tc))
real_out = SCRATCH / "real_gsm8k"
shutil.rmtree(real_out, ignore_errors=True)
args = [MPIRUN, "--oversubscribe", "--allow-run-as-root", "-np", "2", "-x", f"HF_HUB_CACHE={hub}",
        str(Path(TILLER).resolve()), "train", "-c", str(REPO / "configs" / "real" / "qwen2.5-0.5b-instruct-gsm8k-grpo-1gpu.yaml")]
for kv in ["cluster.device=cpu", "roles.actor.dtype=fp32", "roles.ref.dtype=fp32", f"run.output_dir={real_out}",
           "checkpoint.dir=", f"data.prompts={gsm_out / 'prompts.jsonl'}", f"eval.prompts={gsm_out / 'prompts.jsonl'}",
           "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_prompt_tokens=256",
           "rollout.max_new_tokens=8",
           "eval.max_new_tokens=8", "engines.max_num_seqs=8", "train.train_batch_size=4", "train.num_steps=1",
           "rollout.micro_batch_tokens=2048", "train.micro_batch_tokens=2048", "engines.max_batched_tokens=2048",
           "timeouts.startup_s=120"]:
    args += ["--set", kv]
# From the repository's root, as the config's header runs it (its reward's path is relative).
p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, cwd=REPO)
if p.returncode != 0:
    fail(f"configs/real/qwen2.5-0.5b-instruct-gsm8k-grpo-1gpu.yaml on CPU: exit {p.returncode}:\n{p.stdout[-3000:]}")
rows = read_jsonl(real_out / "metrics.jsonl")
evals = [r["step"] for r in rows if "eval/gsm8k/greedy_accuracy" in r]
if evals != [0, 1]:
    fail(f"configs/real GSM8K: eval/gsm8k/greedy_accuracy at steps {evals}, expected 0 (before training) and 1")
sample = read_jsonl(real_out / "samples.jsonl")[0]
if not sample["prompt"].startswith("<|im_start|>system\nYou are Qwen") or "####" not in sample["prompt"]:
    fail(f"configs/real GSM8K: the prompt is not in the model's template: {sample['prompt'][:200]!r}")
print("configs/real GSM8K (1 GPU): one step on CPU, the model by hub id, its template's system prompt, "
      "eval/gsm8k at steps 0 and 1")

# A file in another schema: one line naming the keys.
p = subprocess.run([sys.executable, str(PREPARE), "gsm8k", str(hh), "--out", str(SCRATCH / "wrong")],
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
if p.returncode == 0 or "no question, answer (its keys: chosen, rejected)" not in p.stdout:
    fail(f"a file of another schema: {p.stdout}")
print("data: a file of another schema is refused naming its keys")
