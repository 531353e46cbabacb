// The collector's engines coming and going (collector.h; standalone engines, docs/cluster.md):
// engines that join take prompts; the work of an engine that leaves (it died, stalled past
// timeouts.generate_s, failed a sync) moves to the others, whole requests with their seeds.
#include <map>
#include <numeric>

#include <fmt/format.h>

#include "controller/collector.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"

namespace tiller::controller {

void RolloutCollector::engines_changed() {
  const size_t n = engines_.size();
  TILLER_CHECK(n >= load_.size(), "collector: the engine set shrank from {} to {}", load_.size(), n);
  in_flight_.resize(n, 0);
  load_.resize(n, 0);
  last_progress_.resize(n, cfg_.clock->now());
  moved_off_.resize(n, 0);
  draining_.resize(n, 0);
  for (size_t e = 0; e < n; ++e)
    if (engines_.retired(e) && !moved_off_[e]) move_off(e);
}

size_t RolloutCollector::usable_count() const {
  size_t n = 0;
  for (size_t e = 0; e < load_.size(); ++e) n += usable(e) ? 1 : 0;
  return n;
}

size_t RolloutCollector::least_loaded() const {
  size_t best = load_.size();
  for (size_t i = 0; i < load_.size(); ++i)
    if (usable(i) && (best == load_.size() || load_[i] < load_[best])) best = i;
  TILLER_CHECK(best < load_.size(), "collector: no engine is left");
  return best;
}

void RolloutCollector::engine_failed(size_t e, const std::string& why) {
  if (!engines_.retire(e, why)) throw CommError("generation failed: " + why);
  move_off(e);
}

int64_t RolloutCollector::move_groups(size_t e) {
  int64_t groups = 0;
  for (auto& [ordinal, g] : outstanding_) {
    if (g.engine != static_cast<int>(e)) continue;
    const size_t dest = least_loaded();
    const int64_t owed = cfg_.n - g.arrived;
    load_[e] -= owed;
    load_[dest] += owed;
    g.engine = static_cast<int>(dest);
    ++groups;
  }
  return groups;
}

void RolloutCollector::engine_draining(size_t e) {
  if (!engines_.elastic())
    throw CommError(fmt::format("{} is draining, and this job's engines are its own ranks: it cannot go on without it",
                                engines_.name(e)));
  if (draining_[e] || engines_.retired(e)) return;
  draining_[e] = 1;
  const auto usable_left = static_cast<int64_t>(usable_count());
  if (usable_left < cfg_.min_engines)
    throw CommError(fmt::format("{} is draining, and {} engine(s) remain, fewer than engines.min_count = {}",
                                engines_.name(e), usable_left, cfg_.min_engines));
  const int64_t groups = move_groups(e);
  log::warn("{} is draining: its {} sample(s) in flight finish there, its {} prompt group(s) move to the {} other "
            "engine(s)",
            engines_.name(e), in_flight_[e], groups, usable_left);
  if (in_flight_[e] == 0 && engines_.retire(e, "drained")) moved_off_[e] = 1;
}

void RolloutCollector::resend(uint64_t id) {
  Live& l = live_.at(id);
  const auto from = static_cast<size_t>(l.engine);
  auto g = outstanding_.find(l.group);
  const size_t dest = g != outstanding_.end() && usable(static_cast<size_t>(g->second.engine))
                          ? static_cast<size_t>(g->second.engine)
                          : least_loaded();
  in_flight_[from] -= l.remaining;
  if (in_flight_[dest] == 0) last_progress_[dest] = cfg_.clock->now();
  in_flight_[dest] += l.remaining;
  l.engine = static_cast<int>(dest);
  l.repeats = l.request.n - l.remaining;
  engines_.submit(dest, l.request, version_);
}

void RolloutCollector::move_off(size_t e) {
  moved_off_.resize(engines_.size(), 0);
  draining_.resize(engines_.size(), 0);
  moved_off_[e] = 1;
  const auto live = static_cast<int64_t>(usable_count());
  if (live < cfg_.min_engines)
    throw CommError(fmt::format("{} left the job, and {} engine(s) remain, fewer than engines.min_count = {}",
                                engines_.name(e), live, cfg_.min_engines));
  // Its groups first (their later requests and the dispatch balance follow them), then its requests.
  std::map<size_t, int64_t> to;  // engine -> requests moved there
  int64_t samples = 0;
  const int64_t groups = move_groups(e);
  // Aborted there, or every sample back and only repeats owed: nothing more comes back.
  for (auto it = live_.begin(); it != live_.end();) {
    if (it->second.engine == static_cast<int>(e) && (it->second.aborted || it->second.remaining <= 0)) it = live_.erase(it);
    else ++it;
  }
  for (auto& [id, l] : live_) {
    if (l.engine != static_cast<int>(e)) continue;
    auto g = outstanding_.find(l.group);
    const size_t dest = g != outstanding_.end() ? static_cast<size_t>(g->second.engine) : least_loaded();
    in_flight_[e] -= l.remaining;
    if (in_flight_[dest] == 0) last_progress_[dest] = cfg_.clock->now();
    in_flight_[dest] += l.remaining;
    l.engine = static_cast<int>(dest);
    // The whole request again, its seed as before: the samples already back are dropped as repeats.
    l.repeats = l.request.n - l.remaining;
    engines_.submit(dest, l.request, version_);
    ++to[dest];
    samples += l.remaining;
  }
  in_flight_[e] = 0;
  std::string where;
  for (const auto& [dest, k] : to) where += fmt::format("{}{} to {}", where.empty() ? "" : ", ", k, engines_.name(dest));
  log::warn("{} left the job; {} prompt group(s) and {} request(s) ({} samples) move to the {} engine(s) left{}{}",
            engines_.name(e), groups, to.empty() ? 0 : std::accumulate(to.begin(), to.end(), int64_t{0},
                                                                     [](int64_t a, const auto& kv) { return a + kv.second; }),
            samples, live, where.empty() ? "" : ": ", where);
}

}  // namespace tiller::controller
