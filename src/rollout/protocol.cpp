#include "rollout/protocol.h"

#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::rollout {
namespace {

// Header layout (int64): [magic, op, tensors, scalars, text bytes, (dtype, numel) x kMaxTensors,
// scalars as raw doubles x kMaxScalars].
constexpr int64_t kMagic = 0x74696c6c6572;  // "tiller"
constexpr int kMaxTensors = 24;
constexpr int kMaxScalars = 64;
constexpr int kTensorBase = 5;
constexpr int kScalarBase = kTensorBase + 2 * kMaxTensors;
constexpr int kHeaderLen = kScalarBase + kMaxScalars;

int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kLong: return 1;
    case at::kFloat: return 2;
    case at::kDouble: return 3;
    case at::kByte: return 4;
    default: TILLER_CHECK(false, "protocol: tensors of dtype {} cannot travel", c10::toString(t));
  }
  return 0;
}

at::ScalarType dtype_of(int64_t code) {
  switch (code) {
    case 1: return at::kLong;
    case 2: return at::kFloat;
    case 3: return at::kDouble;
    case 4: return at::kByte;
    default: throw CommError(fmt::format("protocol: unknown dtype code {} in a message header", code));
  }
}

at::Tensor make_header(const Message& m) {
  TILLER_CHECK(m.tensors.size() <= kMaxTensors && m.scalars.size() <= kMaxScalars,
               "protocol: a message carries at most {} tensors and {} scalars", kMaxTensors, kMaxScalars);
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  int64_t* p = h.data_ptr<int64_t>();
  p[0] = kMagic;
  p[1] = static_cast<int64_t>(m.op);
  p[2] = static_cast<int64_t>(m.tensors.size());
  p[3] = static_cast<int64_t>(m.scalars.size());
  p[4] = static_cast<int64_t>(m.text.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    p[kTensorBase + 2 * i] = dtype_code(m.tensors[i].scalar_type());
    p[kTensorBase + 2 * i + 1] = m.tensors[i].numel();
  }
  std::memcpy(p + kScalarBase, m.scalars.data(), m.scalars.size() * sizeof(double));
  return h;
}

// Reads the header into `m` and allocates the payload it announces.
void parse_header(const at::Tensor& h, Message& m, int peer) {
  const int64_t* p = h.data_ptr<int64_t>();
  if (p[0] != kMagic || p[2] < 0 || p[2] > kMaxTensors || p[3] < 0 || p[3] > kMaxScalars || p[4] < 0)
    throw CommError(fmt::format("protocol: a malformed message header from rank {}", peer));
  m.op = static_cast<Op>(p[1]);
  m.tensors.clear();
  for (int64_t i = 0; i < p[2]; ++i)
    m.tensors.push_back(at::empty({p[kTensorBase + 2 * i + 1]}, dtype_of(p[kTensorBase + 2 * i])));
  m.scalars.assign(static_cast<size_t>(p[3]), 0.0);
  std::memcpy(m.scalars.data(), p + kScalarBase, m.scalars.size() * sizeof(double));
  m.text.assign(static_cast<size_t>(p[4]), '\0');
}

std::vector<dist::WorkPtr> post_payload(dist::Communicator& comm, int peer, Message& m, at::Tensor& text_buf) {
  std::vector<dist::WorkPtr> works;
  for (auto& t : m.tensors)
    if (t.numel() > 0) works.push_back(comm.recv(t, peer));
  if (!m.text.empty()) {
    text_buf = at::empty({static_cast<int64_t>(m.text.size())}, at::kByte);
    works.push_back(comm.recv(text_buf, peer));
  }
  return works;
}

void finish_text(Message& m, const at::Tensor& text_buf) {
  if (!m.text.empty()) std::memcpy(m.text.data(), text_buf.data_ptr<uint8_t>(), m.text.size());
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kScore: return "score";
    case Op::kTrainActor: return "train_actor";
    case Op::kTrainCritic: return "train_critic";
    case Op::kStepActor: return "step_actor";
    case Op::kStepCritic: return "step_critic";
    case Op::kSync: return "sync";
    case Op::kSave: return "save";
    case Op::kLoad: return "load";
    case Op::kTrace: return "trace";
    case Op::kStop: return "stop";
    case Op::kReply: return "reply";
  }
  return "?";
}

std::vector<dist::WorkPtr> send_message(dist::Communicator& comm, int peer, const Message& m) {
  std::vector<dist::WorkPtr> works;
  works.push_back(comm.send(make_header(m), peer));
  for (const auto& t : m.tensors) {
    TILLER_CHECK(!t.defined() || t.device().is_cpu(), "protocol: message tensors live on the host");
    if (t.numel() > 0) works.push_back(comm.send(t.contiguous(), peer));
  }
  if (!m.text.empty()) {
    at::Tensor bytes = at::empty({static_cast<int64_t>(m.text.size())}, at::kByte);
    std::memcpy(bytes.data_ptr<uint8_t>(), m.text.data(), m.text.size());
    works.push_back(comm.send(bytes, peer));
  }
  return works;
}

Message recv_message(dist::Communicator& comm, int peer, Deadline deadline) {
  at::Tensor h = at::empty({kHeaderLen}, at::kLong);
  comm.recv(h, peer)->wait(deadline);
  Message m;
  parse_header(h, m, peer);
  at::Tensor text_buf;
  for (auto& w : post_payload(comm, peer, m, text_buf)) w->wait(deadline);
  finish_text(m, text_buf);
  return m;
}

IncomingMessage::IncomingMessage(dist::Communicator& comm, int peer) : comm_(&comm), peer_(peer) {
  header_ = at::empty({kHeaderLen}, at::kLong);
  header_work_ = comm.recv(header_, peer);
}

bool IncomingMessage::poll() {
  if (!payload_posted_) {
    if (!header_work_->is_completed()) return false;
    parse_header(header_, msg_, peer_);
    at::Tensor text_buf;
    payload_ = post_payload(*comm_, peer_, msg_, text_buf);
    if (!msg_.text.empty()) msg_.tensors.push_back(text_buf);  // parked here until take()
    payload_posted_ = true;
  }
  for (auto& w : payload_)
    if (!w->is_completed()) return false;
  return true;
}

Message IncomingMessage::take() {
  if (!msg_.text.empty()) {
    finish_text(msg_, msg_.tensors.back());
    msg_.tensors.pop_back();
  }
  return std::move(msg_);
}

}  // namespace tiller::rollout
