"""The quickstart's toy reward as a verl-style Python reward (reward.type: python).

    reward:
      type: python
      python: examples/rewards/toy_digits.py:compute_score

The score is the share of the response's characters that are ASCII digits: what the built-in
`toy_digits` rule computes, so a run with this file gives that rule's rewards. The dict's other
numbers are averaged into the metrics (reward/extra/digits, reward/extra/truncated).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, finish_reason="stop"):
    digits = sum(c in "0123456789" for c in solution_str)
    share = digits / len(solution_str) if solution_str else 0.0
    return {"score": share, "digits": digits, "truncated": float(finish_reason == "length")}
