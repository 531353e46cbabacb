#!/usr/bin/env python3
"""Example environments for tiller's multi-turn rollouts (proto/tiller/env.proto), in Python with
grpcio.

    python3 examples/envs/env_server.py --port 50071 --env calculator

Environments:
  calculator  arithmetic word problems with a calculator tool. The model writes
              <calc>12 * (3 + 4)</calc> and gets <result>84</result> back, as many times as it
              likes; <answer>84</answer> ends the episode with reward 1 when it equals the label
              (numbers compared by value), else 0. A turn with neither gets a reminder.
  guess       a number guessing game: the secret is the label (an integer) or, without one, drawn
              from the session id in [1, 100]. Each turn's last integer is the guess; the answer is
              "higher", "lower" or "correct" (done, reward 1).
  digits      the quickstart's toy task over turns (configs/quickstart_multiturn.yaml): each turn
              earns its share of digit characters / --turns, and is told how many digits it had;
              the episode ends after --turns turns. A tiny model learns it in a few minutes on CPU.

Write your own as a class with start(request) -> observation text and step(session, request) ->
(observation text, reward, done), and add it to ENVS. Calls must be idempotent (tiller retries
calls that failed with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED): Start of
a known session restarts it, a repeated (session, turn) Step answers what it answered before,
Close of an unknown session succeeds.

For tests: --fail-first N answers UNAVAILABLE to the first N calls; --delay S sleeps S seconds in
every Step; --port-file F writes the bound port to F once serving.
"""
import ast
import hashlib
import operator
import os
import re
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
import grpc_service  # noqa: E402  (examples/common/)

# --- environments --------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def evaluate(expr):
    """Arithmetic only (numbers, + - * / // % **, parentheses); ValueError for anything else."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("not arithmetic")
    if len(expr) > 200:
        raise ValueError("expression too long")
    try:
        return walk(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


def number(text):
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


class Calculator:
    name = "calculator"
    CALC = re.compile(r"<calc>(.*?)</calc>", re.S)
    ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

    def start(self, request):
        # The tool's instructions follow the prompt unless the prompt gives them already
        # (make_calculator_prompts.py's do, so that a chat template's turns stay intact).
        intro = "" if "<calc>" in request.prompt else ("Use <calc>expression</calc> to compute and "
                                                       "<answer>number</answer> to answer.")
        return {"label": request.label.strip()}, intro

    def step(self, state, request):
        text = request.action_text
        answer = self.ANSWER.search(text)
        if answer:
            got, want = number(answer.group(1)), number(state["label"])
            ok = got is not None and want is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
            return "", 1.0 if ok else 0.0, True
        calcs = self.CALC.findall(text)
        if calcs:
            results = []
            for expr in calcs[:4]:
                try:
                    v = evaluate(expr)
                    results.append(f"<result>{int(v) if float(v).is_integer() else round(v, 6)}</result>")
                except (ValueError, TypeError) as e:
                    results.append(f"<error>{e}</error>")
            return "".join(results), 0.0, False
        return "Use <calc>expression</calc> or give <answer>number</answer>.", 0.0, False


class Guess:
    name = "guess"
    INTEGER = re.compile(r"-?\d+")

    def start(self, request):
        label = request.label.strip()
        if re.fullmatch(r"-?\d+", label):
            secret = int(label)
        else:
            secret = 1 + int(hashlib.sha256(request.session_id.encode()).hexdigest(), 16) % 100
        return {"secret": secret}, "Guess a number between 1 and 100."

    def step(self, state, request):
        found = self.INTEGER.findall(request.action_text)
        if not found:
            return "Answer with a number.", 0.0, False
        guess = int(found[-1])
        if guess == state["secret"]:
            return "correct", 1.0, True
        return ("higher" if guess < state["secret"] else "lower"), 0.0, False


class Digits:
    name = "digits"

    def __init__(self, turns=3):
        self.turns = turns

    def start(self, request):
        return {}, ""

    def step(self, state, request):
        text = request.action_text
        digits = sum(c in "0123456789" for c in text)
        share = digits / len(text) if text else 0.0
        done = request.turn >= self.turns
        return ("" if done else f"\n[{digits} of {len(text)}] more:"), share / self.turns, done


ENVS = {e.name: e for e in (Calculator(), Guess(), Digits())}

# --- the service ---------------------------------------------------------------------------------


def make_servicer(pb, pb_grpc, env, fail_first, delay):
    import grpc

    class Environment(pb_grpc.EnvironmentServicer):
        def __init__(self):
            self.lock = threading.Lock()
            self.calls = 0
            self.sessions = {}   # id -> state
            self.replies = {}    # (id, turn) -> StepResponse: a repeated Step answers the same
            self.episodes = 0

        def _count(self, context):
            with self.lock:
                self.calls += 1
                call = self.calls
            if call <= fail_first:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"injected failure {call} of {fail_first}")

        def Start(self, request, context):
            self._count(context)
            state, text = env.start(request)
            with self.lock:
                self.sessions[request.session_id] = state
                self.replies = {k: v for k, v in self.replies.items() if k[0] != request.session_id}
                self.episodes += 1
            return pb.StartResponse(observation=pb.Observation(text=text))

        def Step(self, request, context):
            self._count(context)
            if delay > 0:
                time.sleep(delay)
            key = (request.session_id, request.turn)
            with self.lock:
                if key in self.replies:
                    return self.replies[key]
                state = self.sessions.get(request.session_id)
            if state is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}: Start it first")
            text, reward, done = env.step(state, request)
            reply = pb.StepResponse(observation=pb.Observation(text=text), reward=reward, done=done)
            with self.lock:
                self.replies[key] = reply
            return reply

        def Close(self, request, context):
            self._count(context)
            with self.lock:
                self.sessions.pop(request.session_id, None)
                self.replies = {k: v for k, v in self.replies.items() if k[0] != request.session_id}
            return pb.CloseResponse()

        def Health(self, request, context):
            return pb.HealthResponse(name=env.name)

    return Environment()


def main():
    ap = grpc_service.parser(__doc__)
    grpc_service.add_arguments(ap, "env", 50071)
    ap.add_argument("--env", default="calculator", choices=sorted(ENVS))
    ap.add_argument("--fail-first", type=int, default=0, help="answer UNAVAILABLE to the first N calls")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to sleep in every Step")
    ap.add_argument("--turns", type=int, default=3, help="digits: turns per episode")
    args = ap.parse_args()
    ENVS["digits"].turns = max(1, args.turns)
    pb, pb_grpc = grpc_service.load_stubs(args.proto, "env")
    servicer = make_servicer(pb, pb_grpc, ENVS[args.env], args.fail_first, args.delay)
    grpc_service.serve(args, "env", lambda server: pb_grpc.add_EnvironmentServicer_to_server(servicer, server),
                       lambda: f"environment '{args.env}' ({servicer.episodes} episodes, "
                               f"{len(servicer.sessions)} open)")


if __name__ == "__main__":
    main()
