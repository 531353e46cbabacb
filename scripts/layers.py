#!/usr/bin/env python3
# Which folder of src/ (and apps/) includes another folder's private headers ("X/..." resolved
# under src/), from the tree at a git revision or the working tree: the layering of
# docs/architecture.md, to check that no include runs back up it.
#   python3 scripts/layers.py [REV]
import collections
import re
import subprocess
import sys

rev = sys.argv[1] if len(sys.argv) > 1 else None


def files():
    if rev:
        out = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "src", "apps"]).decode().split()
    else:
        out = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard", "src", "apps"]).decode().split()
    return [f for f in out if f.endswith((".cpp", ".h", ".cu", ".cuh"))]


def text(f):
    if rev:
        return subprocess.check_output(["git", "show", f"{rev}:{f}"]).decode(errors="replace")
    return open(f, errors="replace").read()


private = collections.defaultdict(set)
for f in files():
    parts = f.split("/")
    folder = parts[1] if parts[0] == "src" else "apps"
    private.setdefault(folder, set())
    for inc in re.findall(r'#include "([^"]+)"', text(f)):
        p = inc.split("/")
        if len(p) > 1 and p[0] != "tiller" and p[0] != folder:
            private[folder].add(p[0])
for k in sorted(private):
    print(f"{k:11s} {', '.join(sorted(private[k])) or '-'}")
