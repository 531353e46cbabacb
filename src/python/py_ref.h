// Small RAII helpers over the CPython C API for src/python and src/reward/python_reward.cpp (the
// only files that include Python.h). Compiled only with TILLER_HAVE_PYTHON.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string>
#include <utility>

namespace tiller::python {

// Holds the GIL for its scope (any thread, after start()).
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// An owned reference (released under the GIL, which its holder must hold).
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* owned) : p_(owned) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(Ref&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Ref& operator=(Ref&& o) noexcept {
    if (this != &o) {
      Py_XDECREF(p_);
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* get() const { return p_; }
  PyObject* release() { return std::exchange(p_, nullptr); }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  PyObject* p_ = nullptr;
};

// The pending Python exception as "TypeName: message" (first line), cleared; "" when none.
std::string take_error();

// A str object's UTF-8 text; "" for anything else.
std::string utf8(PyObject* s);

// Runs `source` as a fresh module named `name` and returns it; the error's text when it fails.
Ref module_from_source(const char* name, const char* source, std::string& error);

// Makes sure the module `_tiller_user_code` exists, the loading of a user's Python file that the
// glues of Python rewards and agent harnesses import: LoadError; first_line(e) ("Type: first
// line"); where(e, path) (the file and line in `path` an exception passed, and where it was raised
// when elsewhere); load_function(path, name) -> (function, real path), which loads the file once as
// a module of its own (its folder first on sys.path) and raises LoadError naming what is wrong.
// With the GIL held; false (and the error's text) when it cannot be made.
bool ensure_user_code_module(std::string& error);

}  // namespace tiller::python
