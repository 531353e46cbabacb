// Python agent harnesses (agent_harness.h): a little glue loads the function and calls it with the
// keywords it takes; the C++ side passes each task as one JSON text.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/agent_harness.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "python/interpreter.h"
#include "tiller/core/error.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

constexpr const char* kGlue = R"PY(
import inspect, json, numbers
from _tiller_user_code import LoadError, first_line as _first_line, where as _where, load_function

KEYS = ('base_url', 'api_key', 'model', 'prompt', 'label', 'data_source', 'extra_info', 'sample', 'step',
        'prompt_line', 'timeout_s')

class Harness:
    def __init__(self, fn, path, name):
        self.fn, self.path, self.name = fn, path, name
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        if any(p.kind == p.VAR_KEYWORD for p in params):
            self.names = list(KEYS)
            return
        self.names = []
        for p in params:
            if p.name in KEYS:
                self.names.append(p.name)
            elif p.default is p.empty and p.kind not in (p.VAR_POSITIONAL,):
                raise LoadError(f"{name}() takes '{p.name}', which tiller does not pass "
                                f"(it passes: {', '.join(KEYS)}); give it a default or drop it")

    def run(self, task_json):
        task = json.loads(task_json)
        try:
            r = self.fn(**{k: task[k] for k in self.names})
        except BaseException as e:
            raise RuntimeError(f'{_first_line(e)} at {_where(e, self.path)}') from None
        if r is None:
            return None
        if isinstance(r, dict):
            if 'score' not in r:
                raise RuntimeError(f'{self.name}() returned a dict without "score" (keys: {", ".join(map(str, r))})')
            r = r['score']
        if isinstance(r, (bool, str, bytes)) or not isinstance(r, numbers.Real):
            raise RuntimeError(f'{self.name}() returned {type(r).__name__} {r!r:.60}; return a number, a dict with '
                               f'"score", or None')
        return float(r)

def load(path, name):
    fn, path = load_function(path, name)
    return Harness(fn, path, name)
)PY";

// The pending exception's message (str(e)), cleared.
std::string exception_text() {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Ref t(type), v(value), b(tb);
  if (!value) return "an unknown Python error";
  Ref s(PyObject_Str(value));
  return s ? utf8(s.get()) : std::string("an unprintable Python error");
}

class PythonHarness final : public controller::AgentHarness {
 public:
  PythonHarness(std::string spec, PyObject* harness) : spec_(std::move(spec)), harness_(harness) {}
  // harness_ is never released: a call left running at shutdown may hold the GIL for good.

  controller::AgentOutcome run(const controller::AgentTask& t, Deadline deadline) override {
    nlohmann::json label = t.label;
    if (t.label_is_json) label = nlohmann::json::parse(t.label, nullptr, /*allow_exceptions=*/false);
    nlohmann::json extra = nullptr;
    if (!t.extra_info.empty()) extra = nlohmann::json::parse(t.extra_info, nullptr, false);
    const nlohmann::json task{{"base_url", t.base_url},   {"api_key", t.api_key}, {"model", t.model},
                              {"prompt", t.prompt},       {"label", label},       {"data_source", t.data_source},
                              {"extra_info", extra},      {"sample", t.sample},   {"step", t.step},
                              {"prompt_line", t.prompt_line}, {"timeout_s", deadline.remaining_seconds()}};
    const std::string text = task.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    Gil gil;
    Ref r(PyObject_CallMethod(harness_, "run", "s", text.c_str()));
    if (!r) throw Error(fmt::format("agent.harness {}: {}", spec_, exception_text()));
    controller::AgentOutcome out;
    if (r.get() != Py_None) out.reward = PyFloat_AsDouble(r.get());
    return out;
  }
  std::string name() const override { return spec_; }

 private:
  std::string spec_;
  PyObject* harness_;
};

}  // namespace

std::shared_ptr<controller::AgentHarness> python_agent_harness(const std::string& spec) {
  const size_t colon = spec.rfind(':');
  const std::string path = colon == std::string::npos ? spec : spec.substr(0, colon);
  const std::string function = colon == std::string::npos ? "run" : spec.substr(colon + 1);
  start();
  Gil gil;
  std::string error;
  Ref glue = ensure_user_code_module(error) ? module_from_source("_tiller_agent", kGlue, error) : Ref();
  TILLER_CHECK(glue, "the Python agent glue did not load: {}", error);
  Ref harness(PyObject_CallMethod(glue.get(), "load", "ss", path.c_str(), function.c_str()));
  if (!harness) throw ConfigError(fmt::format("agent.harness {}: {}", spec, exception_text()));
  return std::make_shared<PythonHarness>(spec, harness.release());
}

#else

std::shared_ptr<controller::AgentHarness> python_agent_harness(const std::string& spec) {
  start();  // throws the ConfigError that says this build has no Python
  throw ConfigError(fmt::format("agent.harness {}: this build has no embedded Python", spec));
}

#endif

}  // namespace tiller::python
