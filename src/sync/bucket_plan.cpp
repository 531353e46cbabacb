#include "tiller/sync/bucket_plan.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/roles.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/zero/flat_layout.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {
namespace {

using nlohmann::json;
constexpr const char* kFormat = "tiller.sync.plan/1";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

json body(const BucketPlan& p) {
  json j;
  j["format"] = kFormat;
  j["wire_dtype"] = p.wire_dtype;
  j["senders"] = p.senders;
  j["tp_size"] = p.tp_size;
  j["bucket_bytes"] = p.bucket_bytes;
  for (const auto& u : p.units) j["units"].push_back({u.name, u.shard_numel});
  for (const auto& q : p.params) j["params"].push_back({q.name, q.shape, q.tp_dim});
  for (const auto& b : p.buckets) {
    json s = json::array(), g = json::array();
    for (const auto& x : b.sources) s.push_back({x.unit, x.shard_begin, x.numel, x.bucket_offset});
    for (const auto& x : b.segments) g.push_back({x.param, x.param_begin, x.numel, x.bucket_offset});
    j["buckets"].push_back({b.sender, b.numel, s, g});
  }
  return j;
}

// The checks every plan passes, whoever made it: an engine copies into its weights only what a
// plan that passed these describes.
void check(const BucketPlan& p, const std::string& where) {
  auto bad = [&](const std::string& what) { throw ConfigError(fmt::format("{}: bucket plan: {}", where, what)); };
  if (p.wire_dtype != "bf16" && p.wire_dtype != "fp16" && p.wire_dtype != "fp32")
    bad(fmt::format("wire dtype '{}' (bf16, fp16 or fp32)", p.wire_dtype));
  if (p.senders < 1 || p.tp_size < 1) bad(fmt::format("{} senders, TP size {}", p.senders, p.tp_size));
  for (const auto& q : p.params) {
    if (q.tp_dim < -1 || q.tp_dim > 1 || (q.tp_dim >= 0 && static_cast<int>(q.shape.size()) <= q.tp_dim) ||
        (q.tp_dim == 1 && q.shape.size() != 2) || (q.tp_dim >= 0 && q.shape[q.tp_dim] % p.tp_size))
      bad(fmt::format("parameter {}: cannot split dim {} over {} TP ranks", q.name, q.tp_dim, p.tp_size));
  }
  std::vector<std::vector<std::pair<int64_t, int64_t>>> covered(p.params.size());
  for (size_t k = 0; k < p.buckets.size(); ++k) {
    const Bucket& b = p.buckets[k];
    if (b.sender < 0 || b.sender >= p.senders || b.numel <= 0)
      bad(fmt::format("bucket {}: sender {} of {}, {} elements", k, b.sender, p.senders, b.numel));
    for (const auto& s : b.sources)
      if (s.unit < 0 || s.unit >= static_cast<int>(p.units.size()) || s.shard_begin < 0 || s.numel <= 0 ||
          s.shard_begin + s.numel > p.units[s.unit].shard_numel || s.bucket_offset < 0 ||
          s.bucket_offset + s.numel > b.numel)
        bad(fmt::format("bucket {}: a source lies outside its unit or the bucket", k));
    for (const auto& g : b.segments) {
      if (g.param < 0 || g.param >= static_cast<int>(p.params.size()) || g.param_begin < 0 || g.numel <= 0 ||
          g.param_begin + g.numel > p.params[g.param].numel() || g.bucket_offset < 0 ||
          g.bucket_offset + g.numel > b.numel)
        bad(fmt::format("bucket {}: a segment lies outside its parameter or the bucket", k));
      covered[g.param].emplace_back(g.param_begin, g.param_begin + g.numel);
    }
  }
  for (size_t i = 0; i < p.params.size(); ++i) {
    auto& c = covered[i];
    std::sort(c.begin(), c.end());
    int64_t end = 0;
    for (const auto& [b, e] : c) {
      if (b != end) bad(fmt::format("parameter {}: elements from {} are {}", p.params[i].name, std::min(b, end),
                                    b > end ? "never sent" : "sent twice"));
      end = e;
    }
    if (end != p.params[i].numel())
      bad(fmt::format("parameter {}: elements from {} are never sent", p.params[i].name, end));
  }
}

}  // namespace

int64_t PlanParam::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool BucketPlan::adapters_only() const { return units.size() == 1 && units[0].name == "lora"; }

int64_t BucketPlan::element_size() const { return wire_dtype == "fp32" ? 4 : 2; }

int64_t BucketPlan::wire_bytes() const {
  int64_t n = 0;
  for (const auto& b : buckets) n += b.numel;
  return n * element_size();
}

int64_t BucketPlan::parameter_bytes() const {
  int64_t n = 0;
  for (const auto& q : params) n += q.numel();
  return n * element_size();
}

int64_t BucketPlan::largest_bucket_numel() const {
  int64_t n = 0;
  for (const auto& b : buckets) n = std::max(n, b.numel);
  return n;
}

uint64_t BucketPlan::content_hash() const { return fnv1a(body(*this).dump()); }

std::string BucketPlan::to_json() const {
  json j = body(*this);
  j["id"] = fmt::format("{:016x}", id);
  return j.dump();
}

BucketPlan BucketPlan::from_json(const std::string& text, const std::string& where) {
  BucketPlan p;
  try {
    json j = json::parse(text);
    if (j.value("format", "") != kFormat)
      throw ConfigError(fmt::format("{}: not a bucket plan of format {}", where, kFormat));
    const std::string id = j.at("id").get<std::string>();
    p.id = std::stoull(id, nullptr, 16);
    p.wire_dtype = j.at("wire_dtype").get<std::string>();
    p.senders = j.at("senders").get<int>();
    p.tp_size = j.at("tp_size").get<int>();
    p.bucket_bytes = j.at("bucket_bytes").get<int64_t>();
    for (const auto& u : j.at("units")) p.units.push_back({u.at(0).get<std::string>(), u.at(1).get<int64_t>()});
    for (const auto& q : j.at("params"))
      p.params.push_back({q.at(0).get<std::string>(), q.at(1).get<std::vector<int64_t>>(), q.at(2).get<int>()});
    for (const auto& b : j.at("buckets")) {
      Bucket k;
      k.sender = b.at(0).get<int>();
      k.numel = b.at(1).get<int64_t>();
      for (const auto& s : b.at(2))
        k.sources.push_back({s.at(0).get<int>(), s.at(1).get<int64_t>(), s.at(2).get<int64_t>(), s.at(3).get<int64_t>()});
      for (const auto& g : b.at(3))
        k.segments.push_back({g.at(0).get<int>(), g.at(1).get<int64_t>(), g.at(2).get<int64_t>(), g.at(3).get<int64_t>()});
      p.buckets.push_back(std::move(k));
    }
    if (p.content_hash() != p.id)
      throw ConfigError(fmt::format("{}: bucket plan {} does not match its contents (altered in transit?)", where, id));
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("{}: malformed bucket plan: {}", where, e.what()));
  } catch (const std::logic_error& e) {  // stoull
    throw ConfigError(fmt::format("{}: malformed bucket plan id: {}", where, e.what()));
  }
  check(p, where);
  return p;
}

int tp_split_dim(const std::string& hf_name) { return model::tp_split_dim(hf_name); }

BucketPlan make_bucket_plan(const model::ModelConfig& cfg, int senders, int tp_size, const std::string& wire_dtype,
                            int64_t bucket_bytes) {
  BucketPlan p;
  p.wire_dtype = wire_dtype;
  p.senders = senders;
  p.tp_size = tp_size;
  p.bucket_bytes = bucket_bytes;
  TILLER_CHECK(senders >= 1 && tp_size >= 1 && bucket_bytes > 0, "bucket plan: {} senders, TP {}, {} bytes", senders,
               tp_size, bucket_bytes);
  const int64_t limit = std::max<int64_t>(1, bucket_bytes / p.element_size());
  const auto layouts = zero::model_layouts(cfg, model::Head::kLm, senders);
  std::vector<int> first_param;  // per unit: the index of its first parameter in p.params
  for (const auto& l : layouts) {
    first_param.push_back(static_cast<int>(p.params.size()));
    p.units.push_back({l.name(), l.shard_numel()});
    for (const auto& fp : l.params()) p.params.push_back({fp.spec.name, fp.spec.shape, tp_split_dim(fp.spec.name)});
  }
  // Each rank's stream, cut into buckets; then the ranks' buckets interleave.
  std::vector<std::vector<Bucket>> per_rank(senders);
  for (int r = 0; r < senders; ++r) {
    Bucket cur;
    cur.sender = r;
    for (size_t u = 0; u < layouts.size(); ++u) {
      const auto pieces = layouts[u].pieces(r);
      for (int64_t at = 0, n = layouts[u].shard_numel(); at < n;) {
        const int64_t take = std::min(n - at, limit - cur.numel);
        cur.sources.push_back({static_cast<int>(u), at, take, cur.numel});
        for (const auto& pc : pieces) {
          const int64_t b = std::max(at, pc.shard_begin), e = std::min(at + take, pc.shard_begin + pc.numel);
          if (b < e)
            cur.segments.push_back({first_param[u] + static_cast<int>(pc.param), pc.param_begin + (b - pc.shard_begin),
                                    e - b, cur.numel + (b - at)});
        }
        cur.numel += take;
        at += take;
        if (cur.numel == limit) {
          per_rank[r].push_back(std::move(cur));
          cur = Bucket{};
          cur.sender = r;
        }
      }
    }
    if (cur.numel > 0) per_rank[r].push_back(std::move(cur));
  }
  for (size_t i = 0;; ++i) {
    bool any = false;
    for (int r = 0; r < senders; ++r)
      if (i < per_rank[r].size()) {
        p.buckets.push_back(std::move(per_rank[r][i]));
        any = true;
      }
    if (!any) break;
  }
  check(p, "make_bucket_plan");
  p.id = p.content_hash();
  return p;
}

BucketPlan make_lora_bucket_plan(const model::ModelConfig& cfg, const model::LoraSpec& spec, int senders, int tp_size,
                                 int64_t bucket_bytes) {
  TILLER_CHECK(spec.enabled(), "make_lora_bucket_plan: no adapters (rank 0)");
  TILLER_CHECK(senders >= 1 && tp_size >= 1 && bucket_bytes > 0, "bucket plan: {} senders, TP {}, {} bytes", senders,
               tp_size, bucket_bytes);
  BucketPlan p;
  p.wire_dtype = "fp32";
  p.senders = senders;
  p.tp_size = tp_size;
  p.bucket_bytes = bucket_bytes;
  int64_t total = 0;
  for (const model::ParamSpec& s : model::lora_parameter_specs(cfg, spec)) {
    p.params.push_back({s.name, s.shape, tp_split_dim(s.name)});
    total += p.params.back().numel();
  }
  p.units.push_back({"lora", total});
  // Actor rank 0's copy of the buffer, cut into buckets; each bucket's segments are the adapters
  // (or their parts) that its range covers.
  const int64_t limit = std::max<int64_t>(1, bucket_bytes / p.element_size());
  size_t param = 0;
  int64_t param_start = 0;  // param's first element in the buffer
  for (int64_t at = 0; at < total;) {
    Bucket b;
    b.sender = 0;
    b.numel = std::min(limit, total - at);
    b.sources.push_back({0, at, b.numel, 0});
    for (int64_t pos = at; pos < at + b.numel;) {
      while (param_start + p.params[param].numel() <= pos) param_start += p.params[param++].numel();
      const int64_t end = std::min(at + b.numel, param_start + p.params[param].numel());
      b.segments.push_back({static_cast<int>(param), pos - param_start, end - pos, pos - at});
      pos = end;
    }
    at += b.numel;
    p.buckets.push_back(std::move(b));
  }
  check(p, "make_lora_bucket_plan");
  p.id = p.content_hash();
  return p;
}

std::vector<int64_t> local_shape(const PlanParam& p, int tp_size) {
  std::vector<int64_t> s = p.shape;
  if (p.tp_dim >= 0) s[p.tp_dim] /= tp_size;
  return s;
}

std::vector<SliceCopy> slice_copies(const BucketPlan& plan, const PlanSegment& g, int tp_rank) {
  const PlanParam& p = plan.params[g.param];
  const int t = plan.tp_size;
  const int64_t pb = g.param_begin, pe = g.param_begin + g.numel, o = g.bucket_offset;
  auto line = [&](int64_t src, int64_t dst, int64_t n) { return SliceCopy{g.param, src, dst, 1, n, n, n}; };
  if (p.tp_dim < 0 || t == 1) return {line(o, pb, g.numel)};
  const int64_t rows = p.shape[0], cols = p.numel() / rows;
  if (p.tp_dim == 0) {  // a contiguous block of rows
    const int64_t lo = tp_rank * (rows / t) * cols, hi = lo + (rows / t) * cols;
    const int64_t b = std::max(pb, lo), e = std::min(pe, hi);
    if (b >= e) return {};
    return {line(o + (b - pb), b - lo, e - b)};
  }
  // Columns [c0, c0 + w) of every row: a block of whole rows, plus a partial row at either end.
  const int64_t w = cols / t, c0 = tp_rank * w;
  std::vector<SliceCopy> out;
  auto one_row = [&](int64_t r) {
    const int64_t b = std::max(pb, r * cols + c0), e = std::min(pe, r * cols + c0 + w);
    if (b < e) out.push_back(line(o + (b - pb), r * w + (b - r * cols - c0), e - b));
  };
  const int64_t full_begin = (pb + cols - 1) / cols, full_end = pe / cols;  // rows the segment covers whole
  if (full_begin >= full_end) {
    for (int64_t r = pb / cols; r <= (pe - 1) / cols; ++r) one_row(r);
    return out;
  }
  if (pb < full_begin * cols) one_row(pb / cols);
  out.push_back({g.param, o + full_begin * cols + c0 - pb, full_begin * w, full_end - full_begin, w, cols, w});
  if (pe > full_end * cols) one_row(full_end);
  return out;
}

BucketPlan job_bucket_plan(const JobConfig& job, const model::ModelConfig& actor_model, const dist::RankPlan& plan) {
  const dist::RoleGroup* actor = plan.group(Role::kActor);
  TILLER_CHECK(actor != nullptr, "the rank plan has no actor group");
  // Standalone engines are no ranks of the plan: their TP size is the config's.
  const int engine_tp = plan.engines.empty() ? static_cast<int>(job.engines.tp) : plan.engine_tp();
  if (job.roles.actor.lora.rank > 0)  // the adapters alone (the spec as the actor builds it)
    return make_lora_bucket_plan(actor_model,
                                 zero::lora_spec(job.roles.actor.lora, actor_model, "roles.actor.lora.target_modules"),
                                 static_cast<int>(actor->ranks.size()), engine_tp, job.engines.sync_bucket_mb << 20);
  return make_bucket_plan(actor_model, static_cast<int>(actor->ranks.size()), engine_tp,
                          job.roles.actor.dtype == Precision::kBf16 ? "bf16" : "fp32", job.engines.sync_bucket_mb << 20);
}

}  // namespace tiller::sync
