// The memory plan's verdicts (tiller/job/memory_plan.h): whether each rank fits its GPU and
// host, the table tiller plan prints, and the smallest layout that fits when one does not. The
// estimates themselves are memory_plan.cpp's.
#include "tiller/job/memory_plan.h"

#include <algorithm>
#include <array>
#include <utility>

#include <fmt/format.h>

#include "tiller/core/checked_math.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/rank_plan.h"

namespace tiller::job {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
std::string gib(int64_t b) { return fmt::format("{:.2f}", static_cast<double>(b) / kGiB); }

}  // namespace

namespace {

// A phase's three largest items: "actor state 56.74 GiB, actor weights 7.09 GiB, ...".
std::string largest_items(const PhaseMemory& p) {
  std::vector<std::pair<std::string, int64_t>> items = p.items;
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  std::string top;
  for (size_t i = 0; i < items.size() && i < 3; ++i)
    top += fmt::format("{}{} {} GiB", i ? ", " : "", items[i].first, gib(items[i].second));
  return top;
}

}  // namespace

void check_trainer_fits(const MemoryPlan& m, int rank, const std::string& role, const std::string& knobs) {
  const RankMemory* r = m.overflow();
  if (!r) return;
  const PhaseMemory& p = *r->peak_phase();
  const std::string top = largest_items(p);
  throw ConfigError(fmt::format("memory plan: rank {} ({}) needs {} GiB in its {} phase (+{} GiB reserve) on a {} GiB "
                                "GPU (train.recompute {}, compute shard {}); largest: {}; {}",
                                rank, role, gib(r->peak()), phase_name(p.phase), gib(reserve_bytes(r->peak())), gib(m.gpu_bytes),
                                zero::recompute_name(m.recompute), m.keep_compute_shard ? "kept" : "cast", top, knobs));
}

const RankMemory* MemoryPlan::overflow() const {
  if (gpu_bytes <= 0 || shared_gpus) return nullptr;
  for (const auto& r : ranks)
    if (r.peak() + reserve_bytes(r.peak()) > gpu_bytes) return &r;
  return nullptr;
}

std::vector<int64_t> MemoryPlan::host_by_node() const {
  std::vector<int64_t> out;
  for (const auto& r : ranks) {
    if (r.node >= static_cast<int>(out.size())) out.resize(static_cast<size_t>(r.node) + 1, 0);
    out[static_cast<size_t>(r.node)] += r.host_bytes;
  }
  return out;
}

namespace {
// A node's host memory that its ranks' host_bytes may take (MemoryPlan::host_memory_bytes).
int64_t host_usable(int64_t host) { return host / 10 * 9; }
}  // namespace

int MemoryPlan::host_overflow() const {
  if (host_memory_bytes <= 0) return -1;
  const std::vector<int64_t> by_node = host_by_node();
  for (size_t n = 0; n < by_node.size(); ++n)
    if (by_node[n] > host_usable(host_memory_bytes)) return static_cast<int>(n);
  return -1;
}

std::string MemoryPlan::table() const {
  std::string out;
  if (on_cpu) {
    out = "memory per rank (GiB; estimates of each rank's host memory: cluster.device = cpu, no GPU to fit); ";
  } else {
    out = fmt::format("memory per rank (GiB; estimates, {} GiB held back for the CUDA context and 1/{} of the peak "
                      "for the allocator's fragmentation){}; ",
                      gib(kReserveBytes), kAllocatorSlackDivisor,
                      shared_gpus       ? std::string(" (ranks share GPUs, cluster.ranks_per_gpu > 1: the fit is not checked)")
                      : gpu_bytes > 0 ? fmt::format(" on {} GiB GPUs", gib(gpu_bytes))
                                      : std::string(" (set cluster.gpu_memory_gb to check the fit)"));
  }
  out += fmt::format("train.recompute: {} ({}); train.compute_shard: {} ({}); cluster.expandable_segments: {} ({}):\n",
                     recompute_layers < 0 ? std::string(zero::recompute_name(recompute))
                                          : fmt::format("{} in the first {} blocks", zero::recompute_name(recompute),
                                                        recompute_layers),
                     recompute_reason, keep_compute_shard ? "keep" : "cast", compute_shard_reason,
                     expandable_segments ? "on" : "off", allocator_reason);
  for (const std::string& n : notes) out += "  " + n + "\n";
  for (const auto& r : ranks) {
    out += fmt::format("  rank {} ({}): peak {}{}{}\n", r.rank, r.label, gib(r.peak()),
                       r.host_bytes > 0 ? fmt::format(", host memory {}", gib(r.host_bytes)) : "",
                       gpu_bytes <= 0 || shared_gpus         ? ""
                       : r.peak() + reserve_bytes(r.peak()) > gpu_bytes ? "  DOES NOT FIT"
                                                              : "  fits");
    for (const auto& p : r.phases) {
      std::string items;
      for (const auto& [name, b] : p.items) items += fmt::format("{}{} {}", items.empty() ? "" : ", ", name, gib(b));
      out += fmt::format("    {:<8} {:>7}  {}\n", phase_name(p.phase), gib(p.total()), items);
    }
  }
  const std::vector<int64_t> by_node = host_by_node();
  for (size_t n = 0; n < by_node.size(); ++n) {
    if (by_node[n] == 0) continue;
    out += fmt::format("  node {}: host memory {}{}\n", n, gib(by_node[n]),
                       host_memory_bytes <= 0 ? std::string(" (set cluster.host_memory_gb to check the fit)")
                       : by_node[n] > host_usable(host_memory_bytes)
                           ? fmt::format(" of {} (9/10 usable)  DOES NOT FIT", gib(host_memory_bytes))
                           : fmt::format(" of {} (9/10 usable)  fits", gib(host_memory_bytes)));
  }
  return out;
}

void check_fits(const MemoryPlan& m, const JobConfig& cfg) {
  if (const int node = m.host_overflow(); node >= 0) {
    int ranks = 0;
    for (const auto& r : m.ranks) ranks += r.node == node && r.host_bytes > 0;
    throw ConfigError(fmt::format(
        "memory plan: node {} needs {} GiB of host memory for its {} ranks' optimizer and offloaded state, more than "
        "9/10 of its {} GiB (cluster.host_memory_gb); spread the job over more nodes (that state splits over the "
        "ranks: tiller plan names the smallest layout that fits), or keep the optimizer on the GPUs "
        "(roles.<role>.optimizer_offload=none)",
        node, gib(m.host_by_node()[static_cast<size_t>(node)]), ranks, gib(m.host_memory_bytes)));
  }
  const RankMemory* r = m.overflow();
  if (!r) return;
  const PhaseMemory& p = *r->peak_phase();
  const std::string top = largest_items(p);
  // Advice that the config does not already follow.
  const std::string offload = cfg.roles.actor.offload ? "" : "set roles.actor.offload=true, ";
  std::string advice;
  if (p.phase == Phase::kGenerate)
    advice = cfg.cluster.hybrid ? offload + "lower engines.kv_cache_gb or rollout.micro_batch_tokens"
                                : "lower engines.kv_cache_gb / engines.gpu_memory_fraction or rollout.micro_batch_tokens";
  else if (p.phase == Phase::kScore)
    advice = "lower rollout.micro_batch_tokens (the scoring's activations), " + offload +
             "or give the actor more GPUs (a larger engines.tp holds less of the engine on each)";
  else
    advice = std::string("give the role more GPUs (roles.<role>.gpus), lower train.micro_batch_tokens") +
             (cfg.cluster.hybrid && cfg.engines.sleep_level < 2 ? ", set engines.sleep_level=2" : "") +
             ", or move the optimizer to the host (roles.<role>.optimizer_offload=cpu)";
  throw ConfigError(fmt::format("memory plan: rank {} ({}) needs {} GiB in its {} phase (+{} GiB reserve) on a {} GiB "
                                "GPU; largest: {}; {}",
                                r->rank, r->label, gib(r->peak()), phase_name(p.phase), gib(reserve_bytes(r->peak())),
                                gib(m.gpu_bytes), top, advice));
}

namespace {

// `cfg` on `k` times its GPUs (smallest_fitting_layout), with the overrides that say so; with
// `host_optimizer` the trained roles' optimizer on the host, with `offload` (hybrid) their state off
// the GPU while the engines generate.
std::pair<JobConfig, std::vector<std::string>> scaled(const JobConfig& cfg, int64_t k, bool host_optimizer,
                                                      bool offload) {
  JobConfig c = cfg;
  std::vector<std::string> overrides;
  for (Role r : kRoles) {
    RoleConfig& rc = role_config(c, r);
    if (!rc.enabled) continue;
    if (rc.colocate_with.empty()) {
      rc.gpus *= k;
      overrides.push_back(fmt::format("roles.{}.gpus={}", role_name(r), rc.gpus));
    }
    if (host_optimizer && role_trains(r) && rc.lora.rank <= 0 && rc.optimizer_offload != OptimizerOffload::kCpu) {
      rc.optimizer_offload = OptimizerOffload::kCpu;
      overrides.push_back(fmt::format("roles.{}.optimizer_offload=cpu", role_name(r)));
    }
    if (offload && c.cluster.hybrid && role_trains(r) && rc.lora.rank <= 0 && !rc.offload) {
      rc.offload = true;
      overrides.push_back(fmt::format("roles.{}.offload=true", role_name(r)));
    }
  }
  if (!c.cluster.hybrid) {
    c.engines.count *= k;
    overrides.push_back(fmt::format("engines.count={}", c.engines.count));
  } else if (c.engines.count != 1) {  // set to the derived count: derived again
    c.engines.count = c.engine_count();
    overrides.push_back(fmt::format("engines.count={}", c.engines.count));
  }
  return {std::move(c), std::move(overrides)};
}

}  // namespace

std::optional<LayoutSuggestion> smallest_fitting_layout(const JobConfig& cfg, const ModelShapes& shapes,
                                                        int gpus_per_node, int64_t gpu_bytes) {
  if (gpus_per_node < 1 || (gpu_bytes <= 0 && cfg.cluster.host_memory_gb <= 0)) return std::nullopt;
  // At each size: as configured, then the optimizer on the host, then (hybrid) the state offloaded
  // while generating too; a variant that changes nothing more is skipped.
  constexpr std::array<std::pair<bool, bool>, 3> kVariants{{{false, false}, {true, false}, {true, true}}};
  for (int64_t k = 2; k <= kMaxSuggestedScale; ++k) {
    if (dist::required_world_size(scaled(cfg, k, false, false).first) > kMaxSuggestedRanks) return std::nullopt;
    size_t tried = 0;
    for (const auto& [host_optimizer, offload] : kVariants) {
      auto [c, overrides] = scaled(cfg, k, host_optimizer, offload);
      if (tried > 0 && overrides.size() == tried) continue;  // the same as the variant before
      tried = overrides.size();
      try {
        c.validate();
        const int world = dist::required_world_size(c);
        const int per_gpu = static_cast<int>(c.cluster.ranks_per_gpu);
        const int gpus = (world - 1 + per_gpu - 1) / per_gpu;
        const int nodes = (gpus + gpus_per_node - 1) / gpus_per_node;
        const dist::NodeMap map =
            dist::NodeMap::fill_by_slot(std::vector<int>(static_cast<size_t>(nodes), gpus_per_node), world, per_gpu);
        if (plan_memory(c, dist::make_rank_plan(c, map), shapes, gpu_bytes).fits())
          return LayoutSuggestion{nodes, gpus, std::move(overrides)};
      } catch (const ConfigError&) {
        // This multiple cannot be laid out, or leaves an engine no room for a KV cache: a larger may.
      }
    }
  }
  return std::nullopt;
}

int64_t check_engine_context(const JobConfig& cfg, const model::ModelConfig& engine, const std::string& dir) {
  const char* sum = cfg.multi_turn() ? "rollout.max_prompt_tokens + the response limit (rollout.max_response_tokens)"
                                     : "rollout.max_prompt_tokens + rollout.max_new_tokens";
  const int64_t max_model_len = checked_add(cfg.rollout.max_prompt_tokens, cfg.response_limit(), sum);
  const int64_t limit = model::context_limit(engine);
  if (max_model_len > limit)
    throw ConfigError(fmt::format("{} = {} exceeds the context of {} ({} tokens: max_position_embeddings, with its "
                                  "RoPE scaling); lower them, or use a model made for longer contexts (rope_scaling)",
                                  sum, max_model_len, dir, limit));
  return max_model_len;
}

ModelShapes load_model_shapes(const JobConfig& cfg, std::string* missing) {
  ModelShapes out;
  auto try_load = [&](const std::string& key, const std::string& dir) {
    if (dir.empty()) return;
    try {
      out[key] = model::load_model_config(dir);
    } catch (const std::exception& e) {
      if (missing) *missing += fmt::format("{}{} ({})", missing->empty() ? "" : "; ", key, dir);
    }
  };
  const std::string& actor = cfg.roles.actor.model;
  try_load("actor", actor);
  if (cfg.roles.critic.enabled) try_load("critic", cfg.roles.critic.model.empty() ? actor : cfg.roles.critic.model);
  if (cfg.roles.ref.enabled) try_load("ref", cfg.roles.ref.model.empty() ? actor : cfg.roles.ref.model);
  if (cfg.roles.reward.enabled) try_load("reward", cfg.roles.reward.model);
  if (!cfg.engines.model.empty()) try_load("engine", cfg.engines.model);
  return out;
}

}  // namespace tiller::job
