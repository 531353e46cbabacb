#include "rollout/protocol.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/zero/sequence_parallel.h"

namespace tiller::rollout {
namespace {

// --- the wire ---

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

at::Tensor make_header(const Frame& f) {
  TILLER_CHECK(f.tensors.size() <= kMaxTensors && f.scalars.size() <= kMaxScalars,
               "protocol: a frame carries at most {} tensors and {} scalars", kMaxTensors, kMaxScalars);
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  int64_t* p = h.data_ptr<int64_t>();
  p[0] = kMagic;
  p[1] = static_cast<int64_t>(f.op);
  p[2] = static_cast<int64_t>(f.tensors.size());
  p[3] = static_cast<int64_t>(f.scalars.size());
  p[4] = static_cast<int64_t>(f.text.size());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    p[kTensorBase + 2 * i] = dtype_code(f.tensors[i].scalar_type());
    p[kTensorBase + 2 * i + 1] = f.tensors[i].numel();
  }
  std::memcpy(p + kScalarBase, f.scalars.data(), f.scalars.size() * sizeof(double));
  return h;
}

// Reads the header into `f` and allocates the payload it announces.
void parse_header(const at::Tensor& h, Frame& f, int peer) {
  const int64_t* p = h.data_ptr<int64_t>();
  if (p[0] != kMagic || p[2] < 0 || p[2] > kMaxTensors || p[3] < 0 || p[3] > kMaxScalars || p[4] < 0)
    throw CommError(fmt::format("protocol: a malformed message header from rank {}", peer));
  f.op = static_cast<Op>(p[1]);
  f.tensors.clear();
  for (int64_t i = 0; i < p[2]; ++i) {
    const int64_t numel = p[kTensorBase + 2 * i + 1];
    if (numel < 0) throw CommError(fmt::format("protocol: a negative tensor size in a header from rank {}", peer));
    f.tensors.push_back(at::empty({numel}, dtype_of(p[kTensorBase + 2 * i])));
  }
  f.scalars.assign(static_cast<size_t>(p[3]), 0.0);
  std::memcpy(f.scalars.data(), p + kScalarBase, f.scalars.size() * sizeof(double));
  f.text.assign(static_cast<size_t>(p[4]), '\0');
}

std::vector<dist::WorkPtr> post_payload(dist::Communicator& comm, int peer, Frame& f, at::Tensor& text_buf) {
  std::vector<dist::WorkPtr> works;
  for (auto& t : f.tensors)
    if (t.numel() > 0) works.push_back(comm.recv(t, peer));
  if (!f.text.empty()) {
    text_buf = at::empty({static_cast<int64_t>(f.text.size())}, at::kByte);
    works.push_back(comm.recv(text_buf, peer));
  }
  return works;
}

void finish_text(Frame& f, const at::Tensor& text_buf) {
  if (!f.text.empty()) std::memcpy(f.text.data(), text_buf.data_ptr<uint8_t>(), f.text.size());
}

// --- message helpers ---

[[noreturn]] void malformed(Op op, const std::string& why) {
  throw CommError(fmt::format("protocol: a malformed '{}' message: {}", op_name(op), why));
}

// Checks the frame's op and counts; an error reply becomes the error it carries.
void expect(const Frame& f, Op op, size_t tensors, size_t scalars) {
  if (f.op == Op::kError && op != Op::kError) throw Error(f.text);
  if (f.op != op)
    throw CommError(fmt::format("protocol: expected a '{}' message, got '{}'", op_name(op), op_name(f.op)));
  if (f.tensors.size() != tensors || f.scalars.size() != scalars)
    malformed(op, fmt::format("{} tensors and {} scalars, expected {} and {}", f.tensors.size(), f.scalars.size(),
                              tensors, scalars));
}

at::Tensor host(const at::Tensor& t, at::ScalarType dtype) {
  TILLER_CHECK(t.defined(), "protocol: an undefined tensor cannot travel");
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(at::kCPU, dtype).contiguous();
}

// Tensor i of `f`, of `dtype` and `numel` elements (-1: any).
const at::Tensor& tensor(const Frame& f, size_t i, at::ScalarType dtype, int64_t numel, const char* what) {
  const at::Tensor& t = f.tensors.at(i);
  if (t.scalar_type() != dtype) malformed(f.op, fmt::format("{} is {}, expected {}", what, c10::toString(t.scalar_type()),
                                                            c10::toString(dtype)));
  if (numel >= 0 && t.numel() != numel)
    malformed(f.op, fmt::format("{} has {} elements, expected {}", what, t.numel(), numel));
  return t;
}

void encode_batch(const PackedSequences& b, Frame& f) {
  f.tensors.push_back(host(b.tokens, at::kLong));
  f.tensors.push_back(host(b.seq_lens, at::kLong));
  f.tensors.push_back(host(b.prompt_lens, at::kLong));
  f.tensors.push_back(at::tensor(std::vector<int64_t>{b.first_row, b.next_token}, at::kLong));
}

// The first four tensors of `f`, checked: lengths add up, prompts inside their sequences, the
// held rows inside the row.
PackedSequences decode_batch(const Frame& f) {
  PackedSequences b;
  b.seq_lens = tensor(f, 1, at::kLong, -1, "seq_lens");
  b.prompt_lens = tensor(f, 2, at::kLong, b.seq_lens.numel(), "prompt_lens");
  const int64_t* sl = b.seq_lens.data_ptr<int64_t>();
  const int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < b.seq_lens.numel(); ++i) {
    if (pl[i] < 1 || pl[i] >= sl[i])
      malformed(f.op, fmt::format("sample {}: prompt of {} tokens in a sequence of {}", i, pl[i], sl[i]));
    total += sl[i];
  }
  const at::Tensor& window = tensor(f, 3, at::kLong, 2, "slice window");
  b.first_row = window.data_ptr<int64_t>()[0];
  b.next_token = window.data_ptr<int64_t>()[1];
  b.tokens = tensor(f, 0, at::kLong, -1, "tokens");
  if (b.first_row < 0 || b.first_row > total || b.tokens.numel() > total - b.first_row)
    malformed(f.op, fmt::format("rows [{}, {}) of a packed row of {}", b.first_row, b.first_row + b.tokens.numel(),
                                total));
  return b;
}

// A message that is only a text (a directory, a token, an address), or nothing at all; `what`
// names the text when it must not be empty.
Frame text_frame(Op op, const std::string& text) {
  Frame f;
  f.op = op;
  f.text = text;
  return f;
}
std::string take_text(Frame& f, Op op, const char* what) {
  expect(f, op, 0, 0);
  if (what && f.text.empty()) malformed(op, fmt::format("no {}", what));
  return std::move(f.text);
}

// Float [n] tensor i, or undefined when `present` is false.
at::Tensor optional_floats(const Frame& f, size_t& i, bool present, int64_t n, const char* what) {
  if (!present) return {};
  return tensor(f, i++, at::kFloat, n, what);
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kScore: return "score";
    case Op::kTrainActor: return "train_actor";
    case Op::kTrainCritic: return "train_critic";
    case Op::kStep: return "step";
    case Op::kSync: return "sync";
    case Op::kSave: return "save";
    case Op::kLoad: return "load";
    case Op::kTrace: return "trace";
    case Op::kStop: return "stop";
    case Op::kEngineHello: return "engine_hello";
    case Op::kPhase: return "phase";
    case Op::kPhaseReply: return "phase_reply";
    case Op::kScoreReply: return "score_reply";
    case Op::kStepReply: return "step_reply";
    case Op::kSyncReply: return "sync_reply";
    case Op::kDone: return "done";
    case Op::kTraceReply: return "trace_reply";
    case Op::kStopReply: return "stop_reply";
    case Op::kEngineAddress: return "engine_address";
    case Op::kError: return "error";
  }
  return "?";
}

std::vector<dist::WorkPtr> send_frame(dist::Communicator& comm, int peer, const Frame& f) {
  std::vector<dist::WorkPtr> works;
  works.push_back(comm.send(make_header(f), peer));
  for (const auto& t : f.tensors) {
    TILLER_CHECK(t.device().is_cpu() && t.is_contiguous(), "protocol: frame tensors are contiguous, on the host");
    if (t.numel() > 0) works.push_back(comm.send(t, peer));
  }
  if (!f.text.empty()) {
    at::Tensor bytes = at::empty({static_cast<int64_t>(f.text.size())}, at::kByte);
    std::memcpy(bytes.data_ptr<uint8_t>(), f.text.data(), f.text.size());
    works.push_back(comm.send(bytes, peer));
  }
  return works;
}

Frame recv_frame(dist::Communicator& comm, int peer, Deadline deadline) {
  at::Tensor h = at::empty({kHeaderLen}, at::kLong);
  comm.recv(h, peer)->wait(deadline);
  Frame f;
  parse_header(h, f, peer);
  at::Tensor text_buf;
  for (auto& w : post_payload(comm, peer, f, text_buf)) w->wait(deadline);
  finish_text(f, text_buf);
  return f;
}

IncomingFrame::IncomingFrame(dist::Communicator& comm, int peer) : comm_(&comm), peer_(peer) {
  header_ = at::empty({kHeaderLen}, at::kLong);
  header_work_ = comm.recv(header_, peer);
}

bool IncomingFrame::poll() {
  if (!payload_posted_) {
    if (!header_work_->is_completed()) return false;
    parse_header(header_, frame_, peer_);
    at::Tensor text_buf;
    payload_ = post_payload(*comm_, peer_, frame_, text_buf);
    if (!frame_.text.empty()) frame_.tensors.push_back(text_buf);  // parked here until take()
    payload_posted_ = true;
  }
  for (auto& w : payload_)
    if (!w->is_completed()) return false;
  return true;
}

Frame IncomingFrame::take() {
  if (!frame_.text.empty()) {
    finish_text(frame_, frame_.tensors.back());
    frame_.tensors.pop_back();
  }
  return std::move(frame_);
}

// --- messages ---

namespace {

// Calls f(response_begin, response_end, last_row) for each sequence of `b`, in rows of the whole
// packed row.
template <typename F>
void for_each_sequence(const PackedSequences& b, F&& f) {
  if (!b.seq_lens.defined()) return;
  const int64_t* sl = b.seq_lens.data_ptr<int64_t>();
  const int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
  int64_t off = 0;
  for (int64_t i = 0; i < b.seq_lens.numel(); ++i) {
    f(off + pl[i] - 1, off + sl[i] - 1, off + sl[i] - 1);
    off += sl[i];
  }
}

int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0)); }

}  // namespace

int64_t PackedSequences::rows() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n = last + 1; });
  return n;
}

int64_t PackedSequences::response_tokens() const {
  int64_t n = 0;
  const int64_t a = first_row, b = first_row + held();
  for_each_sequence(*this, [&](int64_t r0, int64_t r1, int64_t) { n += overlap(r0, r1, a, b); });
  return n;
}

int64_t PackedSequences::response_before() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t r0, int64_t r1, int64_t) { n += overlap(r0, r1, 0, first_row); });
  return n;
}

int64_t PackedSequences::ends() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n += last >= first_row && last < first_row + held(); });
  return n;
}

int64_t PackedSequences::ends_before() const {
  int64_t n = 0;
  for_each_sequence(*this, [&](int64_t, int64_t, int64_t last) { n += last < first_row; });
  return n;
}

std::vector<PackedSequences> PackedSequences::cut(int parts) const {
  TILLER_CHECK(whole(), "cutting a packed row that is itself a slice");
  if (parts == 1) return {*this};
  const zero::SequenceSplit split{rows(), parts};
  std::vector<PackedSequences> out;
  for (int j = 0; j < parts; ++j) {
    PackedSequences s;
    s.seq_lens = seq_lens;
    s.prompt_lens = prompt_lens;
    s.first_row = split.begin(j);
    const int64_t end = s.first_row + split.size(j);
    s.tokens = tokens.narrow(0, s.first_row, split.size(j));
    s.next_token = end < split.rows ? tokens.data_ptr<int64_t>()[end] : 0;
    out.push_back(std::move(s));
  }
  return out;
}

Frame ScoreRequest::encode() const {
  Frame f;
  f.op = Op::kScore;
  encode_batch(batch, f);
  f.scalars = {temperature};
  return f;
}

ScoreRequest ScoreRequest::decode(Frame f) {
  expect(f, Op::kScore, 4, 1);
  ScoreRequest r;
  r.batch = decode_batch(f);
  r.temperature = f.scalars[0];
  if (!(r.temperature > 0)) malformed(f.op, fmt::format("temperature {}", r.temperature));
  return r;
}

Frame ScoreReply::encode() const {
  Frame f;
  f.op = Op::kScoreReply;
  f.scalars.push_back(static_cast<double>(roles.bits()));
  f.scalars.insert(f.scalars.end(), seconds.begin(), seconds.end());
  f.scalars.insert(f.scalars.end(), bench.begin(), bench.end());
  if (roles.has(Role::kActor)) {
    f.tensors.push_back(host(actor_logp, at::kFloat));
    f.tensors.push_back(host(actor_entropy, at::kFloat));
  }
  if (roles.has(Role::kCritic)) f.tensors.push_back(host(critic_values, at::kFloat));
  if (roles.has(Role::kRef)) f.tensors.push_back(host(ref_logp, at::kFloat));
  if (roles.has(Role::kReward)) f.tensors.push_back(host(reward_scores, at::kFloat));
  return f;
}

ScoreReply ScoreReply::decode(Frame f, const PackedSequences& request) {
  if (f.op == Op::kError) throw Error(f.text);
  if (f.scalars.empty()) malformed(Op::kScoreReply, "no role set");
  ScoreReply r;
  r.roles = RoleSet::from_bits(static_cast<unsigned>(f.scalars[0]));
  const size_t n = (r.roles.has(Role::kActor) ? 2 : 0) + (r.roles.has(Role::kCritic) ? 1 : 0) +
                   (r.roles.has(Role::kRef) ? 1 : 0) + (r.roles.has(Role::kReward) ? 1 : 0);
  expect(f, Op::kScoreReply, n, 1 + 2 * kRoleCount);
  for (size_t i = 0; i < static_cast<size_t>(kRoleCount); ++i) {
    r.seconds[i] = f.scalars[1 + i];
    r.bench[i] = f.scalars[1 + kRoleCount + i];
  }
  const int64_t tokens = request.response_tokens(), samples = request.ends();
  size_t i = 0;
  r.actor_logp = optional_floats(f, i, r.roles.has(Role::kActor), tokens, "actor log-probs");
  r.actor_entropy = optional_floats(f, i, r.roles.has(Role::kActor), tokens, "actor entropy");
  r.critic_values = optional_floats(f, i, r.roles.has(Role::kCritic), tokens, "critic values");
  r.ref_logp = optional_floats(f, i, r.roles.has(Role::kRef), tokens, "reference log-probs");
  r.reward_scores = optional_floats(f, i, r.roles.has(Role::kReward), samples, "reward scores");
  return r;
}

Frame TrainActorRequest::encode() const {
  Frame f;
  f.op = Op::kTrainActor;
  encode_batch(batch, f);
  f.tensors.push_back(host(old_logp, at::kFloat));
  f.tensors.push_back(host(advantages, at::kFloat));
  if (ref_logp.defined()) f.tensors.push_back(host(ref_logp, at::kFloat));
  if (is_weights.defined()) f.tensors.push_back(host(is_weights, at::kFloat));
  if (loss_mask.defined()) f.tensors.push_back(host(loss_mask, at::kByte));
  f.scalars = {normalizer, kl_coef, ref_logp.defined() ? 1.0 : 0.0, is_weights.defined() ? 1.0 : 0.0,
               loss_mask.defined() ? 1.0 : 0.0};
  return f;
}

TrainActorRequest TrainActorRequest::decode(Frame f) {
  if (f.scalars.size() != 5) malformed(Op::kTrainActor, fmt::format("{} scalars, expected 5", f.scalars.size()));
  const bool ref = f.scalars[2] != 0, weights = f.scalars[3] != 0, mask = f.scalars[4] != 0;
  expect(f, Op::kTrainActor, 6 + (ref ? 1 : 0) + (weights ? 1 : 0) + (mask ? 1 : 0), 5);
  TrainActorRequest r;
  r.batch = decode_batch(f);
  const int64_t n = r.batch.response_tokens();
  size_t i = 4;
  r.old_logp = tensor(f, i++, at::kFloat, n, "old log-probs");
  r.advantages = tensor(f, i++, at::kFloat, n, "advantages");
  r.ref_logp = optional_floats(f, i, ref, n, "reference log-probs");
  r.is_weights = optional_floats(f, i, weights, n, "importance weights");
  if (mask) r.loss_mask = tensor(f, i++, at::kByte, n, "loss mask");
  r.normalizer = f.scalars[0];
  r.kl_coef = f.scalars[1];
  if (!(r.normalizer > 0)) malformed(f.op, fmt::format("normalizer {}", r.normalizer));
  return r;
}

Frame TrainCriticRequest::encode() const {
  Frame f;
  f.op = Op::kTrainCritic;
  encode_batch(batch, f);
  f.tensors.push_back(host(old_values, at::kFloat));
  f.tensors.push_back(host(returns, at::kFloat));
  if (loss_mask.defined()) f.tensors.push_back(host(loss_mask, at::kByte));
  f.scalars = {normalizer, loss_mask.defined() ? 1.0 : 0.0};
  return f;
}

TrainCriticRequest TrainCriticRequest::decode(Frame f) {
  if (f.scalars.size() != 2) malformed(Op::kTrainCritic, fmt::format("{} scalars, expected 2", f.scalars.size()));
  const bool mask = f.scalars[1] != 0;
  expect(f, Op::kTrainCritic, 6 + (mask ? 1 : 0), 2);
  TrainCriticRequest r;
  r.batch = decode_batch(f);
  const int64_t n = r.batch.response_tokens();
  r.old_values = tensor(f, 4, at::kFloat, n, "old values");
  r.returns = tensor(f, 5, at::kFloat, n, "returns");
  if (mask) r.loss_mask = tensor(f, 6, at::kByte, n, "loss mask");
  r.normalizer = f.scalars[0];
  if (!(r.normalizer > 0)) malformed(f.op, fmt::format("normalizer {}", r.normalizer));
  return r;
}

Frame StepRequest::encode() const {
  Frame f;
  f.op = Op::kStep;
  f.scalars = {static_cast<double>(role_index(role)), lr};
  return f;
}

StepRequest StepRequest::decode(Frame f) {
  expect(f, Op::kStep, 0, 2);
  const auto index = static_cast<int>(f.scalars[0]);
  if (index < 0 || index >= kRoleCount || !role_trains(static_cast<Role>(index)))
    malformed(f.op, fmt::format("role index {} does not train", f.scalars[0]));
  return {static_cast<Role>(index), f.scalars[1]};
}

Frame StepReply::encode() const {
  Frame f;
  f.op = Op::kStepReply;
  const StepStats& s = stats;
  f.scalars = {s.grad_norm,   s.skipped ? 1.0 : 0.0, s.loss,          s.clip_tokens,  s.approx_kl_tokens,
               s.entropy_sum, s.tokens,              s.train_seconds, s.step_seconds, s.peak_host_mb,
               s.bench_tokens_per_s};
  // The loss's metrics: their values after the fixed scalars, their names one per line.
  for (const auto& [name, value] : s.loss_metrics) {
    f.scalars.push_back(value);
    f.text += name + "\n";
  }
  return f;
}

StepReply StepReply::decode(Frame f) {
  if (f.op != Op::kStepReply) expect(f, Op::kStepReply, 0, 11);  // an error reply, or another message
  std::vector<std::string> names;
  for (size_t b = 0; b < f.text.size();) {
    const size_t e = f.text.find('\n', b);
    if (e == std::string::npos) malformed(Op::kStepReply, "a metric name without its end of line");
    names.push_back(f.text.substr(b, e - b));
    b = e + 1;
    if (names.size() > 16) malformed(Op::kStepReply, "more than 16 loss metrics");  // losses.cpp's bound
  }
  expect(f, Op::kStepReply, 0, 11 + names.size());
  const auto& v = f.scalars;
  StepReply r;
  r.stats = {v[0], v[1] != 0, v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10]};
  for (size_t i = 0; i < names.size(); ++i) r.stats.loss_metrics.emplace_back(names[i], v[11 + i]);
  return r;
}

Frame SyncRequest::encode() const {
  Frame f;
  f.op = Op::kSync;
  f.scalars = {static_cast<double>(version)};
  return f;
}

SyncRequest SyncRequest::decode(Frame f) {
  expect(f, Op::kSync, 0, 1);
  if (f.scalars[0] < 1) malformed(f.op, fmt::format("weight version {}", f.scalars[0]));
  return {static_cast<uint64_t>(f.scalars[0])};
}

Frame SyncReply::encode() const {
  Frame f;
  f.op = Op::kSyncReply;
  f.scalars = {seconds, wire_bytes};
  return f;
}

SyncReply SyncReply::decode(Frame f) {
  expect(f, Op::kSyncReply, 0, 2);
  return {f.scalars[0], f.scalars[1]};
}

Frame SaveRequest::encode() const { return text_frame(Op::kSave, dir); }

SaveRequest SaveRequest::decode(Frame f) { return {take_text(f, Op::kSave, "directory")}; }

Frame LoadRequest::encode() const { return text_frame(Op::kLoad, dir); }

LoadRequest LoadRequest::decode(Frame f) { return {take_text(f, Op::kLoad, "directory")}; }

Frame DoneReply::encode() const { return text_frame(Op::kDone, ""); }

DoneReply DoneReply::decode(Frame f) {
  take_text(f, Op::kDone, nullptr);
  return {};
}

Frame TraceRequest::encode() const { return text_frame(Op::kTrace, ""); }

TraceRequest TraceRequest::decode(Frame f) {
  take_text(f, Op::kTrace, nullptr);
  return {};
}

Frame TraceReply::encode() const {
  TILLER_CHECK(begin_us.size() == names.size() && end_us.size() == names.size(), "trace reply: {} names, {} spans",
               names.size(), begin_us.size());
  Frame f;
  f.op = Op::kTraceReply;
  for (const auto& n : names) {
    TILLER_CHECK(n.find('\n') == std::string::npos, "trace reply: a span name with a newline");
    f.text += n + "\n";
  }
  at::Tensor t = at::empty({static_cast<int64_t>(2 * names.size())}, at::kDouble);
  double* p = t.data_ptr<double>();
  for (size_t i = 0; i < names.size(); ++i) {
    p[2 * i] = begin_us[i];
    p[2 * i + 1] = end_us[i];
  }
  f.tensors.push_back(t);
  return f;
}

TraceReply TraceReply::decode(Frame f) {
  expect(f, Op::kTraceReply, 1, 0);
  TraceReply r;
  size_t pos = 0;
  while (pos < f.text.size()) {
    const size_t nl = f.text.find('\n', pos);
    if (nl == std::string::npos) malformed(f.op, "a span name without its newline");
    r.names.push_back(f.text.substr(pos, nl - pos));
    pos = nl + 1;
  }
  const at::Tensor& t = tensor(f, 0, at::kDouble, static_cast<int64_t>(2 * r.names.size()), "span times");
  const double* p = t.data_ptr<double>();
  for (size_t i = 0; i < r.names.size(); ++i) {
    r.begin_us.push_back(p[2 * i]);
    r.end_us.push_back(p[2 * i + 1]);
  }
  return r;
}

Frame StopRequest::encode() const { return text_frame(Op::kStop, ""); }

StopRequest StopRequest::decode(Frame f) {
  take_text(f, Op::kStop, nullptr);
  return {};
}

Frame StopReply::encode() const {
  Frame f;
  f.op = Op::kStopReply;
  f.scalars = {peak_host_mb};
  return f;
}

StopReply StopReply::decode(Frame f) {
  expect(f, Op::kStopReply, 0, 1);
  return {f.scalars[0]};
}

Frame PhaseRequest::encode() const {
  Frame f;
  f.op = Op::kPhase;
  f.scalars = {offload ? 1.0 : 0.0};
  return f;
}

PhaseRequest PhaseRequest::decode(Frame f) {
  expect(f, Op::kPhase, 0, 1);
  if (f.scalars[0] != 0 && f.scalars[0] != 1) malformed(f.op, fmt::format("offload flag {}", f.scalars[0]));
  return {f.scalars[0] != 0};
}

Frame PhaseReply::encode() const {
  Frame f;
  f.op = Op::kPhaseReply;
  f.scalars = {moved_bytes, allocated, reserved, peak_allocated};
  return f;
}

PhaseReply PhaseReply::decode(Frame f) {
  expect(f, Op::kPhaseReply, 0, 4);
  return {f.scalars[0], f.scalars[1], f.scalars[2], f.scalars[3]};
}

Frame EngineHello::encode() const { return text_frame(Op::kEngineHello, token); }

EngineHello EngineHello::decode(Frame f) { return {take_text(f, Op::kEngineHello, nullptr)}; }

Frame EngineAddress::encode() const { return text_frame(Op::kEngineAddress, address); }

EngineAddress EngineAddress::decode(Frame f) { return {take_text(f, Op::kEngineAddress, "address")}; }

Frame ErrorReply::encode() const {
  Frame f;
  f.op = Op::kError;
  f.text = what.empty() ? std::string("unknown error") : what;
  return f;
}

ErrorReply ErrorReply::decode(Frame f) {
  expect(f, Op::kError, 0, 0);
  return {std::move(f.text)};
}

}  // namespace tiller::rollout
