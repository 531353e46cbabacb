// Python reward functions in-process (python_reward.h). The glue that loads the file, inspects the
// function's parameters, calls it per sample (or per batch) and checks what it returns is Python,
// below; this file hands it the samples, turns its errors into one-line messages, and runs the
// watchdog that interrupts calls past their deadline (PyThreadState_SetAsyncExc).
//
// Lock order: the GIL, then Watch::mu (the watchdog waits on mu without the GIL and takes the GIL
// with mu released), so a worker that holds the GIL may always take mu.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "tiller/reward/python_reward.h"

#include <cctype>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "python/interpreter.h"
#include "tiller/core/error.h"

namespace tiller::reward {
namespace {

struct Spec {
  std::string path, function;
};

bool identifier(const std::string& s) {
  if (s.empty() || (std::isdigit(static_cast<unsigned char>(s[0])) != 0)) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_')) return false;
  return true;
}

// "file.py:function", or "file.py" for compute_score (a ':' in the path stays part of it).
Spec parse_spec(const std::string& spec) {
  if (spec.empty())
    throw ConfigError("reward.python is empty: set it to FILE.py:FUNCTION (e.g. rewards/gsm8k.py:compute_score)");
  const size_t colon = spec.rfind(':');
  if (colon != std::string::npos && identifier(spec.substr(colon + 1))) return {spec.substr(0, colon), spec.substr(colon + 1)};
  return {spec, "compute_score"};
}

}  // namespace

#if TILLER_HAVE_PYTHON
namespace {

using python::Gil;
using python::Ref;
using Clock = std::chrono::steady_clock;

constexpr const char* kGlueSource = R"PY(
import inspect, json, numbers, os, sys, traceback
from _tiller_user_code import LoadError, first_line as _first_line, where as _where, load_function

class CallTimeout(BaseException):
    """Raised inside a call that ran past reward.python_timeout_s (BaseException: `except Exception` lets it by)."""

class SampleError(Exception):
    def __init__(self, index, text):
        super().__init__(text)
        self.index, self.text = index, text

class Timeout(Exception):
    def __init__(self, index, text):
        super().__init__(text)
        self.index, self.text = index, text

VERL = ('data_source', 'solution_str', 'ground_truth', 'extra_info')
VERL_BATCH = ('data_sources', 'solution_strs', 'ground_truths', 'extra_infos')
TILLER = ('prompt_str', 'finish_reason', 'response_tokens')

def _number(v):
    if isinstance(v, (str, bytes)) or not (isinstance(v, numbers.Real) or
                                         (hasattr(v, 'dtype') and getattr(v, 'shape', None) == ()
                                          and v.dtype.kind in 'biuf')):
        raise TypeError(f'returned {type(v).__name__} {v!r:.60}; return a number or a dict with "score"')
    return float(v)

class Scorer:
    def __init__(self, fn, path, name, batched):
        self.fn, self.path, self.batched = fn, path, batched
        self.label = f'{name}()'
        self.names = self._parameters()

    def _parameters(self):
        accepted = VERL_BATCH if self.batched else VERL + TILLER
        plain = list(VERL_BATCH if self.batched else VERL)
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            return plain
        if any(p.kind == p.VAR_KEYWORD for p in params):
            return plain
        names = []
        for p in params:
            if p.kind == p.VAR_POSITIONAL:
                continue
            if p.name in accepted and p.kind != p.POSITIONAL_ONLY:
                names.append(p.name)
            elif p.default is p.empty:
                raise LoadError(f"{self.label} takes '{p.name}', which tiller does not pass "
                                f"(it passes {', '.join(accepted)} by keyword)")
        if not names:
            raise LoadError(f"{self.label} takes none of {', '.join(accepted)}")
        return names

    def _value(self, r, extras):
        if isinstance(r, dict):
            if 'score' not in r:
                raise TypeError(f'returned a dict without "score" (keys: {", ".join(map(str, r))})')
            for k, v in r.items():
                if k != 'score' and isinstance(v, numbers.Real):
                    s = extras.setdefault(str(k), [0.0, 0])
                    s[0] += float(v)
                    s[1] += 1
            return _number(r['score'])
        return _number(r)

    def _fail(self, index, e):
        if isinstance(e, CallTimeout):
            raise Timeout(index, _where(e, self.path)) from None
        raise SampleError(index, f'{_first_line(e)} at {_where(e, self.path)}') from None

    def score(self, rows):
        # row: (data_source, solution_str, label, label_is_json, extra_info_json, prompt, finish_reason, tokens)
        cols = {
            'data_source': [r[0] for r in rows],
            'solution_str': [r[1] for r in rows],
            'ground_truth': [json.loads(r[2]) if r[3] else r[2] for r in rows],
            'extra_info': [json.loads(r[4]) if r[4] else None for r in rows],
            'prompt_str': [r[5] for r in rows],
            'finish_reason': [r[6] for r in rows],
            'response_tokens': [r[7] for r in rows],
        }
        extras, scores = {}, []
        if self.batched:
            try:
                out = self.fn(**{n: cols[n[:-1]] for n in self.names})
            except BaseException as e:
                self._fail(-1, e)
            try:
                out = list(out)
            except TypeError:
                raise SampleError(-1, f'returned {type(out).__name__}; a batched function returns a list') from None
            if len(out) != len(rows):
                raise SampleError(-1, f'returned {len(out)} results for {len(rows)} samples')
            for i, r in enumerate(out):
                try:
                    scores.append(self._value(r, extras))
                except TypeError as e:
                    raise SampleError(i, str(e)) from None
        else:
            for i in range(len(rows)):
                try:
                    r = self.fn(**{n: cols[n][i] for n in self.names})
                except BaseException as e:
                    self._fail(i, e)
                try:
                    scores.append(self._value(r, extras))
                except TypeError as e:
                    raise SampleError(i, str(e)) from None
        return scores, {k: (v[0], v[1]) for k, v in extras.items()}

def load(path, name, batched):
    fn, path = load_function(path, name)
    return Scorer(fn, path, name, batched)
)PY";

// Calls in flight, for the watchdog.
struct Watch {
  struct Call {
    uint64_t seq = 0;
    Clock::time_point deadline;
    bool interrupted = false;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::map<unsigned long, Call> calls;  // by Python thread id
  uint64_t next_seq = 0;
  bool cancel_all = false;
  bool stop = false;
};

Ref text(const std::string& s) { return Ref(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace")); }

}  // namespace

struct PythonScorer::Impl {
  PythonOptions opts;
  Spec spec;
  std::string interpreter;
  PyObject* scorer = nullptr;         // the glue's Scorer (never released: see ~PythonScorer)
  PyObject* sample_error = nullptr;   // the glue's exception classes
  PyObject* timeout_error = nullptr;
  PyObject* call_timeout = nullptr;
  Watch watch;

  std::string where() const { return fmt::format("reward.python {}:{}", spec.path, spec.function); }

  // The watchdog: raises CallTimeout in calls past their deadline (every call once cancelled).
  void watch_calls() {
    std::unique_lock<std::mutex> lock(watch.mu);
    for (;;) {
      if (watch.stop) return;
      auto wake = Clock::time_point::max();
      std::vector<std::pair<unsigned long, uint64_t>> due;
      const auto now = Clock::now();
      for (auto& [id, c] : watch.calls) {
        if (c.interrupted) continue;
        if (watch.cancel_all || c.deadline <= now) {
          c.interrupted = true;
          due.emplace_back(id, c.seq);
        } else {
          wake = std::min(wake, c.deadline);
        }
      }
      if (!due.empty()) {
        lock.unlock();
        {
          Gil gil;
          std::lock_guard<std::mutex> again(watch.mu);
          for (const auto& [id, seq] : due) {
            auto it = watch.calls.find(id);
            if (it != watch.calls.end() && it->second.seq == seq) PyThreadState_SetAsyncExc(id, call_timeout);
          }
        }
        lock.lock();
        continue;
      }
      if (wake == Clock::time_point::max()) watch.cv.wait(lock);
      else watch.cv.wait_until(lock, wake);
    }
  }
};

PythonScorer::PythonScorer(const PythonOptions& opts) : impl_(std::make_shared<Impl>()) {
  Impl& m = *impl_;
  m.opts = opts;
  m.spec = parse_spec(opts.spec);
  if (!(opts.timeout_seconds > 0 && opts.timeout_seconds <= 86400))
    throw ConfigError(fmt::format("reward.python_timeout_s = {}: must be in (0, 86400]", opts.timeout_seconds));
  python::start();
  m.interpreter = python::describe();
  Gil gil;
  std::string error;
  Ref glue = python::ensure_user_code_module(error) ? python::module_from_source("_tiller_reward", kGlueSource, error)
                                                   : Ref();
  TILLER_CHECK(glue, "the Python reward glue did not load: {}", error);
  Ref scorer(PyObject_CallMethod(glue.get(), "load", "ssO", m.spec.path.c_str(), m.spec.function.c_str(),
                                 opts.batched ? Py_True : Py_False));
  if (!scorer) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Ref t(type), v(value), b(tb);
    Ref load_error(PyObject_GetAttrString(glue.get(), "LoadError"));
    std::string what;
    if (value != nullptr && load_error && PyObject_IsInstance(value, load_error.get()) == 1) {
      Ref s(PyObject_Str(value));
      what = python::utf8(s.get());
    } else {
      PyErr_Restore(t.release(), v.release(), b.release());
      what = python::take_error();
    }
    PyErr_Clear();
    throw ConfigError(fmt::format("reward.python {}: {}", opts.spec, what));
  }
  m.sample_error = PyObject_GetAttrString(glue.get(), "SampleError");
  m.timeout_error = PyObject_GetAttrString(glue.get(), "Timeout");
  m.call_timeout = PyObject_GetAttrString(glue.get(), "CallTimeout");
  TILLER_CHECK(m.sample_error && m.timeout_error && m.call_timeout, "the Python reward glue lacks its classes");
  m.scorer = scorer.release();
  std::thread([s = impl_] { s->watch_calls(); }).detach();
}

// The Python objects are not released: a worker left inside a call at shutdown may hold the GIL
// for good, and taking it here would hang. The interpreter is never finalized either.
PythonScorer::~PythonScorer() {
  {
    std::lock_guard<std::mutex> lock(impl_->watch.mu);
    impl_->watch.stop = true;
  }
  impl_->watch.cv.notify_all();
}

std::string PythonScorer::where() const { return impl_->where(); }
std::string PythonScorer::interpreter() const { return impl_->interpreter; }

void PythonScorer::on_cancel() {
  {
    std::lock_guard<std::mutex> lock(impl_->watch.mu);
    impl_->watch.cancel_all = true;
  }
  impl_->watch.cv.notify_all();
}

BatchScores PythonScorer::score(uint64_t step, const std::vector<RewardSample>& samples) {
  Impl& m = *impl_;
  if (cancelled()) throw CommError(fmt::format("{}: shutting down", m.where()));
  Gil gil;
  Ref rows(PyList_New(static_cast<Py_ssize_t>(samples.size())));
  TILLER_CHECK(rows, "{}: out of memory building the batch", m.where());
  for (size_t i = 0; i < samples.size(); ++i) {
    const RewardSample& s = samples[i];
    PyObject* row = PyTuple_New(8);
    TILLER_CHECK(row != nullptr, "{}: out of memory building the batch", m.where());
    PyList_SET_ITEM(rows.get(), static_cast<Py_ssize_t>(i), row);  // steals
    PyTuple_SET_ITEM(row, 0, text(s.data_source).release());
    PyTuple_SET_ITEM(row, 1, text(s.response).release());
    PyTuple_SET_ITEM(row, 2, text(s.label).release());
    PyTuple_SET_ITEM(row, 3, PyBool_FromLong(s.label_is_json ? 1 : 0));
    PyTuple_SET_ITEM(row, 4, text(s.extra_info).release());
    PyTuple_SET_ITEM(row, 5, text(s.prompt).release());
    PyTuple_SET_ITEM(row, 6, text(s.finish_reason).release());
    PyTuple_SET_ITEM(row, 7, PyLong_FromLongLong(s.response_tokens));
  }
  // Registered and unregistered with the GIL held, so the watchdog (which checks under the GIL)
  // never interrupts this thread outside the call.
  const unsigned long id = PyThread_get_thread_ident();
  {
    std::lock_guard<std::mutex> lock(m.watch.mu);
    m.watch.calls[id] = {++m.watch.next_seq,
                         Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(m.opts.timeout_seconds)),
                         false};
  }
  m.watch.cv.notify_all();
  Ref result(PyObject_CallMethod(m.scorer, "score", "O", rows.get()));
  {
    std::lock_guard<std::mutex> lock(m.watch.mu);
    m.watch.calls.erase(id);
  }
  PyThreadState_SetAsyncExc(id, nullptr);  // a CallTimeout set as the call returned is dropped
  if (!result) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Ref t(type), v(value), b(tb);
    const bool interrupted_in_glue = value != nullptr && PyObject_IsInstance(value, m.call_timeout) == 1;
    if (interrupted_in_glue) {
      PyErr_Clear();
      throw TimeoutError(fmt::format("{}: the call scoring {} samples from prompt line {} (step {}) ran past "
                                     "reward.python_timeout_s = {} s and was interrupted",
                                     m.where(), samples.size(), samples.empty() ? 0 : samples.front().prompt_index,
                                     step, m.opts.timeout_seconds));
    }
    const bool timed_out = value != nullptr && PyObject_IsInstance(value, m.timeout_error) == 1;
    const bool sample_error = value != nullptr && (timed_out || PyObject_IsInstance(value, m.sample_error) == 1);
    if (!sample_error) {
      PyErr_Restore(t.release(), v.release(), b.release());
      throw CommError(fmt::format("{}: the reward glue failed on step {}: {}", m.where(), step, python::take_error()));
    }
    Ref index_obj(PyObject_GetAttrString(value, "index"));
    Ref text_obj(PyObject_GetAttrString(value, "text"));
    const long long index = index_obj ? PyLong_AsLongLong(index_obj.get()) : -1;
    const std::string what = python::utf8(text_obj.get());
    PyErr_Clear();
    std::string sample;
    if (index >= 0 && static_cast<size_t>(index) < samples.size()) {
      sample = fmt::format("sample {} of prompt line {}", samples[static_cast<size_t>(index)].sample_index,
                           samples[static_cast<size_t>(index)].prompt_index);
    } else {
      sample = fmt::format("a batch of {} samples from prompt line {}", samples.size(),
                           samples.empty() ? 0 : samples.front().prompt_index);
    }
    if (timed_out)
      throw TimeoutError(fmt::format("{}: the call scoring {} (step {}) ran past reward.python_timeout_s = {} s and was "
                                     "interrupted at {}",
                                     m.where(), sample, step, m.opts.timeout_seconds, what));
    throw CommError(fmt::format("{}: {}, scoring {} (step {})", m.where(), what, sample, step));
  }
  BatchScores out;
  PyObject* scores = PyTuple_GetItem(result.get(), 0);  // borrowed
  PyObject* extras = PyTuple_GetItem(result.get(), 1);
  TILLER_CHECK(scores != nullptr && extras != nullptr && PyList_Check(scores) && PyDict_Check(extras),
               "{}: the reward glue answered an unexpected value", m.where());
  const Py_ssize_t n = PyList_Size(scores);
  out.scores.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) out.scores.push_back(PyFloat_AsDouble(PyList_GetItem(scores, i)));
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(extras, &pos, &key, &value)) {
    out.extras[python::utf8(key)] = {PyFloat_AsDouble(PyTuple_GetItem(value, 0)),
                                     PyLong_AsLongLong(PyTuple_GetItem(value, 1))};
  }
  PyErr_Clear();
  return out;
}

#else  // built without Python's development files

struct PythonScorer::Impl {};

PythonScorer::PythonScorer(const PythonOptions& opts) {
  parse_spec(opts.spec);
  python::start();  // throws: no embedded Python in this build
}
PythonScorer::~PythonScorer() = default;
std::string PythonScorer::where() const { return "reward.python"; }
std::string PythonScorer::interpreter() const { return ""; }
void PythonScorer::on_cancel() {}
BatchScores PythonScorer::score(uint64_t, const std::vector<RewardSample>&) {
  throw ConfigError("this tiller was built without an embedded Python");
}

#endif

}  // namespace tiller::reward
