#include "sync/slice_placer.h"

#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "sync/sync_protocol.h"
#include "tiller/core/error.h"
#include "tiller/engine/engine.h"

namespace tiller::sync {

SlicePlacer::SlicePlacer(const BucketPlan& p, const engine::Engine& engine, bool lora_base) {
  const int tp_rank = engine.tp_rank();
  auto bad = [&](const std::string& what) {
    throw ConfigError(fmt::format("weight sync plan {:016x} does not fit engine TP rank {}: {}", p.id, tp_rank, what));
  };
  if (p.tp_size != engine.tp_size())
    bad(fmt::format("it is for TP size {}, the engine has {}", p.tp_size, engine.tp_size()));
  auto params = engine.parameters();
  const at::ScalarType wire = protocol::wire_scalar_type(p.wire_dtype);
  std::set<std::string> planned;
  for (const auto& q : p.params) {
    auto it = params.find(q.name);
    if (it == params.end()) bad(fmt::format("the engine has no parameter {}", q.name));
    const at::Tensor& t = it->second;
    if (t.sizes().vec() != local_shape(q, p.tp_size))
      bad(fmt::format("{} is {} here; the plan's slice is {}", q.name, fmt::join(t.sizes().vec(), "x"),
                      fmt::join(local_shape(q, p.tp_size), "x")));
    if (t.scalar_type() != wire)
      bad(fmt::format("the weights are {}, the plan sends {}", c10::toString(t.scalar_type()), p.wire_dtype));
    TILLER_CHECK(t.is_contiguous(), "engine parameter {} is not contiguous", q.name);
    dest_.push_back(t.view({-1}));
    planned.insert(q.name);
  }
  // An adapter-only plan (a LoRA actor's) leaves the base the engine loaded; it must send every
  // adapter. A LoRA base's plan must send all but the adapters; any other plan every parameter.
  for (const auto& [name, t] : params) {
    const bool adapter = name.find(".lora_") != std::string::npos;
    if (planned.count(name) || (p.adapters_only() && !adapter) || (lora_base && adapter)) continue;
    bad(fmt::format("the plan never sends {}", name));
  }
  for (const auto& b : p.buckets) {
    std::vector<SliceCopy> c;
    for (const auto& g : b.segments)
      for (const auto& s : slice_copies(p, g, tp_rank)) c.push_back(s);
    copies_.push_back(std::move(c));
  }
}

void SlicePlacer::place(size_t k, const at::Tensor& stage) const {
  for (const SliceCopy& c : copies_.at(k)) {
    const at::Tensor& d = dest_[c.param];
    if (c.rows == 1) {
      d.narrow(0, c.dst_offset, c.cols).copy_(stage.narrow(0, c.src_offset, c.cols));
    } else {
      d.as_strided({c.rows, c.cols}, {c.dst_stride, 1}, d.storage_offset() + c.dst_offset)
          .copy_(stage.as_strided({c.rows, c.cols}, {c.src_stride, 1}, stage.storage_offset() + c.src_offset));
    }
  }
}

}  // namespace tiller::sync
