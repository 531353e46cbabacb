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
  std::string checkpoint, to, dtype = "bf16", base;
  bool lora = false;
};

int run_export(const ExportOptions& o) {
  if (o.lora) {
    zero::export_lora_adapter(o.checkpoint, o.to, o.base);
    std::printf("exported the LoRA adapter of %s (step %lld) to %s (PEFT's adapter_config.json and "
                "adapter_model.safetensors)\n",
                o.checkpoint.c_str(), static_cast<long long>(zero::checkpoint_steps(o.checkpoint)), o.to.c_str());
    return 0;
  }
  const at::ScalarType dtype = parse_dtype(o.dtype);
  zero::export_hf(o.checkpoint, o.to, dtype, o.base);
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
  ex->add_flag("--lora", o->lora,
               "A LoRA checkpoint: write its adapter as PEFT's files (adapter_config.json + "
               "adapter_model.safetensors) instead of the merged model");
  ex->add_option("--base", o->base,
                 "The base model of a LoRA checkpoint (default: the model the run trained on, as recorded); the "
                 "merge reads its weights, and both exports name it");
  ex->callback([&run, o] { run = [o] { return run_export(*o); }; });
}

}  // namespace tiller::cli
