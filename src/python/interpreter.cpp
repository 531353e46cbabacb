// Starting the embedded interpreter (interpreter.h) and the C API helpers of py_ref.h.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/interpreter.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

std::once_flag g_started;
std::string g_start_error;  // set once, by the call_once
std::string g_description;

bool executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// The interpreter whose prefix and site-packages the embedded one takes.
std::string program_name() {
  if (const char* p = std::getenv("TILLER_PYTHON"); p != nullptr && *p != '\0') return p;
  if (const char* v = std::getenv("VIRTUAL_ENV"); v != nullptr && *v != '\0') {
    const std::string exe = std::string(v) + "/bin/python3";
    if (executable_file(exe)) return exe;
  }
  return TILLER_PYTHON_EXECUTABLE;
}

std::string status_text(const PyStatus& st) {
  return st.err_msg != nullptr ? st.err_msg : "unknown error";
}

void start_once() {
  const std::string program = program_name();
  PyPreConfig pre;
  PyPreConfig_InitPythonConfig(&pre);
  pre.configure_locale = 0;  // the process's locale is tiller's
  pre.utf8_mode = 1;
  PyStatus st = Py_PreInitialize(&pre);
  if (PyStatus_Exception(st)) {
    g_start_error = status_text(st);
    return;
  }
  PyConfig config;
  PyConfig_InitPythonConfig(&config);
  config.install_signal_handlers = 0;
  config.parse_argv = 0;
  st = PyConfig_SetBytesString(&config, &config.program_name, program.c_str());
  if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
  PyConfig_Clear(&config);
  if (PyStatus_Exception(st)) {
    g_start_error = fmt::format("{} (as {})", status_text(st), program);
    return;
  }
  {
    Ref version(PySys_GetObject("version") != nullptr ? PyObject_Str(PySys_GetObject("version")) : nullptr);
    PyObject* exe = PySys_GetObject("executable");  // borrowed
    std::string v = version ? utf8(version.get()) : std::string(PY_VERSION);
    v = v.substr(0, v.find(' '));
    g_description = fmt::format("CPython {} at {}", v, exe != nullptr ? utf8(exe) : program);
    PyErr_Clear();
  }
  PyEval_SaveThread();  // the GIL is free from here on: every user takes it (Gil)
}

}  // namespace

bool available() { return true; }

void start() {
  std::call_once(g_started, start_once);
  if (!g_start_error.empty())
    throw ConfigError(fmt::format("the embedded Python did not start: {}; set TILLER_PYTHON to a python3 of the "
                                  "version tiller was built with ({})",
                                  g_start_error, PY_VERSION));
}

std::string describe() {
  start();
  return g_description;
}

std::string take_error() {
  if (!PyErr_Occurred()) return "";
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Ref t(type), v(value), b(tb);
  std::string name = "Exception";
  if (type != nullptr) {
    Ref n(PyObject_GetAttrString(type, "__name__"));
    if (n) name = utf8(n.get());
  }
  std::string text;
  if (value != nullptr) {
    Ref s(PyObject_Str(value));
    if (s) text = utf8(s.get());
  }
  PyErr_Clear();
  text = text.substr(0, text.find('\n'));
  return text.empty() ? name : name + ": " + text;
}

namespace {

constexpr const char* kUserCodeSource = R"PY(
import importlib.util, inspect, os, sys, traceback

class LoadError(Exception):
    pass

def first_line(e):
    lines = str(e).strip().splitlines()
    return f'{type(e).__name__}: {lines[0]}' if lines else type(e).__name__

def where(e, path):
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f.filename == path]
    if not mine:
        f = frames[-1] if frames else None
        return f'{f.filename}:{f.lineno} (in {f.name})' if f else path
    f, last = mine[-1], frames[-1]
    text = f'{f.filename}:{f.lineno} (in {f.name})'
    if last.filename != path:
        text += f', raised at {last.filename}:{last.lineno} (in {last.name})'
    return text

def load_function(path, name):
    path = os.path.realpath(path)
    if not os.path.isfile(path):
        raise LoadError('no such file')
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    taken = sys.modules.get(stem)
    if not stem.isidentifier() or (taken is not None and getattr(taken, '__file__', None) != path):
        stem = f'tiller_user_{abs(hash(path))}'
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise LoadError(f'{e.filename}:{e.lineno}: SyntaxError: {e.msg}') from None
    except BaseException as e:
        raise LoadError(f'{first_line(e)} at {where(e, path)}, while loading the file') from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == stem and not k.startswith('_'))
        raise LoadError(f"the file has no function '{name}' (its functions: {', '.join(found) or 'none'})")
    return fn, path
)PY";

}  // namespace

bool ensure_user_code_module(std::string& error) {
  if (PyObject* modules = PyImport_GetModuleDict(); PyDict_GetItemString(modules, "_tiller_user_code") != nullptr)
    return true;
  return static_cast<bool>(module_from_source("_tiller_user_code", kUserCodeSource, error));
}

std::string utf8(PyObject* s) {
  if (s == nullptr || !PyUnicode_Check(s)) return "";
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(s, &n);
  if (p == nullptr) {
    PyErr_Clear();
    return "";
  }
  return std::string(p, static_cast<size_t>(n));
}

Ref module_from_source(const char* name, const char* source, std::string& error) {
  Ref code(Py_CompileString(source, name, Py_file_input));
  if (!code) {
    error = take_error();
    return Ref();
  }
  Ref module(PyImport_ExecCodeModule(name, code.get()));
  if (!module) error = take_error();
  return module;
}

#else  // built without Python's development files

bool available() { return false; }

void start() {
  throw ConfigError("this tiller was built without an embedded Python (reward.type: python and parquet prompts need "
                    "it): install Python's development files (Debian: apt-get install python3-dev) and rebuild, "
                    "or use reward.type: remote and JSONL prompts");
}

std::string describe() {
  start();
  return "";
}

#endif

}  // namespace tiller::python
