// Shared state of the multi-rank tests: the MPI environment and the communicator under test
// (MPI backend on CPU, or NCCL on one GPU per rank when TILLER_TEST_BACKEND=nccl).
#pragma once

#include <ATen/ATen.h>

#include "tiller/dist/communicator.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/model/lora.h"

namespace tiller::test {

struct MpiTestEnv {
  dist::MpiEnv* env = nullptr;
  dist::Communicator* world = nullptr;  // MPI backend, always
  dist::Communicator* comm = nullptr;   // the backend under test
  at::TensorOptions device;             // where the backend's tensors live
};

MpiTestEnv& mpi_test_env();

// Adapters to check a LoRA sync with: PEFT's initialisation (A from `seed`), and B, which PEFT
// starts at zero, drawn from seed + 1 so that every adapter carries values.
inline model::NamedTensors test_adapters(const model::ModelConfig& cfg, const model::LoraSpec& spec, uint64_t seed) {
  model::NamedTensors out = model::init_lora(cfg, spec, seed);
  at::Generator gen = at::detail::createCPUGenerator(seed + 1);
  for (auto& [n, t] : out)
    if (n.find("lora_B") != std::string::npos) t = at::randn(t.sizes(), gen, at::kFloat);
  return out;
}

}  // namespace tiller::test
