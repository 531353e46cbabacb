// One unary gRPC call with its deadline, token and retries, shared by the remote clients (the
// environment's and the reward service's): each attempt gets the lesser of the call's deadline
// and the per-attempt timeout; transient failures (rpc::transient) are retried with a doubling
// backoff, up to `retries` times and never past the deadline; a refused token is the config's to
// fix (ConfigError: `tiller launch` does not restart for it). Private to src.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include "rpc/status.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"

namespace tiller::rpc {

struct RetryOptions {
  double timeout_seconds = 30;   // one attempt's deadline (the call's Deadline caps it)
  int retries = 3;               // attempts after the first, for transient failures only
  double backoff_seconds = 0.5;  // the first wait between attempts; doubles up to max_backoff_seconds
  double max_backoff_seconds = 8;
  std::string token;             // sent as x-tiller-token metadata when set
};

// What the errors say: "<where>: <what> failed after N attempt(s): <status><hint>", the hint by
// the failure's code. An empty `auth_hint` leaves a refused token to the general failure.
struct RetryMessages {
  std::string where;             // "environment 127.0.0.1:5" (the client)
  std::string what;              // "Step of session s, turn 2" (the call)
  std::string auth_hint;         // "check the environment's token": ConfigError "<where>: <what> <refused>: <status>; <hint>"
  std::string unavailable_hint;  // "; is the environment running?"
  std::string deadline_hint;     // "; each call may take 30 s"
  std::string refused = "refused";  // the word for a refused token
};

// For a client whose calls can be cancelled from another thread: `begin` before each attempt (to
// register its context for TryCancel; false: the client is shutting down), `end` after it,
// `sleep` for the backoff (false: shutting down), `cancelled` after a failed attempt.
struct RetryHooks {
  std::function<bool(grpc::ClientContext&)> begin;
  std::function<void(grpc::ClientContext&)> end;
  std::function<bool(double seconds)> sleep;
  std::function<bool()> cancelled;
};

// Runs `rpc(ctx)` until it succeeds; returns the retries it took. TimeoutError when the deadline
// passes before an attempt, ConfigError for a refused token (with an auth_hint), CommError for a
// failure that is not transient, or the last one (or when the hooks say the client is shutting
// down).
inline int call_with_retries(const RetryOptions& o, const RetryMessages& m, Deadline deadline,
                             const std::function<grpc::Status(grpc::ClientContext&)>& rpc,
                             const RetryHooks& hooks = {}) {
  const auto shutting_down = [&] { return CommError(fmt::format("{}: the client is shutting down", m.where)); };
  double wait = o.backoff_seconds;
  for (int attempt = 0;; ++attempt) {
    if (deadline.expired())
      throw TimeoutError(fmt::format("{}: {}: the deadline passed after {} attempt(s)", m.where, m.what, attempt));
    grpc::ClientContext ctx;
    const double left = std::min(deadline.remaining_seconds(), o.timeout_seconds);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(left)));
    if (!o.token.empty()) ctx.AddMetadata("x-tiller-token", o.token);
    if (hooks.begin && !hooks.begin(ctx)) throw shutting_down();
    const grpc::Status st = rpc(ctx);
    if (hooks.end) hooks.end(ctx);
    if (st.ok()) return attempt;
    if (hooks.cancelled && hooks.cancelled()) throw shutting_down();
    const std::string status = describe(st);
    const bool refused =
        st.error_code() == grpc::StatusCode::UNAUTHENTICATED || st.error_code() == grpc::StatusCode::PERMISSION_DENIED;
    if (refused && !m.auth_hint.empty())
      throw ConfigError(fmt::format("{}: {} {}: {}; {}", m.where, m.what, m.refused, status, m.auth_hint));
    if (!transient(st.error_code()) || attempt >= o.retries || deadline.remaining_seconds() <= wait) {
      throw CommError(fmt::format("{}: {} failed after {} attempt(s): {}{}", m.where, m.what, attempt + 1, status,
                                  st.error_code() == grpc::StatusCode::UNAVAILABLE         ? m.unavailable_hint
                                  : st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? m.deadline_hint
                                                                                           : std::string()));
    }
    if (hooks.sleep) {
      if (!hooks.sleep(wait)) throw shutting_down();
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    }
    wait = std::min(wait * 2, o.max_backoff_seconds);
  }
}

}  // namespace tiller::rpc
