// The gRPC service on a real socket: many concurrent streams, malformed requests, the token,
// weight-update control, aborts and deadlines.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <map>
#include <random>
#include <thread>

#include <ATen/ATen.h>

#include "tiller/core/tls.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/openai_server.h"
#include "tiller/engine/server.h"
#include "tiller/model/generate.h"
#include "tiller/model/weights.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::engine {
namespace {

struct Served {
  model::ModelConfig cfg;
  model::NamedTensors named;
  model::ModelWeights weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<EngineServer> server;
  std::string address;

  explicit Served(const std::string& token = "", const TlsFiles& tls = {}) {
    cfg = model::preset("tiny-qwen2");
    cfg.initializer_range = 0.25;
    named = model::init_weights(cfg, model::Head::kLm, 4, at::kFloat);
    weights = model::bind_weights(cfg, named, model::Head::kLm, "tiny");
    EngineOptions o;
    o.block_size = 8;
    o.num_blocks = 128;
    o.limits.max_num_seqs = 16;
    engine = std::make_unique<Engine>(cfg, weights, o);
    ServerOptions so;
    so.address = "127.0.0.1:0";
    so.token = token;
    so.tls = tls;
    server = std::make_unique<EngineServer>(*engine, so);
    address = "127.0.0.1:" + std::to_string(server->port());
  }
};

Request greedy_request(uint64_t id, std::vector<int64_t> prompt, int64_t max_new) {
  Request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.params.greedy = true;
  r.params.max_new_tokens = max_new;
  return r;
}

TEST(EngineService, ConcurrentStreamsAllCompleteWithTheReferenceTokens) {
  Served s;
  const int clients = 4, per_client = 12;
  std::vector<std::vector<int64_t>> prompts;
  std::mt19937_64 rng(5);
  for (int i = 0; i < clients * per_client; ++i) {
    std::vector<int64_t> p(1 + rng() % 30);
    for (auto& t : p) t = static_cast<int64_t>(rng() % 500);
    prompts.push_back(p);
  }
  std::vector<std::vector<SampleOutput>> got(clients);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      EngineClient client({s.address});
      std::vector<Request> rs;
      for (int i = 0; i < per_client; ++i) {
        const int k = c * per_client + i;
        rs.push_back(greedy_request(static_cast<uint64_t>(k), prompts[k], 4 + k % 9));
      }
      got[c] = client.generate(rs, Deadline::after_seconds(120));
    });
  }
  for (auto& t : threads) t.join();
  model::SamplingParams g;
  g.greedy = true;
  for (int c = 0; c < clients; ++c) {
    ASSERT_EQ(got[c].size(), static_cast<size_t>(per_client));
    for (const auto& o : got[c]) {
      const auto k = static_cast<size_t>(o.request_id);
      g.max_new_tokens = 4 + static_cast<int64_t>(k) % 9;
      const auto ref = model::generate(s.cfg, s.weights, {prompts[k]}, g);
      EXPECT_EQ(o.tokens, ref[0].tokens) << "request " << k;
      EXPECT_EQ(o.finish_reason, "length");
    }
  }
  EngineClient client({s.address});
  const ServerStats st = client.stats();
  EXPECT_EQ(st.engine.requests_finished, clients * per_client);
  EXPECT_EQ(st.engine.running + st.engine.waiting, 0);
  EXPECT_EQ(st.engine.kv_blocks_free, st.engine.kv_blocks_total);
  const ServerHealth h = client.health();
  EXPECT_EQ(h.status, "serving");
  EXPECT_EQ(h.vocab_size, 512);
}

TEST(EngineService, MalformedRequestsAreRefusedAndTheServerKeepsServing) {
  Served s;
  EngineClient client({s.address});
  auto session = client.open_session(Deadline::after_seconds(60));
  std::mt19937_64 rng(17);
  int sent = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    Request r = greedy_request(1000 + i, {1, 2, 3}, 3);
    switch (rng() % 9) {  // one broken field each
      case 0: r.prompt.clear(); break;
      case 1: r.prompt.push_back(static_cast<int64_t>(512 + rng() % 100000)); break;
      case 2: r.prompt[0] = -static_cast<int64_t>(1 + rng() % 1000); break;
      case 3: r.params.greedy = false; r.params.temperature = -static_cast<double>(rng() % 5) - 0.5; break;
      case 4: r.params.top_p = 1.0 + static_cast<double>(rng() % 100) / 10; break;
      case 5: r.params.max_new_tokens = -static_cast<int64_t>(rng() % 5); break;
      case 6: r.n = 1000 + static_cast<int64_t>(rng() % 1000); break;
      case 7: r.params.max_new_tokens = 100000; break;
      case 8: r.params.stop_token_ids = {100000}; break;
    }
    session->send(r);
    ++sent;
  }
  session->send(greedy_request(7, {4, 5, 6}, 5));  // a good one among them
  session->close_sends();
  int refused = 0, served = 0;
  ClientResult c;
  while (session->next(c, Deadline::after_seconds(60))) {
    if (c.error_code != 0) {
      EXPECT_EQ(c.error_code, 3) << c.error;  // INVALID_ARGUMENT
      EXPECT_NE(c.error.find("request " + std::to_string(c.sample.request_id)), std::string::npos) << c.error;
      ++refused;
    } else {
      EXPECT_EQ(c.sample.request_id, 7u);
      EXPECT_EQ(c.sample.tokens.size(), 5u);
      ++served;
    }
  }
  EXPECT_EQ(refused, sent);
  EXPECT_EQ(served, 1);
  EXPECT_EQ(client.health().status, "serving");
  // A NaN temperature and a refused request through the convenience call.
  Request nan = greedy_request(8, {1}, 2);
  nan.params.greedy = false;
  nan.params.temperature = std::nan("");
  EXPECT_THROW(client.generate({nan}, Deadline::after_seconds(30)), InvalidRequest);
  EXPECT_EQ(client.generate({greedy_request(9, {1, 2}, 2)}, Deadline::after_seconds(30)).size(), 1u);
}

TEST(EngineService, TokenIsRequiredWhenConfigured) {
  Served s("s3cret");
  EngineClient none({s.address});
  EXPECT_THROW(none.health(), CommError);
  EngineClient wrong({s.address, "nope"});
  EXPECT_THROW(wrong.generate({greedy_request(1, {1}, 1)}, Deadline::after_seconds(30)), CommError);
  EngineClient right({s.address, "s3cret"});
  EXPECT_EQ(right.health().status, "serving");
  EXPECT_EQ(right.generate({greedy_request(1, {1}, 2)}, Deadline::after_seconds(30)).size(), 1u);
}

// A self-signed certificate for `name` (and 127.0.0.1), made with the openssl command line.
TlsFiles self_signed(const std::string& dir, const std::string& name) {
  std::filesystem::create_directories(dir);
  TlsFiles t{dir + "/cert.pem", dir + "/key.pem", "", ""};
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=" + name + " -addext "
                          "subjectAltName=DNS:" + name + ",IP:127.0.0.1 -keyout " + t.key + " -out " + t.cert +
                          " >/dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return t;
}

TEST(EngineService, TlsServesWhoTrustsTheCertificateAndRefusesTheRest) {
  const std::string dir = TILLER_TEST_SCRATCH "/engine_tls";
  const TlsFiles server_tls = self_signed(dir, "tiller-engine");
  Served s("s3cret", server_tls);
  ClientOptions good{s.address, "s3cret"};
  good.tls.ca = server_tls.cert;                 // self-signed: the certificate is its own root
  good.tls.server_name = "tiller-engine";        // dialled by IP, checked against this name
  EngineClient trusted(good);
  EXPECT_EQ(trusted.health().status, "serving");
  EXPECT_EQ(trusted.generate({greedy_request(1, {1, 2}, 3)}, Deadline::after_seconds(30)).at(0).tokens.size(), 3u);
  // The token is still required over TLS.
  ClientOptions no_token = good;
  no_token.token = "";
  EXPECT_THROW(EngineClient(no_token).health(), CommError);
  // Plaintext to a TLS port, a certificate from another root, and the wrong name all fail.
  EXPECT_THROW(EngineClient(ClientOptions{s.address, "s3cret"}).health(), CommError);
  const TlsFiles other = self_signed(dir + "/other", "tiller-engine");
  ClientOptions untrusted = good;
  untrusted.tls.ca = other.cert;
  EXPECT_THROW(EngineClient(untrusted).health(), CommError);
  ClientOptions wrong_name = good;
  wrong_name.tls.server_name = "somebody-else";
  EXPECT_THROW(EngineClient(wrong_name).health(), CommError);
  // Files that are not PEM are named before anything is dialled.
  ClientOptions bad_ca = good;
  bad_ca.tls.ca = dir + "/nope.pem";
  try {
    EngineClient c(bad_ca);
    FAIL() << "a missing CA file was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("TLS CA " + dir + "/nope.pem: cannot read it"), std::string::npos) << e.what();
  }
}

TEST(Security, LoopbackHostsAndConstantTimeSecrets) {
  for (const char* h : {"127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"}) EXPECT_TRUE(is_loopback_host(h)) << h;
  for (const char* h : {"0.0.0.0", "10.0.0.7", "::", "node-3", "128.0.0.1"}) EXPECT_FALSE(is_loopback_host(h)) << h;
  EXPECT_TRUE(secrets_equal("abc", "abc"));
  EXPECT_FALSE(secrets_equal("abc", "abd"));
  EXPECT_FALSE(secrets_equal("abc", "abcd"));
}

TEST(EngineService, WeightUpdatesPauseServingAndVersionTheResults) {
  Served s;
  EngineClient client({s.address});
  EXPECT_EQ(client.begin_weight_update(3), 0u);
  EXPECT_EQ(client.health().status, "updating_weights");
  EXPECT_THROW(client.begin_weight_update(4), InvalidRequest);  // one at a time
  EXPECT_THROW(client.end_weight_update(5), InvalidRequest);    // not the version begun
  // Requests sent during the update wait for it.
  auto session = client.open_session(Deadline::after_seconds(60));
  session->send(greedy_request(1, {1, 2, 3}, 4));
  session->close_sends();
  ClientResult c;
  EXPECT_THROW(session->next(c, Deadline::after_seconds(0.5)), TimeoutError);
  EXPECT_EQ(client.end_weight_update(3), 3u);
  ASSERT_TRUE(session->next(c, Deadline::after_seconds(30)));
  EXPECT_EQ(c.error_code, 0) << c.error;
  EXPECT_EQ(c.weight_version, 3u);
  EXPECT_EQ(client.stats().weight_version, 3u);
  EXPECT_THROW(client.begin_weight_update(2), InvalidRequest);  // not newer
  // A request that needs a newer version than the engine has is refused, not served stale.
  auto s2 = client.open_session(Deadline::after_seconds(30));
  s2->send(greedy_request(2, {1}, 2), /*min_weight_version=*/4);
  s2->close_sends();
  ASSERT_TRUE(s2->next(c, Deadline::after_seconds(30)));
  EXPECT_EQ(c.error_code, 9) << "FAILED_PRECONDITION expected";  // FAILED_PRECONDITION
}

TEST(EngineService, AbortAndStreamCancellationFreeTheEngine) {
  Served s;
  EngineClient client({s.address});
  {
    auto session = client.open_session(Deadline::after_seconds(60));
    // Long enough (and together over the cache's 1024 tokens) to be running for seconds.
    session->send(greedy_request(1, {1, 2}, 1000));
    session->send(greedy_request(2, {3}, 1000));
    // Wait until both run, then abort one by RPC; drop the stream with the other still running.
    for (int i = 0; i < 200 && client.stats().engine.running < 2; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(client.abort({1, 99}), std::vector<uint64_t>{1});
    ClientResult c;
    ASSERT_TRUE(session->next(c, Deadline::after_seconds(30)));
    EXPECT_EQ(c.sample.request_id, 1u);
    EXPECT_EQ(c.sample.finish_reason, "abort");
  }
  for (int i = 0; i < 300 && client.stats().engine.running + client.stats().engine.waiting > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const ServerStats st = client.stats();
  EXPECT_EQ(st.engine.running + st.engine.waiting, 0) << "the cancelled stream's request still runs";
  EXPECT_EQ(st.engine.kv_blocks_free, st.engine.kv_blocks_total);
}

// Multi-turn over the wire: a kept session is resumed by the next turn's request (its prefix is
// not computed again: the Stats counters), gives the tokens of a fresh request, and is freed by
// release_session.
TEST(EngineService, SessionsAreKeptResumedAndReleasedOverTheStream) {
  Served s;
  EngineClient client({s.address});
  auto session = client.open_session(Deadline::after_seconds(60));
  Request first = greedy_request(1, {5, 6, 7, 8, 9}, 6);
  first.keep_session = true;
  session->send(first);
  ClientResult c;
  ASSERT_TRUE(session->next(c, Deadline::after_seconds(30)));
  ASSERT_EQ(c.error_code, 0) << c.error;
  std::vector<int64_t> prompt = first.prompt;
  prompt.insert(prompt.end(), c.sample.tokens.begin(), c.sample.tokens.end());
  prompt.insert(prompt.end(), {3, 4});  // the observation
  Request second = greedy_request(2, prompt, 5);
  second.resume = true;
  second.session = {1, 0};
  second.keep_session = true;
  session->send(second);
  ASSERT_TRUE(session->next(c, Deadline::after_seconds(30)));
  ASSERT_EQ(c.error_code, 0) << c.error;
  const std::vector<int64_t> resumed = c.sample.tokens;
  session->send(greedy_request(3, prompt, 5));  // the same prompt from scratch
  ASSERT_TRUE(session->next(c, Deadline::after_seconds(30)));
  EXPECT_EQ(resumed, c.sample.tokens);
  ServerStats st = client.stats();
  EXPECT_EQ(st.engine.session_resumes, 1);
  EXPECT_EQ(st.engine.session_tokens_reused, 10);  // 5 prompt + 6 generated, less the last
  EXPECT_EQ(st.engine.sessions_parked, 1);         // the second turn's
  session->release_session({2, 0});
  for (int i = 0; i < 300 && client.stats().engine.sessions_parked > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  st = client.stats();
  EXPECT_EQ(st.engine.sessions_parked, 0);
  EXPECT_EQ(st.engine.kv_blocks_free, st.engine.kv_blocks_total);
  session->close_sends();
}

TEST(EngineService, UnreachableServerAndDeadlinesAreClearErrors) {
  EngineClient client({"127.0.0.1:1", "", 2.0});
  try {
    client.health();
    ADD_FAILURE() << "no error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:1"), std::string::npos) << e.what();
  }
}

// The OpenAI endpoint's hermes tool-call parser (--tool-call-parser hermes): Hermes' and
// Qwen2.5's <tool_call> blocks become calls; text before them the content; a block that is not
// such JSON leaves the whole reply as content.
TEST(OpenAiEndpoint, HermesToolCallsAreReadOutOfTheReply) {
  EXPECT_FALSE(parse_hermes_tool_calls("The sum is 5.").has_value());
  auto one = parse_hermes_tool_calls("I'll add them.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>");
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->content, "I'll add them.");
  ASSERT_EQ(one->calls.size(), 1u);
  EXPECT_EQ(one->calls[0].first, "add");
  EXPECT_EQ(one->calls[0].second, R"({"a":2,"b":3})");
  // Two calls, arguments written as a JSON string, the last block unclosed (the reply ended at its
  // stop token), no content.
  auto two = parse_hermes_tool_calls(
      "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": [1]}\"}</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}");
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->content, "");
  ASSERT_EQ(two->calls.size(), 2u);
  EXPECT_EQ(two->calls[0].second, R"({"x":[1]})");
  EXPECT_EQ(two->calls[1].first, "g");
  EXPECT_EQ(two->calls[1].second, "{}");
  // Not calls: broken JSON, no name, arguments that are not an object.
  EXPECT_FALSE(parse_hermes_tool_calls("<tool_call>{\"name\": \"f\", </tool_call>").has_value());
  EXPECT_FALSE(parse_hermes_tool_calls("<tool_call>{\"arguments\": {}}</tool_call>").has_value());
  EXPECT_FALSE(parse_hermes_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>").has_value());
}

// An endpoint shut down right after its start (a job whose agent harness fails in its first
// milliseconds) ends: httplib's stop() before its listen loop has begun used to leave the loop
// running and shutdown() joining it forever.
TEST(OpenAiEndpoint, AShutdownRightAfterTheStartEnds) {
  auto s = std::make_shared<Served>();  // shared with the thread, which a hang leaves behind
  std::shared_ptr<const text::Tokenizer> tok =
      text::load_tokenizer(std::string(TILLER_HF_FIXTURES) + "/tokenizers/qwen2");
  const text::ChatTemplate chat(text::ChatFormat::kChatML);
  OpenAiOptions o;
  o.port = 0;
  o.threads = 2;
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> ended = done->get_future();
  // On a thread of its own, so that a hang fails the test rather than holding it to ctest's limit.
  std::thread([s, tok, chat, o, done] {
    for (int i = 0; i < 50; ++i) {
      OpenAiServer server(*s->server, tok, chat, {}, 64, o);
      server.shutdown();
    }
    done->set_value();
  }).detach();
  ASSERT_EQ(ended.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "an OpenAI endpoint shut down right after its start did not end";
}

}  // namespace
}  // namespace tiller::engine
