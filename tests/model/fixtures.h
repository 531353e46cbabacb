// Where the Hugging Face fixtures live (made by make_hf_fixtures.py, a ctest fixture) and small
// helpers shared by the model tests.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

namespace tiller::test {

inline std::string hf_fixtures() { return TILLER_HF_FIXTURES; }
inline std::string scratch_dir() { return TILLER_TEST_SCRATCH; }

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": missing (run make_hf_fixtures.py, or ctest, which does)");
  return nlohmann::json::parse(in);
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out << data;
}

// The fixtures' models (make_hf_fixtures.py): a model's directory, and the reference outputs.
inline std::string model_dir(const std::string& name) { return hf_fixtures() + "/models/" + name; }
inline nlohmann::json model_reference() { return read_json(hf_fixtures() + "/models/reference.json"); }
inline double max_diff(const at::Tensor& a, const at::Tensor& b) { return a.sub(b).abs().max().item<double>(); }

}  // namespace tiller::test
