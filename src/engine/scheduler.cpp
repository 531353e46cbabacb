#include "tiller/engine/scheduler.h"

#include <algorithm>

#include "tiller/core/error.h"

namespace tiller::engine {
namespace {

// Tokens the sequence computes this step given `budget`, or 0 if it cannot run.
int64_t step_tokens(const SchedulerLimits& limits, const SeqState& s, int64_t budget) {
  const int64_t want = s.num_tokens - s.num_computed;
  TILLER_CHECK(want > 0, "sequence {} has nothing to compute ({} tokens, {} computed)", s.id, s.num_tokens,
               s.num_computed);
  if (limits.chunked_prefill) return std::min(want, budget);
  return want <= budget ? want : 0;
}

}  // namespace

StepPlan schedule(const SchedulerLimits& limits, const std::vector<SeqState>& running,
                  const std::vector<SeqState>& waiting, const KvBlockManager& kv,
                  const std::vector<SeqState>& parked) {
  TILLER_CHECK(limits.max_num_seqs > 0 && limits.max_batched_tokens > 0, "scheduler limits must be positive");
  StepPlan plan;
  int64_t budget = limits.max_batched_tokens;
  int64_t free = kv.num_free();
  size_t next_parked = 0;
  // Evicts parked sessions, oldest first, until `need` blocks are free or none is left; with
  // `only_if_enough`, none unless that frees enough.
  const auto evict_for = [&](int64_t need, bool only_if_enough) {
    if (only_if_enough) {
      int64_t could = free;
      for (size_t i = next_parked; i < parked.size() && could < need; ++i) could += kv.blocks_freed_by(*parked[i].table);
      if (could < need) return;
    }
    while (need > free && next_parked < parked.size()) {
      const SeqState& p = parked[next_parked++];
      TILLER_CHECK(p.table != nullptr, "parked session {} without a block table", p.id);
      free += kv.blocks_freed_by(*p.table);
      plan.evicted.push_back(p.id);
    }
  };
  std::vector<const SeqState*> active;
  for (const auto& s : running) {
    TILLER_CHECK(s.table && s.table->tokens == s.num_computed, "running sequence {} without a matching block table",
                 s.id);
    active.push_back(&s);
  }
  for (size_t i = 0; i < active.size();) {
    const SeqState& s = *active[i];
    const int64_t n = step_tokens(limits, s, budget);
    if (n == 0) break;  // the budget is spent: the rest keep their blocks and wait a step
    const int64_t need = kv.blocks_needed(*s.table, n);
    evict_for(need, false);
    while (need > free && active.back() != &s) {
      free += kv.blocks_freed_by(*active.back()->table);
      plan.preempted.push_back(active.back()->id);
      active.pop_back();
    }
    if (need > free) {
      free += kv.blocks_freed_by(*s.table);
      plan.preempted.push_back(s.id);
      active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    free -= need;
    budget -= n;
    plan.chunks.push_back({s.id, s.num_computed, n});
    ++i;
  }
  if (plan.preempted.empty()) {
    int64_t seats = 0;
    for (const SeqState* s : active) seats += s->seats;
    for (const auto& w : waiting) {
      TILLER_CHECK(w.num_computed == 0 && !w.table, "waiting sequence {} holds KV state", w.id);
      if (budget == 0 || seats + w.seats > limits.max_num_seqs) break;
      const int64_t n = step_tokens(limits, w, budget);
      if (n == 0) break;
      const int64_t need = kv.blocks_for(n);
      evict_for(need, true);
      if (need > free) break;
      free -= need;
      budget -= n;
      seats += w.seats;
      plan.admitted.push_back(w.id);
      plan.chunks.push_back({w.id, 0, n});
    }
  }
  for (const auto& c : plan.chunks) plan.num_tokens += c.count;
  return plan;
}

}  // namespace tiller::engine
