"""MATH-style answers compared as the field compares them, through the math-verify package
(pip install math-verify): \\frac{1}{2} = \\dfrac12 = 0.5, \\text{} and units stripped, intervals,
sets and symbolic equality. 1 when the response's final answer (its last \\boxed{}, else its last
expression) equals the ground truth, else 0. GSM8K's "#### n" answers work too.

    data:
      prompts: data/math/prompts.jsonl      # scripts/data/prepare_data.py math ...
      apply_chat_template: true
    reward:
      type: python
      python: examples/rewards/math_equiv.py:compute_score
"""
import re

try:
    from math_verify import parse, verify
except ImportError as e:  # the one line tiller prints names the fix
    raise ImportError("examples/rewards/math_equiv.py needs the math-verify package (pip install math-verify)") from e


# math-verify's own timeouts use signal.alarm, which only the main thread may: tiller scores on
# worker threads and bounds each call itself (reward.python_timeout_s), so they are off here.
def _parse(text):
    return parse(text, parsing_timeout=None)


def _gold(ground_truth):
    text = str(ground_truth).strip()
    return _parse(text if "$" in text or "\\boxed" in text else f"${text}$")


def _prediction(solution_str):
    m = re.findall(r"####\s*([^\n]+)", solution_str)  # GSM8K's final-answer line
    return _parse(f"${m[-1].strip()}$") if m and "\\boxed" not in solution_str else _parse(solution_str)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    gold = _gold(ground_truth)
    if not gold:
        return 0.0
    return 1.0 if verify(gold, _prediction(solution_str), timeout_seconds=None) else 0.0
