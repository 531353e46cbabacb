// The controller <-> trainer-rank messages of `tiller train` (private to src/rollout).
//
// They travel over the world communicator (MPI, CPU tensors): a fixed-size int64 header that says
// what follows (the op, the tensors' dtypes and sizes, a few doubles, the length of a text), then
// one message per tensor and one for the text. send/recv pair up in order per (sender, receiver)
// (communicator.h), so a message is read back exactly as it was written.
//
// Threading: one thread per communicator (the controller's loop, or the trainer rank's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/deadline.h"
#include "tiller/dist/communicator.h"

namespace tiller::rollout {

enum class Op : int64_t {
  kScore = 1,     // packed sequences -> log-probs / ref log-probs / values / scores of this rank's roles
  kTrainActor,    // one training micro-batch of the actor (forward, loss, backward)
  kTrainCritic,   // one training micro-batch of the critic
  kStepActor,     // optimizer step of the actor -> its statistics
  kStepCritic,
  kSync,          // actor ranks: send the weights to the engines (the controller drives Begin/End)
  kSave,          // save this rank's roles under the text (a directory)
  kLoad,          // load this rank's roles from the text
  kTrace,         // this rank's phase spans since the last kTrace -> text + times
  kStop,          // leave the serve loop
  kReply = 100,   // a trainer rank's answer
};
const char* op_name(Op op);

struct Message {
  Op op = Op::kReply;
  std::vector<double> scalars;
  std::vector<at::Tensor> tensors;  // CPU, contiguous: int64, float32, float64 or uint8
  std::string text;
};

// Posts the message to `peer`; the returned works complete when it has left (wait on them, or
// keep them until the peer answers: the tensors stay alive inside them).
std::vector<dist::WorkPtr> send_message(dist::Communicator& comm, int peer, const Message& m);

// Receives the next message from `peer`, waiting until `deadline`. TimeoutError says who was silent.
Message recv_message(dist::Communicator& comm, int peer, Deadline deadline);

// A message being received without blocking: start() posts the header's receive; poll() posts
// the payload once the header is in and returns true when everything has arrived. At most one per
// peer at a time (later messages from the same peer queue behind it in order).
class IncomingMessage {
 public:
  IncomingMessage(dist::Communicator& comm, int peer);
  bool poll();
  Message take();  // after poll() returned true
  int peer() const { return peer_; }

 private:
  dist::Communicator* comm_;
  int peer_;
  at::Tensor header_;
  dist::WorkPtr header_work_;
  std::vector<dist::WorkPtr> payload_;
  Message msg_;
  bool payload_posted_ = false;
};

}  // namespace tiller::rollout
