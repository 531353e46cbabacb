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

}  // namespace tiller::engine
