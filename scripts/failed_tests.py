#!/usr/bin/env python3
"""After a failed ctest run: each failing test's name and the last lines it printed, read from
ctest's own log (build/Testing/Temporary/LastTest.log). scripts/test.sh prints this last, so that
a CI log cut to its tail still says why each test failed.

Usage: failed_tests.py BUILD_DIR [LINES]"""
import re
import sys
from pathlib import Path


def sections(log):
    """(name, output lines, passed) per test in ctest's LastTest.log."""
    name, out, inside = None, [], False
    for line in log.splitlines():
        m = re.match(r"^\d+/\d+ Testing: (\S+)", line)
        if m:
            name, out, inside = m.group(1), [], False
        elif line.startswith("Output:") and name:
            inside = True
        elif line.startswith("<end of output>"):
            inside = False
        elif inside and not line.startswith("-" * 20):
            out.append(line)
        elif line.startswith("Test Passed.") or line.startswith("Test Failed") or "***" in line:
            if name:
                yield name, out, line.startswith("Test Passed.")
                name = None


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: failed_tests.py BUILD_DIR [LINES]")
    lines = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    path = Path(sys.argv[1]) / "Testing" / "Temporary" / "LastTest.log"
    if not path.is_file():
        sys.exit(f"failed_tests.py: {path} does not exist (did ctest run?)")
    failed = [(n, o) for n, o, ok in sections(path.read_text(errors="replace")) if not ok]
    print(f"==== {len(failed)} failing test(s); the last {lines} lines each printed ====")
    for name, out in failed:
        print(f"---- {name}")
        for line in out[-lines:]:
            print(line if len(line) <= 400 else line[:400] + " …")


if __name__ == "__main__":
    main()
