#!/usr/bin/env python3
"""Turns public datasets, in the schemas they are published in, into tiller's formats.

  prepare_data.py gsm8k          IN [IN ...] --out DIR   # GSM8K: question, answer ("... #### 42")
  prepare_data.py math           IN [IN ...] --out DIR   # MATH: problem, solution (\\boxed{...}), level, type
  prepare_data.py hh-rlhf        IN [IN ...] --out DIR   # Anthropic HH-RLHF: chosen, rejected transcripts
  prepare_data.py ultrafeedback  IN [IN ...] --out DIR   # UltraFeedback binarized: prompt, chosen, rejected messages

IN: JSONL or parquet files (a Hugging Face dataset's files, e.g. gsm8k/main/train-00000-of-00001.parquet).
Writes into DIR:
  prompts.jsonl  RL prompts: {"input": [{"role": "user", ...}], "label": answer, "data_source": ...}
                 (data.input_key: input, data.apply_chat_template: true; reward: math_answer for GSM8K,
                 examples/rewards/math_equiv.py for MATH)
  sft.jsonl      supervised conversations: {"messages": [user, assistant]} (tiller sft)
  pairs.jsonl    preference pairs (hh-rlhf, ultrafeedback): {"prompt": [messages], "chosen": [assistant],
                 "rejected": [assistant]} (tiller train-rm, tiller dpo)
and prints what it wrote. The answers are extracted as the rewards compare them: GSM8K's after
"####" (commas dropped), MATH's last \\boxed{...} (nested braces kept).
"""
import argparse
import json
import re
import sys
from pathlib import Path

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def records(paths):
    for path in paths:
        p = Path(path)
        if p.suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq
            for row in pq.read_table(p).to_pylist():
                yield row
        else:
            for n, line in enumerate(p.read_text(encoding="utf-8").split("\n"), 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        sys.exit(f"prepare_data: {p}:{n}: not JSON ({e})")


def need(row, keys, where):
    missing = [k for k in keys if k not in row]
    if missing:
        sys.exit(f"prepare_data: {where}: no {', '.join(missing)} (its keys: {', '.join(sorted(row))}); "
                 "is this the dataset's published schema?")


def gsm8k_answer(answer):
    """The number after '####', commas dropped: '1,234' -> '1234'."""
    m = re.search(r"####\s*(.+?)\s*$", answer.strip())
    return m.group(1).replace(",", "").strip() if m else None


def last_boxed(text):
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def hh_split(transcript):
    """An HH-RLHF transcript ('\\n\\nHuman: ...\\n\\nAssistant: ...') as chat messages."""
    parts = re.split(r"\n\n(Human|Assistant): ", "\n\n" + transcript.lstrip("\n"))
    messages = []
    for role, text in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if role == "Human" else "assistant", "content": text.strip()})
    return messages


def prepare(kind, inputs, out):
    out.mkdir(parents=True, exist_ok=True)
    prompts, sft, pairs, skipped = [], [], [], 0
    for i, row in enumerate(records(inputs)):
        where = f"record {i + 1}"
        if kind in ("gsm8k", "math"):
            # A question and its worked solution: the prompt (with the answer-format instruction),
            # the answer the reward compares with as the label, the solution as the SFT response.
            q, a = ("question", "answer") if kind == "gsm8k" else ("problem", "solution")
            need(row, [q, a], where)
            label = gsm8k_answer(row[a]) if kind == "gsm8k" else last_boxed(row[a])
            if label is None:
                skipped += 1
                continue
            instruction = GSM8K_INSTRUCTION if kind == "gsm8k" else MATH_INSTRUCTION
            user = {"role": "user", "content": f"{row[q].strip()} {instruction}"}
            extra = {"index": i} if kind == "gsm8k" else {"index": i, "level": row.get("level"), "type": row.get("type")}
            prompts.append({"input": [user], "label": label, "data_source": kind, "extra_info": extra})
            solution = re.sub(r"<<[^>]*>>", "", row[a]) if kind == "gsm8k" else row[a]  # GSM8K's calculator notes
            sft.append({"messages": [user, {"role": "assistant", "content": solution.strip()}]})
        elif kind == "hh-rlhf":
            need(row, ["chosen", "rejected"], where)
            chosen, rejected = hh_split(row["chosen"]), hh_split(row["rejected"])
            # The two transcripts share every turn but the last assistant one.
            if (len(chosen) < 2 or len(chosen) != len(rejected) or chosen[:-1] != rejected[:-1]
                    or chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant"):
                skipped += 1
                continue
            pairs.append({"prompt": chosen[:-1], "chosen": [chosen[-1]], "rejected": [rejected[-1]]})
        elif kind == "ultrafeedback":
            need(row, ["prompt", "chosen", "rejected"], where)
            chosen, rejected = row["chosen"], row["rejected"]
            if (not isinstance(chosen, list) or not isinstance(rejected, list) or len(chosen) < 2
                    or chosen[:-1] != rejected[:-1] or chosen[-1].get("role") != "assistant"):
                skipped += 1
                continue
            pairs.append({"prompt": chosen[:-1], "chosen": [chosen[-1]], "rejected": [rejected[-1]],
                          "margin": float(row.get("score_chosen", 0) or 0) - float(row.get("score_rejected", 0) or 0)})
        else:
            sys.exit(f"prepare_data: unknown dataset '{kind}'")

    def write(name, rows):
        if rows:
            (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            print(f"prepare_data: {out / name}: {len(rows)} records")
    write("prompts.jsonl", prompts)
    write("sft.jsonl", sft)
    write("pairs.jsonl", pairs)
    if skipped:
        print(f"prepare_data: {skipped} records skipped (no answer to extract, or chosen and rejected that do not "
              "share their prompt)")
    if not (prompts or pairs):
        sys.exit("prepare_data: nothing written")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", choices=["gsm8k", "math", "hh-rlhf", "ultrafeedback"])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    prepare(a.dataset, a.inputs, a.out)


if __name__ == "__main__":
    main()
