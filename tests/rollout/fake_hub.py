#!/usr/bin/env python3
"""A stand-in for the Hugging Face hub's HTTP API on a local socket, serving model folders, for
tiller's downloads through huggingface_hub (HF_ENDPOINT=http://127.0.0.1:PORT) in tests where no
network is allowed. It answers what snapshot_download asks: the repo's revision (its commit), the
file tree, and each file's metadata (HEAD) and bytes (GET) under /resolve/. Each GET of a file is
counted; GET /_counts returns the counts as JSON.

  fake_hub.py ORG/NAME=FOLDER [...]     prints "port N" once listening
"""
import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

REPOS = {}
for arg in sys.argv[1:]:
    repo, folder = arg.split("=", 1)
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
    commit = hashlib.sha1(json.dumps(sorted(files)).encode() + repo.encode()).hexdigest()
    REPOS[repo] = {"commit": commit, "files": files}
COUNTS = {}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, code, body=b"", headers=None, head=False):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def not_found(self, head=False):
        self.send(404, b'{"error": "Repository not found"}',
                  {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found",
                   "Content-Type": "application/json"}, head)

    def route(self, head):
        path = unquote(urlparse(self.path).path)
        if path == "/_counts":
            with LOCK:
                return self.send(200, json.dumps(COUNTS).encode(), {"Content-Type": "application/json"}, head)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo = REPOS.get(f"{parts[2]}/{parts[3]}")
            if repo is None:
                return self.not_found(head)
            if parts[4] == "revision":
                if not head:  # one a snapshot_download: how many processes asked
                    with LOCK:
                        key = f"revision:{parts[2]}/{parts[3]}"
                        COUNTS[key] = COUNTS.get(key, 0) + 1
                info = {"id": f"{parts[2]}/{parts[3]}", "modelId": f"{parts[2]}/{parts[3]}", "sha": repo["commit"],
                        "private": False, "tags": [], "siblings": [{"rfilename": f} for f in repo["files"]]}
                return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            if parts[4] == "tree":
                tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for f, b in repo["files"].items()]
                return self.send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            name = f"{parts[0]}/{parts[1]}"
            repo = REPOS.get(name)
            if repo is None:
                return self.not_found(head)
            f = "/".join(parts[4:])
            body = repo["files"].get(f)
            if body is None:
                return self.send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
            if not head:
                with LOCK:
                    COUNTS[f"{name}/{f}"] = COUNTS.get(f"{name}/{f}", 0) + 1
            return self.send(200, body, {"X-Repo-Commit": repo["commit"],
                                         "ETag": '"' + hashlib.sha1(body).hexdigest() + '"',
                                         "Content-Type": "application/octet-stream"}, head)
        return self.send(404, b"")

    def do_GET(self):
        self.route(head=False)

    def do_HEAD(self):
        self.route(head=True)


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(f"port {server.server_address[1]}", flush=True)
server.serve_forever()
