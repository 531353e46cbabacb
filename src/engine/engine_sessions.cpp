// The engine's parked multi-turn sessions (engine_impl.h): a finished sample's KV blocks kept for
// its next turn, adopted by the resume that continues it, expired or evicted when memory is short.
#include "engine/engine_impl.h"

namespace tiller::engine {

void Engine::Impl::park(Sequence s) {
  const SessionKey key{s.request, s.sample};
  if (auto old = session_ids.find(key); old != session_ids.end()) drop_parked(old->second, true);
  const int64_t id = s.id;
  session_ids[key] = id;
  parked.emplace(id, Parked{std::move(s), std::chrono::steady_clock::now()});
  while (static_cast<int64_t>(parked.size()) > max_sessions()) drop_parked(parked.begin()->first, true);
}

void Engine::Impl::drop_parked(int64_t id, bool evicted) {
  auto it = parked.find(id);
  TILLER_CHECK(it != parked.end(), "no parked session {}", id);
  kv->release(it->second.seq.table);
  session_ids.erase(SessionKey{it->second.seq.request, it->second.seq.sample});
  if (it->second.claimed) {
    // Its resume starts from the prompt instead.
    for (int64_t sid : resuming) {
      Sequence& r = seqs.at(sid);
      if (r.resume_parked != id) continue;
      r.resume_parked = -1;
      ++stats.session_misses;
      erase_id(resuming, sid);
      insert_by_age(waiting, sid);
      break;
    }
  }
  parked.erase(it);
  if (evicted) ++stats.session_evictions;
}

void Engine::Impl::adopt(Sequence& s, int64_t pid, int64_t common) {
  Sequence& old = parked.at(pid).seq;
  s.table = std::move(old.table);
  old.table = BlockTable{};
  kv->truncate(s.table, common);
  s.num_computed = common;
  if (old.route_width > 0) {  // the reused positions' experts
    const auto n = std::min(old.routes.size(), static_cast<size_t>(common * old.route_width));
    s.routes.assign(old.routes.begin(), old.routes.begin() + static_cast<std::ptrdiff_t>(n));
    s.route_width = old.route_width;
  }
  ++stats.session_resumes;
  stats.session_tokens_reused += common;
  parked.at(pid).claimed = false;
  drop_parked(pid, false);
}

void Engine::Impl::adopt_resumes() {
  while (!resuming.empty() && running_seats() < opts.limits.max_num_seqs) {
    const int64_t sid = resuming.front();
    resuming.erase(resuming.begin());
    Sequence& s = seqs.at(sid);
    const int64_t pid = s.resume_parked;
    s.resume_parked = -1;
    adopt(s, pid, s.resume_common);
    running.push_back(sid);  // the newest id
  }
}

void Engine::Impl::drop_all_parked() {
  while (!parked.empty()) drop_parked(parked.begin()->first, true);
}

void Engine::Impl::expire_sessions() {
  if (parked.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_expiry) return;
  next_expiry = now + std::chrono::seconds(1);
  std::vector<int64_t> expired;
  for (const auto& [id, p] : parked)
    if (std::chrono::duration<double>(now - p.since).count() > opts.session_timeout_s) expired.push_back(id);
  for (int64_t id : expired) drop_parked(id, true);
}

}  // namespace tiller::engine
