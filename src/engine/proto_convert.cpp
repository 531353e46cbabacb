#include "engine/proto_convert.h"

#include <cstring>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::engine {

Request from_proto(const v1::GenerateRequest& g, uint64_t fallback_seed) {
  Request r;
  r.id = g.request_id();
  r.prompt.assign(g.prompt_token_ids().begin(), g.prompt_token_ids().end());
  r.n = g.n() == 0 ? 1 : g.n();
  const v1::SamplingParams& p = g.params();
  r.params.greedy = p.greedy() || p.temperature() == 0;
  r.params.temperature = r.params.greedy ? 1.0 : p.temperature();
  r.params.top_p = p.top_p() == 0 ? 1.0 : p.top_p();
  r.params.top_k = p.top_k();
  r.params.min_p = p.min_p();
  r.params.seed = p.has_seed() ? p.seed() : fallback_seed;
  r.params.max_new_tokens = p.max_new_tokens();
  r.params.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  r.keep_session = g.keep_session();
  r.stream = g.stream_tokens();
  r.resume = g.has_resume();
  if (r.resume) r.session = {g.resume().request_id(), g.resume().sample()};
  return r;
}

void to_proto(const Request& r, uint64_t min_weight_version, v1::GenerateRequest& g) {
  g.set_request_id(r.id);
  g.mutable_prompt_token_ids()->Add(r.prompt.begin(), r.prompt.end());
  g.set_n(static_cast<int32_t>(r.n));
  g.set_min_weight_version(min_weight_version);
  v1::SamplingParams* p = g.mutable_params();
  p->set_greedy(r.params.greedy);
  p->set_temperature(r.params.greedy ? 0.0f : static_cast<float>(r.params.temperature));
  p->set_top_p(static_cast<float>(r.params.top_p));
  p->set_top_k(r.params.top_k);
  p->set_min_p(static_cast<float>(r.params.min_p));
  p->set_seed(r.params.seed);
  p->set_max_new_tokens(r.params.max_new_tokens);
  p->mutable_stop_token_ids()->Add(r.params.stop_token_ids.begin(), r.params.stop_token_ids.end());
  g.set_keep_session(r.keep_session);
  g.set_stream_tokens(r.stream);
  if (r.resume) {
    g.mutable_resume()->set_request_id(r.session.request);
    g.mutable_resume()->set_sample(static_cast<int32_t>(r.session.sample));
  }
}

ClientResult from_proto(const v1::GenerateStreamResponse& r) {
  ClientResult c;
  if (r.has_sample()) {
    c.sample = from_proto(r.sample());
    c.weight_version = r.sample().weight_version();
  } else {
    c.sample.request_id = r.error().request_id();
    c.error_code = r.error().code();
    c.error = r.error().message();
  }
  return c;
}

void to_proto(const SampleOutput& o, uint64_t weight_version, v1::SampleResult& s) {
  s.set_request_id(o.request_id);
  s.set_sample(static_cast<int32_t>(o.sample));
  s.mutable_token_ids()->Add(o.tokens.begin(), o.tokens.end());
  s.mutable_logprobs()->Add(o.logprobs.begin(), o.logprobs.end());
  s.set_finish_reason(o.finish_reason);
  s.set_prompt_tokens(o.prompt_tokens);
  s.set_weight_version(weight_version);
  s.mutable_version_starts()->Add(o.version_starts.begin(), o.version_starts.end());
  s.mutable_versions()->Add(o.versions.begin(), o.versions.end());
  if (o.route_width > 0) {  // int16 little-endian (every supported host is)
    s.set_routes(std::string(reinterpret_cast<const char*>(o.routes.data()), o.routes.size() * sizeof(int16_t)));
    s.set_route_width(static_cast<int32_t>(o.route_width));
  }
}

SampleOutput from_proto(const v1::SampleResult& s) {
  SampleOutput o;
  o.request_id = s.request_id();
  o.sample = s.sample();
  o.tokens.assign(s.token_ids().begin(), s.token_ids().end());
  o.logprobs.assign(s.logprobs().begin(), s.logprobs().end());
  o.finish_reason = s.finish_reason();
  o.prompt_tokens = s.prompt_tokens();
  o.version_starts.assign(s.version_starts().begin(), s.version_starts().end());
  o.versions.assign(s.versions().begin(), s.versions().end());
  if (s.route_width() > 0 || !s.routes().empty()) {
    const int64_t rows = o.prompt_tokens + static_cast<int64_t>(o.tokens.size()) - 1;
    const auto bytes = static_cast<int64_t>(s.routes().size());
    constexpr int32_t kMaxRouteWidth = 1 << 16;  // sparse layers x top-k: far above any model's
    if (s.route_width() <= 0 || s.route_width() > kMaxRouteWidth || rows < 0 ||
        bytes != rows * int64_t{s.route_width()} * 2)
      throw CommError(fmt::format("engine sample {} of request {}: {} bytes of routes of width {} do not cover its {} "
                                 "computed tokens",
                                 s.sample(), s.request_id(), bytes, s.route_width(), rows));
    o.route_width = s.route_width();
    o.routes.resize(static_cast<size_t>(rows * o.route_width));
    std::memcpy(o.routes.data(), s.routes().data(), static_cast<size_t>(bytes));
  }
  return o;
}

void to_proto(const EngineStats& s, double tokens_per_second, uint64_t weight_version, v1::StatsResponse& r) {
  r.set_running(s.running);
  r.set_waiting(s.waiting);
  r.set_kv_blocks_total(s.kv_blocks_total);
  r.set_kv_blocks_free(s.kv_blocks_free);
  r.set_kv_cache_usage(s.kv_blocks_total
                           ? 1.0 - static_cast<double>(s.kv_blocks_free) / static_cast<double>(s.kv_blocks_total)
                           : 0.0);
  r.set_tokens_per_second(tokens_per_second);
  r.set_steps(s.steps);
  r.set_prompt_tokens(s.prompt_tokens);
  r.set_generated_tokens(s.generated_tokens);
  r.set_preemptions(s.preemptions);
  r.set_requests_finished(s.requests_finished);
  r.set_launched_ahead(s.launched_ahead);
  r.set_kv_rebuilds(s.kv_rebuilds);
  r.set_seconds_in_steps(s.seconds_in_steps);
  r.set_bench_tokens_per_s(s.bench_tokens_per_s);
  r.set_device_peak_gb(s.device_peak_gb);
  r.set_prefill_tokens(s.prefill_tokens);
  r.set_sessions_parked(s.sessions_parked);
  r.set_session_resumes(s.session_resumes);
  r.set_session_tokens_reused(s.session_tokens_reused);
  r.set_session_misses(s.session_misses);
  r.set_session_evictions(s.session_evictions);
  r.set_weight_version(weight_version);
}

ServerStats from_proto(const v1::StatsResponse& r) {
  ServerStats s;
  s.engine.running = r.running();
  s.engine.waiting = r.waiting();
  s.engine.kv_blocks_total = r.kv_blocks_total();
  s.engine.kv_blocks_free = r.kv_blocks_free();
  s.engine.steps = r.steps();
  s.engine.prompt_tokens = r.prompt_tokens();
  s.engine.generated_tokens = r.generated_tokens();
  s.engine.preemptions = r.preemptions();
  s.engine.requests_finished = r.requests_finished();
  s.engine.launched_ahead = r.launched_ahead();
  s.engine.kv_rebuilds = r.kv_rebuilds();
  s.engine.prefill_tokens = r.prefill_tokens();
  s.engine.sessions_parked = r.sessions_parked();
  s.engine.session_resumes = r.session_resumes();
  s.engine.session_tokens_reused = r.session_tokens_reused();
  s.engine.session_misses = r.session_misses();
  s.engine.session_evictions = r.session_evictions();
  s.engine.seconds_in_steps = r.seconds_in_steps();
  s.engine.bench_tokens_per_s = r.bench_tokens_per_s();
  s.engine.device_peak_gb = r.device_peak_gb();
  s.kv_cache_usage = r.kv_cache_usage();
  s.tokens_per_second = r.tokens_per_second();
  s.weight_version = r.weight_version();
  return s;
}

void to_proto(const EngineMemory& m, v1::MemoryResponse& r) {
  r.set_weight_bytes(m.weight_bytes);
  r.set_kv_cache_bytes(m.kv_cache_bytes);
  r.set_sleep_level(m.sleep_level);
  r.set_device_allocated(m.device_allocated);
  r.set_device_reserved(m.device_reserved);
}

ServerMemory from_proto(const v1::MemoryResponse& r) {
  ServerMemory m;
  m.engine.weight_bytes = r.weight_bytes();
  m.engine.kv_cache_bytes = r.kv_cache_bytes();
  m.engine.sleep_level = r.sleep_level();
  m.engine.device_allocated = m.device_allocated = r.device_allocated();
  m.engine.device_reserved = m.device_reserved = r.device_reserved();
  return m;
}

void to_proto(const WeightChunk& c, v1::WeightChunk& m) {
  m.set_version(c.version);
  m.set_plan_id(c.plan_id);
  m.set_sender(c.sender);
  m.set_bucket(c.bucket);
  m.set_offset(c.offset);
  m.set_bytes(c.bytes);
  m.set_form(c.form);
  m.set_base_hash(c.base_hash);
  m.set_hash(c.hash);
  m.set_changed(c.changed);
  m.set_payload(c.payload);
}

WeightChunk from_proto(v1::WeightChunk&& m) {
  WeightChunk c;
  c.version = m.version();
  c.plan_id = m.plan_id();
  c.sender = m.sender();
  c.bucket = m.bucket();
  c.offset = m.offset();
  c.bytes = m.bytes();
  c.form = m.form();
  c.base_hash = m.base_hash();
  c.hash = m.hash();
  c.changed = m.changed();
  c.payload = std::move(*m.mutable_payload());
  return c;
}

}  // namespace tiller::engine
