// tiller export: a sharded training checkpoint consolidated into a Hugging Face directory.
#include <cstdio>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.h"
#include "tiller/core/error.h"
#include "tiller/zero/checkpoint.h"

namespace tiller::cli {
namespace {

struct ExportOptions {
  std::string checkpoint, to, dtype = "bf16";
};

int run_export(const ExportOptions& o) {
  const at::ScalarType dtype = parse_dtype(o.dtype);
  zero::export_hf(o.checkpoint, o.to, dtype);
  std::printf("exported %s (step %lld) to %s as %s\n", o.checkpoint.c_str(),
              static_cast<long long>(zero::checkpoint_steps(o.checkpoint)), o.to.c_str(), o.dtype.c_str());
  return 0;
}

}  // namespace

void add_zero_commands(CLI::App& app, Runner& run) {
  auto* ex = app.add_subcommand("export", "Write a sharded training checkpoint as a Hugging Face model directory");
  auto o = std::make_shared<ExportOptions>();
  ex->add_option("--checkpoint", o->checkpoint, "A checkpoint directory written by training (one model's)")->required();
  ex->add_option("--to", o->to, "Output directory (config.json, safetensors, tokenizer files)")->required();
  ex->add_option("--dtype", o->dtype, "bf16 (default), fp16 or fp32");
  ex->callback([&run, o] { run = [o] { return run_export(*o); }; });
}

}  // namespace tiller::cli
