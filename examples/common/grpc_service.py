"""What tiller's example gRPC services share (examples/reward_server/, examples/envs/): stubs
generated from a .proto at start, the x-tiller-token check, TLS, the port file, and a clean stop
on SIGINT/SIGTERM.
"""
import argparse
import concurrent.futures
import hashlib
import hmac
import importlib
import os
import signal
import sys
import tempfile
import threading

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def load_stubs(proto_file, name):
    """Generates NAME_pb2 / NAME_pb2_grpc from the .proto (cached by its hash) and imports them."""
    from grpc_tools import protoc

    proto_file = os.path.abspath(proto_file)
    if not os.path.isfile(proto_file):
        sys.exit(f"{name} server: {proto_file} not found; pass --proto PATH/TO/tiller/{name}.proto")
    digest = hashlib.sha256(open(proto_file, "rb").read()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"tiller-{name}-pb-{digest}")
    if not os.path.isfile(os.path.join(out, "tiller", f"{name}_pb2_grpc.py")):
        tmp = tempfile.mkdtemp(prefix=f"tiller-{name}-pb-")
        root = os.path.dirname(os.path.dirname(proto_file))  # the folder that holds tiller/
        rc = protoc.main(["protoc", f"-I{root}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                          os.path.join("tiller", os.path.basename(proto_file))])
        if rc != 0:
            sys.exit(f"{name} server: protoc failed on {proto_file} (exit {rc})")
        try:
            os.rename(tmp, out)
        except OSError:  # another server made it first
            pass
    sys.path.insert(0, out)
    return importlib.import_module(f"tiller.{name}_pb2"), importlib.import_module(f"tiller.{name}_pb2_grpc")


def token_interceptor(token):
    """Refuses every call whose x-tiller-token metadata is not `token` (UNAUTHENTICATED)."""
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


def add_arguments(ap, name, default_port):
    """The options every example service takes."""
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (another than loopback needs --token-file or --insecure)")
    ap.add_argument("--token-file", help="first line: the token every call must carry (x-tiller-token)")
    ap.add_argument("--insecure", action="store_true", help="serve a non-loopback --host without a token")
    ap.add_argument("--tls-cert", help="PEM certificate to serve TLS with (with --tls-key)")
    ap.add_argument("--tls-key", help="PEM private key of --tls-cert")
    ap.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    ap.add_argument("--workers", type=int, default=8, help="calls served at once")
    ap.add_argument("--proto", default=os.path.join(REPO, "proto", "tiller", f"{name}.proto"))
    ap.add_argument("--port-file", help="write the bound port here once serving")


def serve(args, name, register, describe):
    """Serves until SIGINT/SIGTERM: register(server) adds the servicer; describe() is the line
    printed at start and stop."""
    import grpc

    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.readline().rstrip("\r\n")
        if not token:
            sys.exit(f"{name} server: --token-file {args.token_file}: its first line is empty")
    if token is None and not is_loopback(args.host):
        if not args.insecure:
            sys.exit(f"{name} server: --host {args.host} serves beyond this machine and no --token-file is given; "
                     "give one, bind 127.0.0.1, or pass --insecure")
        print(f"{name} server: warning: --insecure: anyone who can reach {args.host} may call it", flush=True)
    if bool(args.tls_cert) != bool(args.tls_key):
        sys.exit(f"{name} server: --tls-cert and --tls-key go together")
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=args.workers),
                         interceptors=[token_interceptor(token)] if token else [],
                         options=[("grpc.max_receive_message_length", 256 << 20),
                                  ("grpc.max_send_message_length", 256 << 20)])
    register(server)
    if args.tls_cert:
        with open(args.tls_key, "rb") as k, open(args.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(f"{args.host}:{args.port}", creds)
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        sys.exit(f"{name} server: cannot bind {args.host}:{args.port}")
    server.start()
    print(f"{name} server: {describe()} on {args.host}:{port}{' over TLS' if args.tls_cert else ''}"
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
    print(f"{name} server: stopped; {describe()}", flush=True)


def parser(doc):
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
