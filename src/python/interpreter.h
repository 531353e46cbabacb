// The process's embedded CPython interpreter (private to src/): started once, on first use, and
// never finalized (a reward function's thread may still be inside it at exit; finalizing under it
// would hang or crash). Started with Python's own signal handlers off (tiller's handle SIGTERM),
// the process locale untouched and UTF-8 mode on; PYTHONPATH and the other PYTHON* variables
// apply as they do to `python3`.
//
// Which Python: the one tiller was built against (its standard library and site-packages), or
// the interpreter named by $TILLER_PYTHON, or the active venv's ($VIRTUAL_ENV/bin/python3) — the
// same version, since the library is linked. After start() the GIL is free: any thread takes it
// for its calls (py_ref.h's Gil).
//
// Threading: start(), available() and describe() from any thread.
#pragma once

#include <string>

namespace tiller::python {

// Whether this build embeds CPython (built with Python's development files).
bool available();
// Starts the interpreter unless it runs already. ConfigError naming what to do when the build
// has none or it cannot start.
void start();
// "CPython 3.11.7 at /usr/bin/python3" (starts the interpreter).
std::string describe();

}  // namespace tiller::python
