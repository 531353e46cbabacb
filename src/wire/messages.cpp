#include "wire/messages.h"

#include <cstring>
#include <type_traits>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "tiller/core/error.h"

namespace tiller::wire {
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

// --- messages: one encoder and one decoder over the field lists (messages.h) ---

namespace {

// Sparse layers x experts per token of one row (routing replay): far above any model's.
constexpr int64_t kMaxRouteWidth = 1 << 16;

[[noreturn]] void malformed(Op op, const std::string& why) {
  throw CommError(fmt::format("protocol: a malformed '{}' message: {}", op_name(op), why));
}

at::Tensor host(const at::Tensor& t, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(at::kCPU, dtype).contiguous();
}

class Encoder {
 public:
  explicit Encoder(Op op) { f_.op = op; }
  void batch(const PackedSequences& b) {
    for (const at::Tensor* t : {&b.tokens, &b.seq_lens, &b.prompt_lens}) tensor(*t, "batch", at::kLong, Rows::kAny);
    f_.tensors.push_back(at::tensor(std::vector<int64_t>{b.first_row, b.next_token}, at::kLong));
    // Routing replay: the width, then the int16 routes as their bytes.
    const int64_t width = b.routes.defined() ? b.routes.size(1) : 0;
    f_.scalars.push_back(static_cast<double>(width));
    if (width > 0) {
      TILLER_CHECK(b.routes.dim() == 2 && b.routes.size(0) == b.tokens.numel() && b.routes.scalar_type() == at::kShort,
                   "protocol: routes for {} rows of a batch holding {}", b.routes.size(0), b.tokens.numel());
      f_.tensors.push_back(b.routes.to(at::kCPU).contiguous().view(at::kByte).reshape({-1}));
    }
  }
  void tensor(const at::Tensor& t, const char* what, at::ScalarType dtype, Rows) {
    TILLER_CHECK(t.defined(), "protocol: a '{}' message without its {}", op_name(f_.op), what);
    f_.tensors.push_back(host(t, dtype));
  }
  void optional(const at::Tensor& t, const char* what, at::ScalarType dtype, Rows rows) {
    f_.scalars.push_back(t.defined() ? 1.0 : 0.0);
    if (t.defined()) tensor(t, what, dtype, rows);
  }
  void num(double x, const char*) { f_.scalars.push_back(x); }
  void flag(bool b, const char*) { f_.scalars.push_back(b ? 1.0 : 0.0); }
  void version(uint64_t v, const char*) { f_.scalars.push_back(static_cast<double>(v)); }
  void role(Role r, const char*) { f_.scalars.push_back(static_cast<double>(role_index(r))); }
  void roles(RoleSet r, const char*) { f_.scalars.push_back(static_cast<double>(r.bits())); }
  void per_role(const std::array<double, kRoleCount>& a, const char*) {
    f_.scalars.insert(f_.scalars.end(), a.begin(), a.end());
  }
  void text(const std::string& s, const char*, bool) { f_.text = s; }
  void lines(const std::vector<std::string>& v, const char* what, size_t max) {
    TILLER_CHECK(v.size() <= max, "protocol: {} {} in a '{}' message (at most {})", v.size(), what, op_name(f_.op), max);
    for (const auto& n : v) {
      TILLER_CHECK(n.find('\n') == std::string::npos, "protocol: one of the {} has a newline: '{}'", what, n);
      f_.text += n + "\n";
    }
    lines_ = v.size();
  }
  void values(const std::vector<double>& v, const char* what) {
    TILLER_CHECK(v.size() == lines_, "protocol: {} {} for {} names", v.size(), what, lines_);
    f_.tensors.push_back(at::tensor(v, at::kDouble));
  }
  void named(const std::vector<std::pair<std::string, double>>& v, const char* what, size_t max) {
    std::vector<std::string> names;
    std::vector<double> vals;
    for (const auto& [n, x] : v) {
      names.push_back(n);
      vals.push_back(x);
    }
    lines(names, what, max);
    values(vals, what);
  }
  Frame take() { return std::move(f_); }

 private:
  Frame f_;
  size_t lines_ = 0;
};

class Decoder {
 public:
  // `sizes`: the batch that Rows counts in, when the message has none of its own.
  Decoder(const Frame& f, const PackedSequences* sizes) : f_(f), sizes_(sizes) {}

  // Four tensors, checked: lengths add up, prompts inside their sequences, the held rows inside
  // the row.
  void batch(PackedSequences& b) {
    const at::Tensor tokens = next_tensor("tokens", at::kLong, -1);
    b.seq_lens = next_tensor("seq_lens", at::kLong, -1);
    b.prompt_lens = next_tensor("prompt_lens", at::kLong, b.seq_lens.numel());
    const int64_t* sl = b.seq_lens.data_ptr<int64_t>();
    const int64_t* pl = b.prompt_lens.data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t i = 0; i < b.seq_lens.numel(); ++i) {
      if (pl[i] < 1 || pl[i] >= sl[i])
        malformed(f_.op, fmt::format("sample {}: prompt of {} tokens in a sequence of {}", i, pl[i], sl[i]));
      total += sl[i];
    }
    const at::Tensor window = next_tensor("slice window", at::kLong, 2);
    b.first_row = window.data_ptr<int64_t>()[0];
    b.next_token = window.data_ptr<int64_t>()[1];
    b.tokens = tokens;
    if (b.first_row < 0 || b.first_row > total || b.tokens.numel() > total - b.first_row)
      malformed(f_.op, fmt::format("rows [{}, {}) of a packed row of {}", b.first_row, b.first_row + b.tokens.numel(),
                                   total));
    const double width = next_scalar("routes' width");
    if (!(width >= 0 && width <= kMaxRouteWidth) || width != static_cast<double>(static_cast<int64_t>(width)))
      malformed(f_.op, fmt::format("routes of width {} (0 to {})", width, kMaxRouteWidth));
    b.routes = at::Tensor();
    if (width > 0) {
      const auto w = static_cast<int64_t>(width);
      b.routes = next_tensor("routes", at::kByte, b.tokens.numel() * w * 2).view(at::kShort).view({-1, w});
    }
    sizes_ = &b;
  }
  void tensor(at::Tensor& t, const char* what, at::ScalarType dtype, Rows rows) {
    t = next_tensor(what, dtype, count(rows, what));
  }
  void optional(at::Tensor& t, const char* what, at::ScalarType dtype, Rows rows) {
    bool present = false;
    flag(present, what);
    t = present ? next_tensor(what, dtype, count(rows, what)) : at::Tensor();
  }
  void num(double& x, const char* what) { x = next_scalar(what); }
  void flag(bool& b, const char* what) {
    const double x = next_scalar(what);
    if (x != 0 && x != 1) malformed(f_.op, fmt::format("{} flag {}", what, x));
    b = x != 0;
  }
  void version(uint64_t& v, const char* what) {
    const double x = next_scalar(what);
    if (!(x >= 1 && x < 9e15) || x != static_cast<double>(static_cast<uint64_t>(x)))
      malformed(f_.op, fmt::format("{} {}", what, x));
    v = static_cast<uint64_t>(x);
  }
  void role(Role& r, const char* what) {
    const double x = next_scalar(what);
    const auto index = static_cast<int>(x);
    if (x != index || index < 0 || index >= kRoleCount || !role_trains(static_cast<Role>(index)))
      malformed(f_.op, fmt::format("{} index {} does not train", what, x));
    r = static_cast<Role>(index);
  }
  void roles(RoleSet& r, const char* what) {
    const double x = next_scalar(what);
    if (!(x >= 0 && x < (1 << kRoleCount)) || x != static_cast<int>(x))
      malformed(f_.op, fmt::format("{} bits {}", what, x));
    r = RoleSet::from_bits(static_cast<unsigned>(x));
  }
  void per_role(std::array<double, kRoleCount>& a, const char* what) {
    for (double& x : a) x = next_scalar(what);
  }
  void text(std::string& s, const char* what, bool required) {
    if (required && f_.text.empty()) malformed(f_.op, fmt::format("no {}", what));
    s = f_.text;
    text_read_ = true;
  }
  void lines(std::vector<std::string>& v, const char* what, size_t max) {
    v.clear();
    for (size_t b = 0; b < f_.text.size();) {
      const size_t e = f_.text.find('\n', b);
      if (e == std::string::npos) malformed(f_.op, fmt::format("one of the {} without its end of line", what));
      if (v.size() == max) malformed(f_.op, fmt::format("more than {} {}", max, what));
      v.push_back(f_.text.substr(b, e - b));
      b = e + 1;
    }
    lines_ = static_cast<int64_t>(v.size());
    text_read_ = true;
  }
  void values(std::vector<double>& v, const char* what) {
    const at::Tensor t = next_tensor(what, at::kDouble, lines_);
    v.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  }
  void named(std::vector<std::pair<std::string, double>>& v, const char* what, size_t max) {
    std::vector<std::string> names;
    std::vector<double> vals;
    lines(names, what, max);
    values(vals, what);
    v.clear();
    for (size_t i = 0; i < names.size(); ++i) v.emplace_back(std::move(names[i]), vals[i]);
  }
  // Every tensor, scalar and text of the frame was a field.
  void finish() const {
    if (t_ != f_.tensors.size() || s_ != f_.scalars.size())
      malformed(f_.op, fmt::format("{} tensors and {} scalars, its fields take {} and {}", f_.tensors.size(),
                                   f_.scalars.size(), t_, s_));
    if (!text_read_ && !f_.text.empty()) malformed(f_.op, "a text, and no field takes one");
  }

 private:
  int64_t count(Rows rows, const char* what) const {
    if (rows == Rows::kAny) return -1;
    if (rows == Rows::kLines) return lines_;
    if (!sizes_) malformed(f_.op, fmt::format("{} before the batch it is counted in", what));
    return rows == Rows::kResponse ? sizes_->response_tokens() : sizes_->ends();
  }
  at::Tensor next_tensor(const char* what, at::ScalarType dtype, int64_t numel) {
    if (t_ >= f_.tensors.size()) malformed(f_.op, fmt::format("no {} (it has {} tensors)", what, f_.tensors.size()));
    const at::Tensor& t = f_.tensors[t_++];
    if (t.scalar_type() != dtype)
      malformed(f_.op, fmt::format("{} is {}, expected {}", what, c10::toString(t.scalar_type()), c10::toString(dtype)));
    if (numel >= 0 && t.numel() != numel)
      malformed(f_.op, fmt::format("{} has {} elements, expected {}", what, t.numel(), numel));
    return t;
  }
  double next_scalar(const char* what) {
    if (s_ >= f_.scalars.size()) malformed(f_.op, fmt::format("no {} (it has {} scalars)", what, f_.scalars.size()));
    return f_.scalars[s_++];
  }

  const Frame& f_;
  const PackedSequences* sizes_;
  size_t t_ = 0, s_ = 0;
  int64_t lines_ = 0;
  bool text_read_ = false;
};

template <typename M, typename = void>
struct HasCheck : std::false_type {};
template <typename M>
struct HasCheck<M, std::void_t<decltype(std::declval<const M&>().check())>> : std::true_type {};

template <typename M>
Frame encode_message(const M& m) {
  Encoder e(M::kOp);
  const_cast<M&>(m).fields(e);  // the encoder only reads
  return e.take();
}

template <typename M>
M decode_message(const Frame& f, const PackedSequences* sizes = nullptr) {
  if (f.op == Op::kError && M::kOp != Op::kError) throw Error(f.text.empty() ? std::string("unknown error") : f.text);
  if (f.op != M::kOp)
    throw CommError(fmt::format("protocol: expected a '{}' message, got '{}'", op_name(M::kOp), op_name(f.op)));
  M m;
  Decoder d(f, sizes);
  m.fields(d);
  d.finish();
  if constexpr (HasCheck<M>::value)
    if (const std::string why = m.check(); !why.empty()) malformed(M::kOp, why);
  return m;
}

}  // namespace

#define TILLER_MESSAGE_CODEC(M)                                  \
  Frame M::encode() const { return encode_message(*this); }      \
  M M::decode(Frame f) { return decode_message<M>(f); }

TILLER_MESSAGE_CODEC(ScoreRequest)
TILLER_MESSAGE_CODEC(TrainActorRequest)
TILLER_MESSAGE_CODEC(TrainCriticRequest)
TILLER_MESSAGE_CODEC(StepRequest)
TILLER_MESSAGE_CODEC(StepReply)
TILLER_MESSAGE_CODEC(SyncRequest)
TILLER_MESSAGE_CODEC(SyncReply)
TILLER_MESSAGE_CODEC(SaveRequest)
TILLER_MESSAGE_CODEC(LoadRequest)
TILLER_MESSAGE_CODEC(DoneReply)
TILLER_MESSAGE_CODEC(TraceRequest)
TILLER_MESSAGE_CODEC(TraceReply)
TILLER_MESSAGE_CODEC(StopRequest)
TILLER_MESSAGE_CODEC(StopReply)
TILLER_MESSAGE_CODEC(PhaseRequest)
TILLER_MESSAGE_CODEC(PhaseReply)
TILLER_MESSAGE_CODEC(EngineHello)
TILLER_MESSAGE_CODEC(EngineAddress)
TILLER_MESSAGE_CODEC(ErrorReply)

Frame ScoreReply::encode() const { return encode_message(*this); }
ScoreReply ScoreReply::decode(Frame f, const PackedSequences& request) { return decode_message<ScoreReply>(f, &request); }

std::string ScoreRequest::check() const {
  return temperature > 0 ? "" : fmt::format("temperature {}", temperature);
}

std::string ScoreReply::check() const {
  const std::pair<const at::Tensor*, Role> held[] = {{&actor_logp, Role::kActor}, {&actor_entropy, Role::kActor},
                                                     {&critic_values, Role::kCritic}, {&ref_logp, Role::kRef},
                                                     {&reward_scores, Role::kReward}};
  for (const auto& [t, r] : held)
    if (t->defined() != roles.has(r))
      return fmt::format("the {} role is {}held, and its scores are {}there", role_name(r), roles.has(r) ? "" : "not ",
                         t->defined() ? "" : "not ");
  return "";
}

namespace {
// What the train requests share: a positive normalizer and a positive, bounded count of the
// optimizer step's rows (ShardedModel::router_loss checks it against the rows it trained).
std::string check_train(double normalizer, double step_rows) {
  if (!(normalizer > 0)) return fmt::format("normalizer {}", normalizer);
  if (!(step_rows > 0 && step_rows < 1e15)) return fmt::format("step_rows {}", step_rows);
  return "";
}
}  // namespace

std::string TrainActorRequest::check() const { return check_train(normalizer, step_rows); }

std::string TrainCriticRequest::check() const { return check_train(normalizer, step_rows); }

}  // namespace tiller::wire
