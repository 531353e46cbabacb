// How the controller reaches the other ranks of `tiller train` (private to src/wire).
//
// A Channel moves frames (messages.h) between the controller and one rank at a time, in order
// per rank: MpiChannel over the world communicator (the real job), LocalChannel to endpoint
// objects in the same process (the controller's unit tests and `tiller bench controller`).
//
// TrainerLink sits on a Channel and matches each rank's replies to the requests that asked for
// them: a rank answers its requests in the order it got them, so the k-th reply from rank r
// answers the k-th call to r. Every call has a deadline; a rank that answers with an ErrorReply
// or misses its deadline ends the job with a line naming the rank and the call.
//
// Threading: a Channel and its TrainerLink belong to the controller's thread. LocalChannel's
// endpoints may run on worker threads of its own (each rank's frames still in order).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tiller/core/clock.h"
#include "tiller/core/deadline.h"
#include "wire/messages.h"

namespace tiller::wire {

class Channel {
 public:
  virtual ~Channel() = default;
  // Posts `f` to `rank` and returns at once; the frame's tensors stay alive until it has left.
  virtual void send(int rank, Frame f) = 0;
  // The next frame from `rank`, if one has fully arrived.
  virtual bool poll(int rank, Frame& out) = 0;
  // Waits until every posted frame has left; TimeoutError past the deadline.
  virtual void flush(Deadline deadline) = 0;
};

class MpiChannel final : public Channel {
 public:
  explicit MpiChannel(dist::Communicator& world);
  ~MpiChannel() override;
  void send(int rank, Frame f) override;
  bool poll(int rank, Frame& out) override;
  void flush(Deadline deadline) override;

 private:
  void reap();  // forgets sends that have completed
  dist::Communicator& world_;
  std::vector<std::unique_ptr<IncomingFrame>> incoming_;  // per rank, while a frame is expected
  std::deque<dist::WorkPtr> sending_;
};

// One rank's side of a LocalChannel.
class RankEndpoint {
 public:
  virtual ~RankEndpoint() = default;
  // Handles one frame from the controller and returns its replies (none for a training
  // micro-batch). An exception becomes an ErrorReply.
  virtual std::vector<Frame> handle(Frame f) = 0;
};

class LocalChannel final : public Channel {
 public:
  // endpoints[rank] answers rank's frames (null: nobody; sending to it is a bug). threads = 0
  // handles each frame inside send(); threads > 0 runs the endpoints on that many worker threads
  // (rank r on thread r mod threads), so the controller's thread only moves frames.
  explicit LocalChannel(std::vector<RankEndpoint*> endpoints, int threads = 0);
  ~LocalChannel() override;
  void send(int rank, Frame f) override;
  bool poll(int rank, Frame& out) override;
  void flush(Deadline deadline) override;
  // Blocks until some rank has a reply ready or `ms` passed (for the controller's idle waits).
  void wait_for_reply(int ms);

 private:
  struct Worker {
    std::deque<std::pair<int, Frame>> inbox;
    std::thread thread;
  };
  void deliver(int rank, Frame f);
  void work(size_t w);

  std::vector<RankEndpoint*> endpoints_;
  std::mutex mu_;
  std::condition_variable cv_, replies_cv_;
  std::vector<std::deque<Frame>> replies_;  // per rank
  std::vector<std::unique_ptr<Worker>> workers_;
  int64_t queued_ = 0;  // frames sent and not yet handled
  bool stopping_ = false;
};

class TrainerLink {
 public:
  using OnReply = std::function<void(Frame&&)>;

  // describe(rank) names a rank in errors, e.g. "rank 3 (critic+reward)". The deadlines run on
  // `clock` (tests move a ManualClock).
  TrainerLink(Channel& channel, std::function<std::string(int)> describe, const Clock& clock = Clock::steady());

  // Sends a request that has no reply.
  void send(int rank, Frame request);
  // Sends a request whose reply goes to `on_reply` once it arrives (poll()). The rank has
  // `timeout_s` to answer, counted from when it could start on this request: the send, or its
  // answer to the call before, whichever is later. `what` names the call in errors.
  void call(int rank, Frame request, double timeout_s, std::string what, OnReply on_reply);
  // Hands every reply that has arrived to its handler; returns how many. An ErrorReply throws
  // Error ("rank 3 (actor+ref) failed during scoring: ..."); a call past its deadline throws
  // TimeoutError naming the rank and the call.
  int poll();
  size_t pending() const;
  size_t pending(int rank) const;
  // The calls waiting for an answer, oldest per rank: "rank 1 (actor) the scoring (12.3 s), ..."
  // ("" when none; the caller's thread only).
  std::string describe_pending() const;
  // describe_pending() as poll() last saw it (at most half a second old, "" once nothing is
  // pending), for the watchdog's line: callable from any thread, also once the link is gone (a
  // rank failing on its way out shows what it last waited for).
  std::function<std::string()> pending_source() const;
  // Polls until no call to any of `ranks` is pending, calling `idle` after each round that brought
  // nothing (other work of the caller, or a short sleep).
  void drain(const std::vector<int>& ranks, const std::function<void()>& idle);
  Channel& channel() { return channel_; }

 private:
  struct Call {
    std::string what;
    double timeout_s = 0;
    Clock::time_point sent;
    OnReply on_reply;
  };
  Channel& channel_;
  std::function<std::string(int)> describe_;
  const Clock& clock_;
  std::map<int, std::deque<Call>> calls_;      // per rank, oldest first
  std::map<int, Clock::time_point> answered_;  // per rank: its last reply
  size_t pending_ = 0;
  struct Snapshot {
    std::mutex mu;
    std::string text;
  };
  std::shared_ptr<Snapshot> snapshot_ = std::make_shared<Snapshot>();
  Clock::time_point snapshot_at_{};
  bool snapshot_shown_ = false;  // snapshot_ is not empty (poll()'s thread)
};

}  // namespace tiller::wire
