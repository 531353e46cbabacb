#include "wire/channel.h"

#include <algorithm>

#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::wire {

// --- MpiChannel ---

MpiChannel::MpiChannel(dist::Communicator& world) : world_(world) {
  incoming_.resize(static_cast<size_t>(world.size()));
}

MpiChannel::~MpiChannel() = default;

void MpiChannel::reap() {
  while (!sending_.empty() && sending_.front()->is_completed()) sending_.pop_front();
}

void MpiChannel::send(int rank, Frame f) {
  for (auto& w : send_frame(world_, rank, f)) sending_.push_back(std::move(w));
  reap();
}

bool MpiChannel::poll(int rank, Frame& out) {
  auto& in = incoming_.at(static_cast<size_t>(rank));
  if (!in) in = std::make_unique<IncomingFrame>(world_, rank);
  if (!in->poll()) return false;
  out = in->take();
  in.reset();
  reap();
  return true;
}

void MpiChannel::flush(Deadline deadline) {
  for (auto& w : sending_) w->wait(deadline);
  sending_.clear();
}

// --- LocalChannel ---

LocalChannel::LocalChannel(std::vector<RankEndpoint*> endpoints, int threads) : endpoints_(std::move(endpoints)) {
  replies_.resize(endpoints_.size());
  for (int i = 0; i < threads; ++i) workers_.push_back(std::make_unique<Worker>());
  for (size_t i = 0; i < workers_.size(); ++i) workers_[i]->thread = std::thread([this, i] { work(i); });
}

LocalChannel::~LocalChannel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w->thread.join();
}

void LocalChannel::deliver(int rank, Frame f) {
  std::vector<Frame> out;
  try {
    out = endpoints_.at(static_cast<size_t>(rank))->handle(std::move(f));
  } catch (const std::exception& e) {
    out.push_back(ErrorReply{e.what()}.encode());
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : out) replies_[static_cast<size_t>(rank)].push_back(std::move(r));
  --queued_;
  replies_cv_.notify_all();
}

void LocalChannel::work(size_t w) {
  Worker& me = *workers_[w];
  for (;;) {
    std::pair<int, Frame> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !me.inbox.empty(); });
      if (me.inbox.empty()) return;
      item = std::move(me.inbox.front());
      me.inbox.pop_front();
    }
    deliver(item.first, std::move(item.second));
  }
}

void LocalChannel::send(int rank, Frame f) {
  TILLER_CHECK(rank >= 0 && static_cast<size_t>(rank) < endpoints_.size() && endpoints_[static_cast<size_t>(rank)],
               "local channel: no endpoint for rank {}", rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++queued_;
    if (!workers_.empty()) {
      workers_[static_cast<size_t>(rank) % workers_.size()]->inbox.emplace_back(rank, std::move(f));
      cv_.notify_all();
      return;
    }
  }
  deliver(rank, std::move(f));
}

bool LocalChannel::poll(int rank, Frame& out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& q = replies_.at(static_cast<size_t>(rank));
  if (q.empty()) return false;
  out = std::move(q.front());
  q.pop_front();
  return true;
}

void LocalChannel::flush(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto handled = [&] { return queued_ == 0; };
  if (deadline.is_never()) {
    replies_cv_.wait(lock, handled);
  } else if (!replies_cv_.wait_until(lock, deadline.at(), handled)) {
    throw TimeoutError(fmt::format("local channel: {} frames still unhandled at the deadline", queued_));
  }
}

void LocalChannel::wait_for_reply(int ms) {
  std::unique_lock<std::mutex> lock(mu_);
  replies_cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] {
    return std::any_of(replies_.begin(), replies_.end(), [](const auto& q) { return !q.empty(); });
  });
}

// --- TrainerLink ---

TrainerLink::TrainerLink(Channel& channel, std::function<std::string(int)> describe, const Clock& clock)
    : channel_(channel), describe_(std::move(describe)), clock_(clock) {}

void TrainerLink::send(int rank, Frame request) { channel_.send(rank, std::move(request)); }

void TrainerLink::call(int rank, Frame request, double timeout_s, std::string what, OnReply on_reply) {
  const auto sent = clock_.now();  // before the send: an in-process rank may answer inside it
  channel_.send(rank, std::move(request));
  calls_[rank].push_back({std::move(what), timeout_s, sent, std::move(on_reply)});
  ++pending_;
}

int TrainerLink::poll() {
  int handled = 0;
  const auto now = clock_.now();
  for (auto& [rank, calls] : calls_) {
    while (!calls.empty()) {
      Frame f;
      if (!channel_.poll(rank, f)) {
        const Call& head = calls.front();
        auto it = answered_.find(rank);
        const auto start = it == answered_.end() ? head.sent : std::max(head.sent, it->second);
        const double waited = std::chrono::duration<double>(now - start).count();
        if (waited > head.timeout_s)
          throw TimeoutError(fmt::format("{} did not answer {} within {:.0f} s (it may be stuck; see its log)",
                                         describe_(rank), head.what, head.timeout_s));
        break;
      }
      Call c = std::move(calls.front());
      calls.pop_front();
      --pending_;
      answered_[rank] = clock_.now();
      if (f.op == Op::kError)
        throw Error(fmt::format("{} failed during {}: {}", describe_(rank), c.what, ErrorReply::decode(std::move(f)).what));
      try {
        c.on_reply(std::move(f));
      } catch (const CommError& e) {
        throw CommError(fmt::format("{} answered {} wrongly: {}", describe_(rank), c.what, e.what()));
      }
      ++handled;
    }
  }
  if ((pending_ == 0 && snapshot_shown_) || (pending_ > 0 && now - snapshot_at_ >= std::chrono::milliseconds(500))) {
    std::string text = pending_ == 0 ? std::string() : describe_pending();
    snapshot_at_ = now;
    snapshot_shown_ = !text.empty();
    std::lock_guard<std::mutex> lock(snapshot_->mu);
    snapshot_->text.swap(text);
  }
  return handled;
}

size_t TrainerLink::pending() const { return pending_; }

std::function<std::string()> TrainerLink::pending_source() const {
  return [snapshot = snapshot_] {
    std::lock_guard<std::mutex> lock(snapshot->mu);
    return snapshot->text;
  };
}

std::string TrainerLink::describe_pending() const {
  std::string out;
  const auto now = clock_.now();
  for (const auto& [rank, calls] : calls_) {
    if (calls.empty()) continue;
    const double waited = std::chrono::duration<double>(now - calls.front().sent).count();
    out += fmt::format("{}{} {} ({:.1f} s{})", out.empty() ? "" : ", ", describe_(rank), calls.front().what, waited,
                       calls.size() > 1 ? fmt::format(", {} more queued", calls.size() - 1) : "");
  }
  return out;
}

size_t TrainerLink::pending(int rank) const {
  auto it = calls_.find(rank);
  return it == calls_.end() ? 0 : it->second.size();
}

void TrainerLink::drain(const std::vector<int>& ranks, const std::function<void()>& idle) {
  for (;;) {
    const bool done = std::all_of(ranks.begin(), ranks.end(), [&](int r) { return pending(r) == 0; });
    if (done) return;
    if (poll() == 0) idle();
  }
}

}  // namespace tiller::wire
