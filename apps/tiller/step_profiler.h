// Kineto (the engine of torch.profiler) around a few steps of a benchmark: CPU ops and CUDA
// kernels, saved as a Chrome trace (scripts/gpu/kernel_summary.py reads it). Header-only, for
// the bench commands; it pulls in the profiler's headers, so only they include it.
#pragma once

#include <set>
#include <string>

#include <torch/csrc/autograd/profiler_kineto.h>

namespace tiller::cli {

class StepProfiler {
 public:
  explicit StepProfiler(bool on) : on_(on) {
    if (!on_) return;
    namespace p = torch::profiler::impl;
    const p::ProfilerConfig cfg(p::ProfilerState::KINETO);
    const std::set<p::ActivityType> acts{p::ActivityType::CPU, p::ActivityType::CUDA};
    torch::autograd::profiler::prepareProfiler(cfg, acts);
    torch::autograd::profiler::enableProfiler(cfg, acts);
  }
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  void save(const std::string& path) {
    if (on_) torch::autograd::profiler::disableProfiler()->save(path);
    on_ = false;
  }
  ~StepProfiler() {
    if (on_) torch::autograd::profiler::disableProfiler();
  }

 private:
  bool on_;
};

}  // namespace tiller::cli
