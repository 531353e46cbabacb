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
import argparse
import concurrent.futures
import hashlib
import importlib
import os
import re
import signal
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROTO = os.path.join(HERE, "..", "..", "proto", "tiller", "reward.proto")


def load_stubs(proto_file):
    """Generates reward_pb2 / reward_pb2_grpc from the .proto (cached by its hash) and imports them."""
    from grpc_tools import protoc

    proto_file = os.path.abspath(proto_file)
    if not os.path.isfile(proto_file):
        sys.exit(f"reward server: {proto_file} not found; pass --proto PATH/TO/tiller/reward.proto")
    digest = hashlib.sha256(open(proto_file, "rb").read()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"tiller-reward-pb-{digest}")
    if not os.path.isfile(os.path.join(out, "tiller", "reward_pb2_grpc.py")):
        tmp = tempfile.mkdtemp(prefix="tiller-reward-pb-")
        root = os.path.dirname(os.path.dirname(proto_file))  # the folder that holds tiller/
        rc = protoc.main(["protoc", f"-I{root}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                          os.path.join("tiller", os.path.basename(proto_file))])
        if rc != 0:
            sys.exit(f"reward server: protoc failed on {proto_file} (exit {rc})")
        try:
            os.rename(tmp, out)
        except OSError:  # another server made it first
            pass
    sys.path.insert(0, out)
    return importlib.import_module("tiller.reward_pb2"), importlib.import_module("tiller.reward_pb2_grpc")


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


def token_interceptor(token):
    """Refuses every call whose x-tiller-token metadata is not `token` (UNAUTHENTICATED)."""
    import hmac

    import grpc

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-tiller-token")

    class Check(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            got = dict(details.invocation_metadata).get("x-tiller-token", "")
            if hmac.compare_digest(got.encode(), token.encode()):
                return continuation(details)
            return grpc.unary_unary_rpc_method_handler(refuse)

    return Check()


def is_loopback(host):
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (another than loopback needs --token-file or --insecure)")
    ap.add_argument("--token-file", help="first line: the token every call must carry (x-tiller-token); "
                                         "tiller sends it with reward.remote_token_file")
    ap.add_argument("--insecure", action="store_true", help="serve a non-loopback --host without a token")
    ap.add_argument("--tls-cert", help="PEM certificate to serve TLS with (with --tls-key); tiller dials it "
                                       "with reward.remote_tls_ca")
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ap.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    ap.add_argument("--task", default="math", choices=sorted(TASKS))
    ap.add_argument("--workers", type=int, default=8, help="calls served at once")
    ap.add_argument("--proto", default=DEFAULT_PROTO)
    ap.add_argument("--port-file", help="write the bound port here once serving")
    ap.add_argument("--fail-first", type=int, default=0, help="answer UNAVAILABLE to the first N Score calls")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to sleep in every Score call")
    args = ap.parse_args()

    import grpc

    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.readline().rstrip("\r\n")
        if not token:
            sys.exit(f"reward server: --token-file {args.token_file}: its first line is empty")
    if token is None and not is_loopback(args.host):
        if not args.insecure:
            sys.exit(f"reward server: --host {args.host} serves beyond this machine and no --token-file is given; "
                     "give one, bind 127.0.0.1, or pass --insecure")
        print(f"reward server: warning: --insecure: anyone who can reach {args.host} may call it", flush=True)
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit("reward server: --tls-cert and --tls-key go together")

    pb, pb_grpc = load_stubs(args.proto)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=args.workers),
                         interceptors=[token_interceptor(token)] if token else [],
                         options=[("grpc.max_receive_message_length", 256 << 20),
                                  ("grpc.max_send_message_length", 256 << 20)])
    servicer = make_servicer(pb, pb_grpc, args.task, args.fail_first, args.delay)
    pb_grpc.add_RewardServicer_to_server(servicer, server)
    if args.tls_cert:
        with open(args.tls_key, "rb") as k, open(args.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(f"{args.host}:{args.port}", creds)
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        sys.exit(f"reward server: cannot bind {args.host}:{args.port}")
    server.start()
    print(f"reward server: scoring '{args.task}' on {args.host}:{port}{' over TLS' if args.tls_cert else ''}"
          f"{' (token required)' if token else ''}", flush=True)
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace=2).wait()
    print(f"reward server: stopped after {servicer.calls} calls, {servicer.samples} samples", flush=True)


if __name__ == "__main__":
    main()
