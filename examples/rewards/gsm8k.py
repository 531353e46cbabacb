"""A GSM8K reward in verl's form: 1 when the response's final answer ("#### n", else the last
number it writes) equals the ground truth's, a small format score when it wrote one that differs.

    data:
      prompts: gsm8k_train.parquet          # verl's preprocessed GSM8K (data_source, prompt, reward_model, ...)
      input_key: prompt                     # chat messages
      label_key: reward_model.ground_truth
      apply_chat_template: true
    reward:
      type: python
      python: examples/rewards/gsm8k.py:compute_score
"""
import re

_FINAL = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def _value(text):
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def extract_answer(solution_str, strict=False):
    """The response's final answer as a number, or None."""
    found = _FINAL.findall(solution_str)
    if found:
        return _value(found[-1])
    if strict:
        return None
    numbers = _NUMBER.findall(solution_str)
    return _value(numbers[-1]) if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.1):
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    truth = extract_answer(str(ground_truth))
    return 1.0 if truth is not None and abs(answer - truth) < 1e-6 else format_score
