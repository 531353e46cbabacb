#!/usr/bin/env python3
"""An example remote reward service for tiller (proto/tiller/reward.proto), in Python with grpcio.

    python3 examples/reward_server/server.py --port 50061 --task math
    # then in the job's YAML:  reward: {type: remote, remote_address: "HOST:50061"}

Tasks:
  math        1 when the response's final answer (the number after the last '####', else the
              contents of the last \\boxed{...}) equals the label's, numbers compared by value;
              0 otherwise. Mirrors tiller's built-in `math_answer` rule.
  toy_digits  the share of the response's characters that are ASCII digits (the quickstart's task).

Write your own scorer as a function (sample) -> float and add it to TASKS. Score must be
idempotent: the client retries a call that failed with UNAVAILABLE, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED or ABORTED. Answer INVALID_ARGUMENT (context.abort) for input the scorer
cannot read; that ends the job with your message.

The Python stubs are generated from the .proto at start (grpcio-tools), into a cache folder.

For tests: --fail-first N answers UNAVAILABLE to the first N Score calls; --delay S sleeps S
seconds in every Score call; --port-file F writes the bound port to F once serving.
"""
import os
import re
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
import grpc_service  # noqa: E402  (examples/common/)


# --- scorers -------------------------------------------------------------------------------------

def extract_answer(text):
    """The text after the last '####' (to the end of its line), else the last \\boxed{...}."""
    i = text.rfind("####")
    if i >= 0:
        rest = text[i + 4:].strip()
        if rest:
            return rest.splitlines()[0].strip()
    i = text.rfind("\\boxed{")
    if i >= 0:
        depth, start = 1, i + len("\\boxed{")
        for k in range(start, len(text)):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:k].strip()
    return None


def _number(s):
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return float(s)
    except ValueError:
        return None


def math_score(sample):
    got = extract_answer(sample.response)
    want = extract_answer(sample.label) or sample.label.strip()
    if got is None or not want:
        return 0.0
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return 1.0 if abs(a - b) <= 1e-6 * max(1.0, abs(b)) else 0.0
    return 1.0 if got.strip() == want.strip() else 0.0


def toy_digits_score(sample):
    text = sample.response
    return sum(c.isascii() and c.isdigit() for c in text) / len(text) if text else 0.0


TASKS = {"math": math_score, "toy_digits": toy_digits_score}


# --- the service ---------------------------------------------------------------------------------

def make_servicer(pb, pb_grpc, task, fail_first, delay):
    import grpc

    score_fn = TASKS[task]

    class Reward(pb_grpc.RewardServicer):
        def __init__(self):
            self.lock = threading.Lock()
            self.calls = 0
            self.samples = 0

        def Score(self, request, context):
            with self.lock:
                self.calls += 1
                call = self.calls
            if call <= fail_first:
                print(f"reward server: call {call}: answering UNAVAILABLE (--fail-first {fail_first})", flush=True)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"injected failure {call} of {fail_first}")
            if delay > 0:
                time.sleep(delay)
            scores = []
            for s in request.samples:
                try:
                    scores.append(float(score_fn(s)))
                except Exception as e:  # a scorer bug: say which sample
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{task} failed on prompt line {s.prompt_index} sample {s.sample_index}: {e}")
            with self.lock:
                self.samples += len(scores)
            return pb.ScoreResponse(scores=scores)

        def Health(self, request, context):
            return pb.HealthResponse(name=task)

    return Reward()


def main():
    ap = grpc_service.parser(__doc__)
    grpc_service.add_arguments(ap, "reward", 50061)
    ap.add_argument("--task", default="math", choices=sorted(TASKS))
    ap.add_argument("--fail-first", type=int, default=0, help="answer UNAVAILABLE to the first N Score calls")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to sleep in every Score call")
    args = ap.parse_args()
    pb, pb_grpc = grpc_service.load_stubs(args.proto, "reward")
    servicer = make_servicer(pb, pb_grpc, args.task, args.fail_first, args.delay)
    grpc_service.serve(args, "reward", lambda server: pb_grpc.add_RewardServicer_to_server(servicer, server),
                       lambda: f"scoring '{args.task}' ({servicer.calls} calls, {servicer.samples} samples)")


if __name__ == "__main__":
    main()
