#include "tiller/zero/checkpoint.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/model/lora.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/weights.h"
#include "tiller/zero/flat_layout.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::zero {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kFormat = "tiller-zero-1";

std::string rank_file(const std::string& dir, int rank) { return fmt::format("{}/rank_{:05d}.safetensors", dir, rank); }
const char* head_name(model::Head h) { return h == model::Head::kLm ? "lm" : "value"; }

// Every rank says whether it failed; returns the lowest failing group rank, or -1. Collective.
int first_failure(ShardedModel& m, bool failed) {
  dist::Communicator& comm = m.communicator();
  const auto opts = at::TensorOptions().dtype(at::kInt).device(m.options().device);
  at::Tensor t = at::full({1}, failed ? comm.size() - comm.rank() : 0, opts);
  comm.all_reduce(t, dist::ReduceOp::kMax)->wait();
  const int v = t.cpu().item<int>();
  return v == 0 ? -1 : comm.size() - v;
}

// Runs `f`; returns the error text ("" on success) so that every rank can reach the agreement.
template <class F>
std::string attempt(F&& f, std::exception_ptr* keep = nullptr) {
  try {
    f();
    return {};
  } catch (const std::exception& e) {
    if (keep) *keep = std::current_exception();
    return e.what()[0] ? e.what() : "unknown error";
  }
}

json read_meta(const std::string& dir) {
  const auto text = read_file(dir + "/meta.json");
  if (!text) {
    // A step folder (checkpoint.dir/step_N) holds one checkpoint per role: name them.
    std::string roles;
    for (const char* r : {"actor", "critic", "ref", "reward"})
      if (read_file(dir + "/" + r + "/meta.json")) roles += fmt::format("{}{}/{}", roles.empty() ? "" : ", ", dir, r);
    if (!roles.empty())
      throw IoError(fmt::format("{}: no meta.json here; this is a step folder: its roles' checkpoints are {}", dir, roles));
    throw IoError(fmt::format("{}: no meta.json; not a tiller checkpoint, or its save never completed", dir));
  }
  json meta;
  try {
    meta = json::parse(*text);
  } catch (const std::exception& e) {
    throw IoError(fmt::format("{}/meta.json: not valid JSON: {}", dir, e.what()));
  }
  if (!meta.is_object() || meta.value("format", "") != kFormat)
    throw IoError(fmt::format("{}/meta.json: format is not {}", dir, kFormat));
  return meta;
}

// DIR, or DIR.old when a save was interrupted between moving DIR aside and renaming DIR.tmp.
std::string resolve(const std::string& dir) {
  if (!fs::exists(dir + "/meta.json") && fs::exists(dir + ".old/meta.json")) {
    log::warn("{}: incomplete; loading {}.old, left by an interrupted save", dir, dir);
    return dir + ".old";
  }
  return dir;
}

void save_rng(model::NamedTensors& out, const at::Device& device) {
  out["rng.cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  if (device.is_cuda()) out["rng.cuda"] = at::globalContext().defaultGenerator(device).get_state();
}
void load_rng(const model::SafetensorsFile& f, const at::Device& device) {
  if (f.contains("rng.cpu")) {
    at::Generator g = at::detail::getDefaultCPUGenerator();  // a handle sharing the default's state
    g.set_state(f.tensor("rng.cpu").clone());
  }
  if (device.is_cuda() && f.contains("rng.cuda")) {
    at::Generator g = at::globalContext().defaultGenerator(device);
    g.set_state(f.tensor("rng.cuda").clone());
  }
}

// A LoRA model's spec as meta.json records it.
json lora_meta(const model::LoraSpec& spec) {
  json targets = json::array();
  for (size_t m = 0; m < spec.targets.size(); ++m)
    if (spec.targets[m]) targets.push_back(model::lora_module_name(static_cast<model::LoraModule>(m)));
  return {{"rank", spec.rank}, {"alpha", spec.alpha}, {"use_rslora", spec.use_rslora}, {"target_modules", targets}};
}

}  // namespace

void save_checkpoint(ShardedModel& model, const std::string& dir, const SaveOptions& options) {
  dist::Communicator& comm = model.communicator();
  const int me = comm.rank();
  const std::string tmp = dir + ".tmp", old = dir + ".old";
  std::string err;
  if (me == 0) err = attempt([&] {
    remove_tree(tmp);
    FileSystem::current().make_dirs(tmp);
  });
  int bad = first_failure(model, !err.empty());
  if (bad >= 0) throw IoError(fmt::format("checkpoint {}: cannot create {}: {}", dir, tmp, err.empty() ? "see rank 0" : err));

  // A LoRA model saves its adapters and their moments (rank 0: every rank holds the same); its
  // frozen base is the source model's, which the role loads before a resume.
  const bool lora = model.lora();
  const auto states = lora ? std::vector<ShardedModel::UnitState>{} : model.unit_states();
  err = attempt([&] {
    if (lora) {
      if (me == 0) {
        const ShardedModel::LoraState st = model.lora_state();
        model::NamedTensors tensors = st.adapters;
        tensors["lora.exp_avg"] = st.exp_avg;
        tensors["lora.exp_avg_sq"] = st.exp_avg_sq;
        save_rng(tensors, model.options().device);
        model::write_safetensors(tmp + "/lora.safetensors", tensors);
      }
    } else if (!model.options().replicate || me == 0) {
      model::NamedTensors tensors;
      for (const auto& s : states) {
        tensors[s.name + ".master"] = s.master;
        if (s.exp_avg.defined()) {
          tensors[s.name + ".exp_avg"] = s.exp_avg;
          tensors[s.name + ".exp_avg_sq"] = s.exp_avg_sq;
        }
      }
      save_rng(tensors, model.options().device);
      model::write_safetensors(rank_file(tmp, model.rank()), tensors,
                               {{"rank", std::to_string(model.rank())}, {"world", std::to_string(model.world())}});
    }
    if (options.after_write) options.after_write(me);
  });
  bad = first_failure(model, !err.empty());
  if (bad >= 0) {
    if (me == 0) attempt([&] { remove_tree(tmp); });
    first_failure(model, false);  // every rank leaves once the temporary directory is gone
    throw IoError(fmt::format("checkpoint {}: rank {} failed to write its shard{}; the previous checkpoint is untouched",
                              dir, bad, err.empty() ? "" : ": " + err));
  }

  if (me == 0) err = attempt([&] {
    const auto& o = model.options();
    json meta;
    meta["format"] = kFormat;
    meta["world"] = model.world();
    meta["steps"] = model.steps();
    meta["head"] = head_name(o.head);
    meta["trainable"] = o.trainable;
    meta["compute_dtype"] = c10::toString(o.compute_dtype);
    meta["source_model"] = options.source_model.empty() ? model.source_model() : options.source_model;
    json units = json::array();
    for (const auto& s : states) units.push_back({{"name", s.name}, {"shard_numel", s.master.numel()}});
    meta["units"] = units;
    if (lora) meta["lora"] = lora_meta(o.lora);
    write_file_atomic(tmp + "/config.json", model::to_hf_config_json(model.config(), o.head == model::Head::kValue));
    write_file_atomic(tmp + "/meta.json", meta.dump(2));
    fsync_dir(tmp);
    FileSystem& fsys = FileSystem::current();
    if (fsys.exists(dir)) {
      remove_tree(old);
      fsys.rename(dir, old);
    }
    fsys.rename(tmp, dir);
    fsync_dir(parent_dir(dir));
    remove_tree(old);
  });
  bad = first_failure(model, !err.empty());
  if (bad >= 0) throw IoError(fmt::format("checkpoint {}: commit failed: {}", dir, err.empty() ? "see rank 0" : err));
}

void load_checkpoint(ShardedModel& model, const std::string& dir_in) {
  std::exception_ptr error;
  const std::string err = attempt([&] {
    const std::string dir = resolve(dir_in);
    const json meta = read_meta(dir);
    const auto& o = model.options();
    if (meta.contains("lora") != model.lora())
      throw ConfigError(fmt::format("{}: {}", dir, model.lora() ? "saved without LoRA adapters; this role trains them"
                                                                : "holds LoRA adapters; this role trains no adapters"));
    if (model.lora()) {  // the adapters and their moments; the base is the source model's, loaded already
      if (meta.at("lora") != lora_meta(o.lora))
        throw ConfigError(fmt::format("{}: adapters {}, this role's are {}; resume with the same LoRA settings", dir,
                                      meta.at("lora").dump(), lora_meta(o.lora).dump()));
      const std::string path = dir + "/lora.safetensors";
      if (!fs::exists(path)) throw IoError(fmt::format("{}: missing; the checkpoint is incomplete", path));
      model::SafetensorsFile f(path);
      model::NamedTensors adapters;
      for (const auto& e : f.entries())
        if (e.name.rfind("lora.", 0) != 0 && e.name.rfind("rng.", 0) != 0) adapters[e.name] = f.tensor(e.name);
      model.load_lora_state(adapters, f.tensor("lora.exp_avg"), f.tensor("lora.exp_avg_sq"));
      model.set_steps(meta.value("steps", int64_t{0}));
      load_rng(f, o.device);
      return;
    }
    const int world = meta.value("world", 0);
    if (world != model.world())
      throw ConfigError(fmt::format("{}: saved by a group of {} ranks, this group has {}; resume with the same world "
                                    "size, or `tiller export` it and start from the HF directory",
                                    dir, world, model.world()));
    if (meta.value("head", "") != head_name(o.head))
      throw ConfigError(fmt::format("{}: holds a model with the {} head, this role needs the {} head", dir,
                                    meta.value("head", "?"), head_name(o.head)));
    if (o.trainable && !meta.value("trainable", false))
      throw ConfigError(fmt::format("{}: saved by a frozen model, without optimizer state; load it as a frozen role "
                                    "or start training from an HF directory", dir));
    const auto states = model.unit_states();
    const json& units = meta.at("units");
    if (units.size() != states.size())
      throw ConfigError(fmt::format("{}: {} units, this model has {}; is it the same model shape?", dir, units.size(),
                                    states.size()));
    for (size_t i = 0; i < states.size(); ++i) {
      if (units[i].value("name", "") != states[i].name || units[i].value("shard_numel", int64_t{-1}) != states[i].master.numel())
        throw ConfigError(fmt::format("{}: unit {} ({}) has {} elements per rank, this model's {} has {}; is it the same "
                                      "model shape?", dir, i, units[i].value("name", "?"),
                                      units[i].value("shard_numel", int64_t{-1}), states[i].name, states[i].master.numel()));
    }
    const std::string path = rank_file(dir, model.rank());
    if (!fs::exists(path)) throw IoError(fmt::format("{}: missing; the checkpoint is incomplete", path));
    model::SafetensorsFile f(path);
    for (size_t i = 0; i < states.size(); ++i) {
      const std::string& n = states[i].name;
      at::Tensor master = f.tensor(n + ".master");
      at::Tensor ea, eas;
      if (o.trainable) {
        ea = f.tensor(n + ".exp_avg");
        eas = f.tensor(n + ".exp_avg_sq");
      }
      if (master.numel() != states[i].master.numel())
        throw IoError(fmt::format("{}: '{}.master' has {} elements, expected {}", path, n, master.numel(),
                                  states[i].master.numel()));
      model.load_unit_state(i, master, ea, eas);
    }
    model.set_steps(meta.value("steps", int64_t{0}));
    load_rng(f, o.device);
  }, &error);
  const int bad = first_failure(model, !err.empty());
  if (bad < 0) return;
  if (error) std::rethrow_exception(error);
  throw IoError(fmt::format("checkpoint {}: rank {} failed to load it (its message names the cause)", dir_in, bad));
}

int64_t checkpoint_steps(const std::string& dir) { return read_meta(resolve(dir)).value("steps", int64_t{0}); }

void seed_default_generators(uint64_t seed, int rank, const at::Device& device) {
  const uint64_t s = seed * 1000003ull + static_cast<uint64_t>(rank);
  std::vector<at::Generator> gens = {at::detail::getDefaultCPUGenerator()};
  if (device.is_cuda()) gens.push_back(at::globalContext().defaultGenerator(device));
  for (at::Generator& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(s);
  }
}

namespace {

// The tokenizer and generation files of `source` (when it still exists) into `out_dir`.
void copy_model_files(const std::string& source, const std::string& out_dir) {
  if (source.empty() || !fs::is_directory(source)) return;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                           "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja"}) {
    const fs::path src = fs::path(source) / name;
    if (!fs::exists(src)) continue;
    const std::string err = attempt([&] { fs::copy_file(src, fs::path(out_dir) / name, fs::copy_options::overwrite_existing); });
    if (!err.empty()) throw IoError(fmt::format("{}: cannot copy to {}: {}", src.string(), out_dir, err));
  }
}

// A LoRA checkpoint's adapters (and a value head's trained score), its spec and its base.
struct SavedLora {
  model::ModelConfig cfg;
  model::LoraSpec spec;
  model::Head head = model::Head::kLm;
  model::NamedTensors tensors;
  std::string base;  // the source model (the frozen base), or `base_dir` when given
};

SavedLora read_saved_lora(const std::string& dir, const json& meta, const std::string& base_dir) {
  SavedLora out;
  out.cfg = model::load_model_config(dir + "/config.json");
  out.head = meta.value("head", "lm") == "value" ? model::Head::kValue : model::Head::kLm;
  const json& l = meta.at("lora");
  out.spec.rank = l.at("rank").get<int64_t>();
  out.spec.alpha = l.at("alpha").get<double>();
  out.spec.use_rslora = l.value("use_rslora", false);
  std::string targets;
  for (const auto& t : l.at("target_modules")) targets += (targets.empty() ? "" : ",") + t.get<std::string>();
  out.spec.targets = model::lora_targets(targets, out.cfg, dir + "/meta.json: lora.target_modules");
  const std::string path = dir + "/lora.safetensors";
  if (!fs::exists(path)) throw IoError(fmt::format("{}: missing; the checkpoint is incomplete", path));
  model::SafetensorsFile f(path);
  for (const auto& e : f.entries())
    if (e.name.rfind("lora.", 0) != 0 && e.name.rfind("rng.", 0) != 0) out.tensors[e.name] = f.tensor(e.name);
  out.base = base_dir.empty() ? meta.value("source_model", std::string()) : base_dir;
  return out;
}

void export_lora_merged(const std::string& dir, const json& meta, const std::string& out_dir, at::ScalarType dtype,
                        const std::string& base_dir) {
  const SavedLora s = read_saved_lora(dir, meta, base_dir);
  if (s.base.empty() || !fs::is_directory(s.base))
    throw ConfigError(fmt::format("{}: a LoRA checkpoint holds its adapters, not its base, and the base {} is not a "
                                  "directory; give it with --base (the HF model the run trained on)",
                                  dir, s.base.empty() ? std::string("(unrecorded)") : s.base));
  if (fs::exists(out_dir) && fs::equivalent(out_dir, s.base))
    throw ConfigError(fmt::format("{} is the base model's directory; export the merged model elsewhere", out_dir));
  model::NamedTensors named = model::merge_lora(s.cfg, s.spec, model::CheckpointReader(s.base).all(), s.tensors);
  if (s.head == model::Head::kValue) named["score.weight"] = s.tensors.at("score.weight");  // trained whole
  for (auto& [n, t] : named) t = t.to(dtype);
  model::save_model(out_dir, s.cfg, model::bind_weights(s.cfg, named, s.head, s.base), s.head);
  copy_model_files(s.base, out_dir);
}

}  // namespace

void export_lora_adapter(const std::string& checkpoint_dir, const std::string& out_dir, const std::string& base_dir) {
  const std::string dir = resolve(checkpoint_dir);
  const json meta = read_meta(dir);
  if (!meta.contains("lora"))
    throw ConfigError(fmt::format("{}: not a LoRA checkpoint (the run trained every weight); export it without --lora",
                                  dir));
  const SavedLora s = read_saved_lora(dir, meta, base_dir);
  if (s.head == model::Head::kValue)
    throw ConfigError(fmt::format("{}: a critic's LoRA checkpoint (a value head trained beside the adapters); export "
                                  "it merged, without --lora",
                                  dir));
  model::write_peft_adapter(out_dir, s.cfg, s.spec, 0.0, s.tensors, s.base);
}

void export_hf(const std::string& checkpoint_dir, const std::string& out_dir, at::ScalarType dtype,
               const std::string& base_dir) {
  const std::string dir = resolve(checkpoint_dir);
  const json meta = read_meta(dir);
  if (meta.contains("lora")) return export_lora_merged(dir, meta, out_dir, dtype, base_dir);
  const model::ModelConfig cfg = model::load_model_config(dir + "/config.json");
  const model::Head head = meta.value("head", "lm") == "value" ? model::Head::kValue : model::Head::kLm;
  const int world = meta.value("world", 0);
  if (world <= 0) throw IoError(fmt::format("{}/meta.json: world size {} is not valid", dir, world));
  std::vector<model::SafetensorsFile> files;
  for (int r = 0; r < world; ++r) {
    const std::string path = rank_file(dir, r);
    if (!fs::exists(path)) throw IoError(fmt::format("{}: missing; the checkpoint is incomplete", path));
    files.emplace_back(path);
  }
  model::NamedTensors named;
  for (const auto& layout : model_layouts(cfg, head, world)) {
    std::vector<at::Tensor> parts;
    for (auto& f : files) parts.push_back(f.tensor(layout.name() + ".master"));
    at::Tensor full = at::cat(parts);
    if (full.numel() != layout.padded_numel())
      throw IoError(fmt::format("{}: unit {} has {} elements over {} ranks, config.json implies {}", dir, layout.name(),
                                full.numel(), world, layout.padded_numel()));
    full = full.to(dtype);
    const auto views = layout.views(full);
    for (size_t i = 0; i < views.size(); ++i) named[layout.params()[i].spec.name] = views[i];
  }
  model::save_model(out_dir, cfg, model::bind_weights(cfg, named, head, dir), head);
  copy_model_files(base_dir.empty() ? meta.value("source_model", std::string()) : base_dir, out_dir);
}

}  // namespace tiller::zero
