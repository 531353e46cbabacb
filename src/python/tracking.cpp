// Experiment tracking (tracking.h): a few lines of Python hold the trackers' runs; the C++ side
// passes each step's metrics as one JSON text.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/tracking.h"

#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "python/interpreter.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

constexpr const char* kTrackingSource = R"PY(
import json
import re


def _config(text):
    try:
        import yaml
        return yaml.safe_load(text) or {}
    except Exception:
        return {'tiller_config': text}


def _flat(d, prefix=''):
    out = {}
    for k, v in (d or {}).items():
        key = f'{prefix}{k}'
        if isinstance(v, dict):
            out.update(_flat(v, key + '.'))
        else:
            out[key] = v
    return out


def _mlflow_key(k):
    return re.sub(r'[^A-Za-z0-9_\-. :/]', '_', k.replace('@', '_at_'))


_SAMPLE_COLUMNS = ['step', 'prompt_line', 'sample', 'prompt', 'response', 'reward', 'advantage']


class Tracker:
    def __init__(self, opts_json):
        o = json.loads(opts_json)
        self.config = _config(o['config_yaml'])
        self.wandb = None
        self.mlflow = None
        if o['wandb_project']:
            try:
                import wandb
            except ImportError as e:
                raise ImportError('logging.wandb.project is set and the embedded Python has no wandb '
                                  '(pip install wandb)') from e
            self._wandb = wandb
            tags = [t.strip() for t in o['wandb_tags'].split(',') if t.strip()]
            kwargs = dict(project=o['wandb_project'], entity=o['wandb_entity'] or None, name=o['wandb_name'] or None,
                          tags=tags or None, mode=o['wandb_mode'], dir=o['wandb_dir'], config=self.config)
            try:
                settings = wandb.Settings(silent=True, console='off')
            except Exception:
                settings = None
            self.wandb = wandb.init(**kwargs, settings=settings) if settings else wandb.init(**kwargs)
            self.wandb.config.update({'tiller_output_dir': o['output_dir']}, allow_val_change=True)
        if o['mlflow_experiment']:
            try:
                import mlflow
            except ImportError as e:
                raise ImportError('logging.mlflow.experiment is set and the embedded Python has no mlflow '
                                  '(pip install mlflow-skinny)') from e
            self._mlflow = mlflow
            if o['mlflow_tracking_uri']:
                mlflow.set_tracking_uri(o['mlflow_tracking_uri'])
            mlflow.set_experiment(o['mlflow_experiment'])
            self.mlflow = mlflow.start_run(run_name=o['mlflow_run_name'] or None)
            params = [(k, str(v)[:6000]) for k, v in _flat(self.config).items()]
            for i in range(0, len(params), 100):
                mlflow.log_params(dict(params[i:i + 100]))
            mlflow.log_dict(self.config, 'tiller_config.json')
            mlflow.set_tag('tiller.output_dir', o['output_dir'])

    def log(self, step, metrics_json):
        m = json.loads(metrics_json)
        if self.wandb is not None:
            self.wandb.log(m, step=step)
        if self.mlflow is not None:
            self._mlflow.log_metrics({_mlflow_key(k): v for k, v in m.items()}, step=step)

    def samples(self, step, rows_json):
        rows = json.loads(rows_json)
        if not rows:
            return
        if self.wandb is not None:
            table = self._wandb.Table(columns=_SAMPLE_COLUMNS, data=[[r.get(c) for c in _SAMPLE_COLUMNS] for r in rows])
            self.wandb.log({'samples': table}, step=step)
        if self.mlflow is not None:
            self._mlflow.log_dict(rows, f'samples/step_{step}.json')

    def finish(self, ok):
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if ok else 1)
            self.wandb = None
        if self.mlflow is not None:
            self._mlflow.end_run(status='FINISHED' if ok else 'FAILED')
            self.mlflow = None
)PY";

// Calls tracker.<method>(*args) under the GIL; the Python error's text when it raises ("" when not).
std::string call(PyObject* tracker, const char* method, PyObject* a, PyObject* b) {
  Ref fn(PyObject_GetAttrString(tracker, method));
  if (!fn) return take_error();
  Ref out(PyObject_CallFunctionObjArgs(fn.get(), a, b, nullptr));
  return out ? std::string() : take_error();
}

Ref str(const std::string& s) { return Ref(PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()))); }

}  // namespace

struct Tracking::Impl {
  Ref module, tracker;  // under the GIL
  bool warned = false, finished = false;
};

Tracking::Tracking(const TrackingOptions& o) : impl_(std::make_unique<Impl>()) {
  start();
  nlohmann::json j{{"wandb_project", o.wandb_project}, {"wandb_entity", o.wandb_entity}, {"wandb_name", o.wandb_name},
                   {"wandb_tags", o.wandb_tags},       {"wandb_mode", o.wandb_mode},     {"wandb_dir", o.wandb_dir},
                   {"mlflow_experiment", o.mlflow_experiment}, {"mlflow_tracking_uri", o.mlflow_tracking_uri},
                   {"mlflow_run_name", o.mlflow_run_name},     {"config_yaml", o.config_yaml},
                   {"output_dir", o.output_dir}};
  Gil gil;
  std::string error;
  impl_->module = module_from_source("tiller_tracking", kTrackingSource, error);
  if (!impl_->module) throw ConfigError(fmt::format("experiment tracking: {}", error));
  Ref cls(PyObject_GetAttrString(impl_->module.get(), "Tracker"));
  Ref arg = str(j.dump());
  if (!cls || !arg) throw ConfigError(fmt::format("experiment tracking: {}", take_error()));
  impl_->tracker = Ref(PyObject_CallFunctionObjArgs(cls.get(), arg.get(), nullptr));
  if (!impl_->tracker) throw ConfigError(fmt::format("experiment tracking did not start: {}", take_error()));
  std::string what;
  if (!o.wandb_project.empty()) what += fmt::format("W&B project {} ({})", o.wandb_project, o.wandb_mode);
  if (!o.mlflow_experiment.empty())
    what += fmt::format("{}MLflow experiment {}{}", what.empty() ? "" : ", ", o.mlflow_experiment,
                        o.mlflow_tracking_uri.empty() ? "" : " at " + o.mlflow_tracking_uri);
  log::info("tracking: {}", what);
}

Tracking::~Tracking() {
  if (!impl_->finished) {
    try {
      finish(false);
    } catch (...) {
    }
  }
  Gil gil;
  impl_->tracker = Ref();
  impl_->module = Ref();
}

void Tracking::log(int64_t step, const std::vector<std::pair<std::string, double>>& metrics) {
  nlohmann::json m = nlohmann::json::object();
  for (const auto& [k, v] : metrics)
    if (std::isfinite(v)) m[k] = v;
  Gil gil;
  Ref s(PyLong_FromLongLong(step));
  Ref text = str(m.dump());
  const std::string error = call(impl_->tracker.get(), "log", s.get(), text.get());
  if (!error.empty() && !impl_->warned) {
    impl_->warned = true;
    log::warn("tracking: logging step {} failed: {} (metrics.jsonl has every step; no more warnings)", step, error);
  }
}

void Tracking::samples(int64_t step, const std::string& rows_json) {
  Gil gil;
  Ref s(PyLong_FromLongLong(step));
  Ref text = str(rows_json);
  const std::string error = call(impl_->tracker.get(), "samples", s.get(), text.get());
  if (!error.empty() && !impl_->warned) {
    impl_->warned = true;
    log::warn("tracking: logging step {}'s samples failed: {} (samples.jsonl has them; no more warnings)", step, error);
  }
}

void Tracking::finish(bool ok) {
  if (impl_->finished) return;
  impl_->finished = true;
  Gil gil;
  Ref flag(PyBool_FromLong(ok ? 1 : 0));
  Ref fn(PyObject_GetAttrString(impl_->tracker.get(), "finish"));
  Ref out(fn ? PyObject_CallFunctionObjArgs(fn.get(), flag.get(), nullptr) : nullptr);
  if (!out) log::warn("tracking: finishing the runs failed: {}", take_error());
}

#else  // built without Python's development files

struct Tracking::Impl {};

Tracking::Tracking(const TrackingOptions&) { start(); }  // throws: no embedded Python
Tracking::~Tracking() = default;
void Tracking::log(int64_t, const std::vector<std::pair<std::string, double>>&) {}
void Tracking::samples(int64_t, const std::string&) {}
void Tracking::finish(bool) {}

#endif

}  // namespace tiller::python
