// One step of the engine loop (engine_impl.h): the scheduler's plan applied, the batch launched
// (ahead of the host under asynchronous scheduling), and its draws collected into samples.
#include "engine/engine_impl.h"

namespace tiller::engine {

StepPlan Engine::Impl::schedule_now() {
  adopt_resumes();
  std::vector<SeqState> run_states;
  for (int64_t id : running) {
    const Sequence& s = seqs.at(id);
    run_states.push_back({id, static_cast<int64_t>(s.tokens.size()), s.num_computed, &s.table, 1 + s.pending_forks});
  }
  StepPlan plan = schedule(opts.limits, run_states, waiting_states(), *kv, parked_states());
  for (int64_t id : plan.evicted) drop_parked(id, true);
  for (int64_t id : plan.preempted) {
    Sequence& s = seqs.at(id);
    kv->release(s.table);
    s.num_computed = 0;
    ++s.preemptions;
    ++stats.preemptions;
    erase_id(running, id);
    insert_by_age(waiting, id);
  }
  for (int64_t id : plan.admitted) {
    erase_id(waiting, id);
    insert_by_age(running, id);
  }
  TILLER_CHECK(!plan.chunks.empty(), "the scheduler found nothing to run ({} running, {} waiting, {} free blocks)",
               running.size(), waiting.size(), kv->num_free());
  return plan;
}

InFlight Engine::Impl::launch(const StepPlan& plan, const std::unordered_map<int64_t, int64_t>& pending) {
  StepBatch b;
  InFlight f;
  for (const auto& c : plan.chunks) {
    Sequence& s = seqs.at(c.id);
    TILLER_CHECK(c.start == s.num_computed, "chunk of sequence {} starts at {}, {} computed", c.id, c.start,
                 s.num_computed);
    TILLER_CHECK(kv->append(s.table, c.count, b.copies), "no KV blocks for a scheduled chunk of sequence {}", c.id);
    const auto known = static_cast<int64_t>(s.tokens.size());
    const auto draw = pending.find(c.id);
    const int64_t total = known + (draw != pending.end() ? 1 : 0);
    TILLER_CHECK(c.start + c.count <= total, "chunk of sequence {} ends at {}, past its {} tokens", c.id,
                 c.start + c.count, total);
    const int64_t row0 = b.num_tokens();
    f.chunks.push_back({c.id, c.start, c.count, row0});
    for (int64_t pos = c.start; pos < c.start + c.count; ++pos) {
      if (pos == known) {  // the token the step in flight draws
        b.prev_rows.push_back(b.num_tokens());
        b.prev_draws.push_back(draw->second);
      }
      b.tokens.push_back(pos < known ? s.tokens[pos] : 0);
      b.positions.push_back(pos);
    }
    b.lens_q.push_back(c.count);
    b.lens_k.push_back(c.start + c.count);
    b.tables.push_back(s.table.blocks);
    s.num_computed += c.count;
    if (c.count != 1 || c.start < s.prompt_len) f.prefill_tokens += c.count;
    if (c.start + c.count < total) continue;  // prefill continues next step
    const model::SamplingParams& p = requests.at(s.request).req.params;
    const int64_t generated = total - s.prompt_len;
    for (int64_t j = 0; j <= s.pending_forks; ++j) {
      b.sample_rows.push_back(row0 + c.count - 1);
      b.sampling.add(p.greedy ? 0.0f : static_cast<float>(p.temperature), static_cast<float>(p.top_p), p.top_k,
                     static_cast<float>(p.min_p), model::sampling_uniform(p.seed + s.sample + j, generated));
      f.draws.push_back({c.id, j});
    }
  }
  if (tensor_parallel()) broadcast(Message::kStep, b.encode());
  runner->launch(b, /*sample=*/true);
  return f;
}

std::optional<InFlight> Engine::Impl::launch_ahead(const InFlight& f) {
  if (!async()) return std::nullopt;
  // A resume waiting for a seat that is free now is adopted by schedule_now() first.
  if (!resuming.empty() && running_seats() < opts.limits.max_num_seqs) return std::nullopt;
  std::unordered_map<int64_t, int64_t> pending;  // sequence -> its draw in `f`
  for (size_t i = 0; i < f.draws.size(); ++i) {
    if (f.draws[i].fork != 0) return std::nullopt;  // the forks exist only once the draw is seen
    pending.emplace(f.draws[i].seq, static_cast<int64_t>(i));
  }
  // The state after `f` as far as the host can know it: every draw appended, the samples that
  // reach max_new_tokens gone. A stop token is seen only when `f` is collected; that sample's
  // row in the step launched here is then dropped.
  std::vector<SeqState> run_states;
  for (int64_t id : running) {
    const Sequence& s = seqs.at(id);
    const bool drawn = pending.count(id) > 0;
    const int64_t tokens = static_cast<int64_t>(s.tokens.size()) + (drawn ? 1 : 0);
    if (drawn && tokens - s.prompt_len >= requests.at(s.request).req.params.max_new_tokens) continue;
    run_states.push_back({id, tokens, s.num_computed, &s.table, 1 + s.pending_forks});
  }
  const StepPlan plan = schedule(opts.limits, run_states, waiting_states(), *kv, parked_states());
  if (plan.chunks.empty() || !plan.preempted.empty() || !plan.admitted.empty() || !plan.evicted.empty())
    return std::nullopt;
  for (const auto& c : plan.chunks)
    if (c.count != 1) return std::nullopt;  // prefill chunks wait for the host
  ++stats.launched_ahead;
  return launch(plan, pending);
}

void Engine::Impl::collect(const InFlight& f, std::vector<SampleOutput>& done) {
  const ModelRunner::Sampled drawn = runner->collect();
  TILLER_CHECK(drawn.tokens.size() == f.draws.size(), "the runner returned {} draws for {} sample rows",
               drawn.tokens.size(), f.draws.size());
  stats.last_step_prefill_tokens = f.prefill_tokens;
  stats.prefill_tokens += f.prefill_tokens;
  // Sequences aborted, or stopped by the step before, since `f` was launched: their draws are
  // dropped.
  auto live = [&](int64_t id) { return seqs.find(id) != seqs.end(); };
  // Routing replay: each chunk's experts into its sequence (before forks copy the parent's).
  if (drawn.route_width > 0) {
    for (const auto& c : f.chunks) {
      if (!live(c.seq)) continue;
      TILLER_CHECK(static_cast<int64_t>(drawn.routes.size()) >= (c.row + c.count) * drawn.route_width,
                   "the runner recorded routes for {} rows, the step has more",
                   static_cast<int64_t>(drawn.routes.size()) / drawn.route_width);
      seqs.at(c.seq).set_routes(c.start, c.count, drawn.routes.data() + c.row * drawn.route_width, drawn.route_width);
    }
  }
  // Forks first: they copy the parent's tokens before the parent's own draw is appended.
  std::vector<int64_t> sampled;
  for (size_t i = 0; i < f.draws.size(); ++i) {
    if (f.draws[i].fork == 0 || !live(f.draws[i].seq)) continue;
    Sequence& parent = seqs.at(f.draws[i].seq);
    Sequence child;
    child.id = next_id++;
    child.request = parent.request;
    child.sample = parent.sample + f.draws[i].fork;
    child.tokens = parent.tokens;
    child.prompt_len = parent.prompt_len;
    child.table = kv->fork(parent.table);
    child.num_computed = parent.num_computed;
    child.logprobs = parent.logprobs;
    child.version_starts = parent.version_starts;
    child.versions = parent.versions;
    child.routes = parent.routes;
    child.route_width = parent.route_width;
    child.append(drawn.tokens[i], drawn.logprobs[i], weight_version);
    sampled.push_back(child.id);
    running.push_back(child.id);  // the newest: ids only grow
    seqs.emplace(child.id, std::move(child));
  }
  for (size_t i = 0; i < f.draws.size(); ++i) {
    if (f.draws[i].fork != 0 || !live(f.draws[i].seq)) continue;
    Sequence& s = seqs.at(f.draws[i].seq);
    if (static_cast<int64_t>(s.tokens.size()) == s.prompt_len) stats.prompt_tokens += s.prompt_len;  // once a prompt
    s.pending_forks = 0;
    s.append(drawn.tokens[i], drawn.logprobs[i], weight_version);
    sampled.push_back(s.id);
  }
  stats.generated_tokens += static_cast<int64_t>(sampled.size());
  for (int64_t id : sampled) {
    Sequence& s = seqs.at(id);
    const model::SamplingParams& p = requests.at(s.request).req.params;
    const int64_t last = s.tokens.back();
    const char* reason = nullptr;
    if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), last) != p.stop_token_ids.end()) reason = "stop";
    else if (static_cast<int64_t>(s.tokens.size()) - s.prompt_len >= p.max_new_tokens) reason = "length";
    if (!reason) {
      if (requests.at(s.request).req.stream) {  // the new token, for a streaming caller
        SampleOutput partial;
        partial.request_id = s.request;
        partial.sample = s.sample;
        partial.tokens = {last};
        partial.logprobs = {s.logprobs.back()};
        partial.prompt_tokens = s.prompt_len;
        done.push_back(std::move(partial));
      }
      continue;
    }
    const bool keep = requests.at(s.request).req.keep_session;
    done.push_back(finish(s, reason, keep));
    erase_id(running, id);
    if (keep) park(std::move(s));
    seqs.erase(id);
  }
  ++stats.steps;
}

std::vector<SampleOutput> Engine::step() {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader() && !m.shut_down, "step() on a TP follower or after shutdown()");
  std::vector<SampleOutput> done = std::move(m.aborted);
  m.aborted.clear();
  m.expire_sessions();
  if (m.seqs.empty() && !m.in_flight) return done;
  const auto t0 = std::chrono::steady_clock::now();
  if (!m.in_flight) m.in_flight = m.launch(m.schedule_now(), {});
  // The next step goes to the device before this one's draws are waited for, so that the host's
  // work between steps (outputs, scheduling, inputs) runs while the GPU computes.
  std::optional<InFlight> next = m.launch_ahead(*m.in_flight);
  const InFlight current = std::move(*m.in_flight);
  m.in_flight = std::move(next);
  m.collect(current, done);
  m.stats.seconds_in_steps += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return done;
}

std::vector<SampleOutput> Engine::drain() {
  Impl& m = *impl_;
  const auto on_stream = m.on_stream();
  TILLER_CHECK(m.leader(), "drain() on a TP follower");
  std::vector<SampleOutput> done = std::move(m.aborted);
  m.aborted.clear();
  if (!m.in_flight) return done;
  const InFlight current = std::move(*m.in_flight);
  m.in_flight.reset();
  m.collect(current, done);
  return done;
}

}  // namespace tiller::engine
