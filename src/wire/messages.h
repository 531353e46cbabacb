// The controller <-> rank messages of `tiller train`: one struct per message, each encoded into
// and decoded from a Frame here and nowhere else. Private to src: the controller, the trainer
// ranks, the job that starts them and the in-process stand-ins (src/testing) include it.
//
// The wire: a Frame travels over the world communicator (MPI, CPU tensors) as a fixed-size int64
// header that says what follows (the op, the tensors' dtypes and sizes, a few doubles, the length
// of a text), then one message per tensor and one for the text. send/recv pair up in order per
// (sender, receiver) (communicator.h), so a frame is read back exactly as it was written.
//
// The messages (R: response tokens of the micro-batch, B: its samples):
//   ScoreRequest        -> ScoreReply     log-probs / entropy / values / reward scores of this rank's roles
//   TrainActorRequest   (no reply)        one actor micro-batch: forward, loss, backward
//   TrainCriticRequest  (no reply)        one critic micro-batch
//   StepRequest         -> StepReply      an optimizer step of one role, and its statistics
//   SyncRequest         -> SyncReply      actor ranks: send the weights to the engines
//   SaveRequest / LoadRequest -> DoneReply   this rank's trained roles to / from a directory
//   TraceRequest        -> TraceReply     the rank's phase spans since the last TraceRequest
//   StopRequest         -> StopReply      leave the serve loop
//   EngineHello -> EngineAddress          start-up: an engine leader's shared secret, its address
//   PhaseRequest        -> PhaseReply     hybrid: trainer state to the host (generate) or back (train),
//                                         and the rank's device memory
// Any request may be answered by an ErrorReply instead (the rank failed; it names the cause).
// decode() checks the op, the tensors' count, dtypes and sizes against each other, and throws
// CommError naming the message when they disagree.
//
// Threading: none inside; one thread per communicator (the controller's loop, or the rank's).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/deadline.h"
#include "tiller/core/roles.h"
#include "tiller/dist/communicator.h"
#include "wire/packed_sequences.h"

namespace tiller::wire {

// --- The wire --------------------------------------------------------------------------------

enum class Op : int64_t {
  kScore = 1,
  kTrainActor,
  kTrainCritic,
  kStep,
  kSync,
  kSave,
  kLoad,
  kTrace,
  kStop,
  kEngineHello,
  kPhase,
  kScoreReply = 100,
  kStepReply,
  kSyncReply,
  kDone,
  kTraceReply,
  kStopReply,
  kEngineAddress,
  kPhaseReply,
  kError,
};
const char* op_name(Op op);

struct Frame {
  Op op = Op::kError;
  std::vector<double> scalars;
  std::vector<at::Tensor> tensors;  // CPU, contiguous: int64, float32, float64 or uint8
  std::string text;
};

// Posts the frame to `peer`; the returned works complete when it has left (wait on them, or keep
// them until the peer answers: the tensors stay alive inside them).
std::vector<dist::WorkPtr> send_frame(dist::Communicator& comm, int peer, const Frame& f);

// Receives the next frame from `peer`, waiting until `deadline`. TimeoutError says who was silent.
Frame recv_frame(dist::Communicator& comm, int peer, Deadline deadline);

// A frame being received without blocking: the constructor posts the header's receive; poll()
// posts the payload once the header is in and returns true when everything has arrived. At most
// one per peer at a time (later frames from the same peer queue behind it in order).
class IncomingFrame {
 public:
  IncomingFrame(dist::Communicator& comm, int peer);
  bool poll();
  Frame take();  // after poll() returned true
  int peer() const { return peer_; }

 private:
  dist::Communicator* comm_;
  int peer_;
  at::Tensor header_;
  dist::WorkPtr header_work_;
  std::vector<dist::WorkPtr> payload_;
  Frame frame_;
  bool payload_posted_ = false;
};

// --- The messages ----------------------------------------------------------------------------
//
// Each message lists its fields once, in order, in `fields(v)`; one encoder and one decoder
// (protocol.cpp) walk that list, so no message has a hand-written encoding. What a field kind puts
// on the wire:
//   batch(b)                      a PackedSequences: four int64 tensors, checked against each other;
//                                 the message's per-row sizes below are counted in it
//   tensor(t, what, dtype, rows)  a tensor of `dtype` and `rows` elements
//   optional(t, what, dtype, rows) the same, or nothing (a presence flag among the scalars)
//   num / flag / version / role / roles / per_role   scalars (a flag is 0 or 1; a version >= 1; a
//                                 role one that trains)
//   text(s, what, required)       the frame's text
//   lines(v, what, max) / values(v, what)   names, one per line of the text (at most max), and a
//                                 double tensor of one value per name; named(v, what, max) both
//                                 for (name, value) pairs
// The decoder refuses a frame whose op, counts, dtypes or sizes differ from the list, naming the
// message and the field, and then asks the message's check() (its values: a temperature > 0, ...).
// `encode` walks the list of a const message (fields() only reads through the encoder).
//
// `Rows`: how many elements a tensor field has: any; one per response row of the message's batch
// (or, for a ScoreReply, of the request it answers); one per sequence that ends in it; one per line.
enum class Rows { kAny, kResponse, kEnds, kLines };

struct ScoreRequest {
  static constexpr Op kOp = Op::kScore;
  PackedSequences batch;
  double temperature = 1.0;  // the sampling temperature: log-probs are of logits / temperature
  template <typename V>
  void fields(V& v) {
    v.batch(batch);
    v.num(temperature, "temperature");
  }
  std::string check() const;
  Frame encode() const;
  static ScoreRequest decode(Frame f);
};

// Per-response-token tensors are float [R] (R: the request's response rows), the reward's float
// [ends()]; undefined for roles the rank does not hold.
struct ScoreReply {
  static constexpr Op kOp = Op::kScoreReply;
  RoleSet roles;
  at::Tensor actor_logp, actor_entropy;
  at::Tensor critic_values;
  at::Tensor ref_logp;
  at::Tensor reward_scores;
  std::array<double, kRoleCount> seconds{};  // compute seconds per role (canonical order)
  // The rank's scoring benchmark per role (tokens/s at the job's shapes; 0: not measured).
  std::array<double, kRoleCount> bench{};
  template <typename V>
  void fields(V& v) {
    v.roles(roles, "roles");
    v.optional(actor_logp, "actor log-probs", at::kFloat, Rows::kResponse);
    v.optional(actor_entropy, "actor entropy", at::kFloat, Rows::kResponse);
    v.optional(critic_values, "critic values", at::kFloat, Rows::kResponse);
    v.optional(ref_logp, "reference log-probs", at::kFloat, Rows::kResponse);
    v.optional(reward_scores, "reward scores", at::kFloat, Rows::kEnds);
    v.per_role(seconds, "seconds");
    v.per_role(bench, "bench");
  }
  std::string check() const;  // a tensor for each role held, none for the others
  Frame encode() const;
  // `request` is what was asked: the sizes are checked against it.
  static ScoreReply decode(Frame f, const PackedSequences& request);
};

struct TrainActorRequest {
  static constexpr Op kOp = Op::kTrainActor;
  PackedSequences batch;
  at::Tensor old_logp;    // float [R]: the proximal policy's (the actor's, scored before this step)
  at::Tensor advantages;  // float [R]
  at::Tensor ref_logp;    // float [R], or undefined: no KL loss
  at::Tensor is_weights;  // float [R], or undefined: no importance weights (algo.importance_correction)
  // uint8 [R], or undefined: every response token trains. Multi-turn samples: 0 for observation
  // tokens, which get no gradient and count in no statistic.
  at::Tensor loss_mask;
  double normalizer = 1;  // the loss's divisor (the optimizer step's tokens, or Dr.GRPO's constant)
  double kl_coef = 0;     // KL-loss coefficient (with ref_logp)
  // The rows of every micro-batch of this optimizer step, over every rank: a mixture of experts'
  // router losses weigh each micro-batch by its share (ShardedModel::router_loss).
  double step_rows = 1;
  template <typename V>
  void fields(V& v) {
    v.batch(batch);
    v.tensor(old_logp, "old log-probs", at::kFloat, Rows::kResponse);
    v.tensor(advantages, "advantages", at::kFloat, Rows::kResponse);
    v.optional(ref_logp, "reference log-probs", at::kFloat, Rows::kResponse);
    v.optional(is_weights, "importance weights", at::kFloat, Rows::kResponse);
    v.optional(loss_mask, "loss mask", at::kByte, Rows::kResponse);
    v.num(normalizer, "normalizer");
    v.num(kl_coef, "kl_coef");
    v.num(step_rows, "step_rows");
  }
  std::string check() const;
  Frame encode() const;
  static TrainActorRequest decode(Frame f);
};

struct TrainCriticRequest {
  static constexpr Op kOp = Op::kTrainCritic;
  PackedSequences batch;
  at::Tensor old_values;  // float [R]
  at::Tensor returns;     // float [R]
  at::Tensor loss_mask;   // uint8 [R] or undefined (TrainActorRequest's)
  double normalizer = 1;
  double step_rows = 1;   // TrainActorRequest's
  template <typename V>
  void fields(V& v) {
    v.batch(batch);
    v.tensor(old_values, "old values", at::kFloat, Rows::kResponse);
    v.tensor(returns, "returns", at::kFloat, Rows::kResponse);
    v.optional(loss_mask, "loss mask", at::kByte, Rows::kResponse);
    v.num(normalizer, "normalizer");
    v.num(step_rows, "step_rows");
  }
  std::string check() const;
  Frame encode() const;
  static TrainCriticRequest decode(Frame f);
};

struct StepRequest {
  static constexpr Op kOp = Op::kStep;
  Role role = Role::kActor;  // actor or critic
  double lr = 0;
  template <typename V>
  void fields(V& v) {
    v.role(role, "role");
    v.num(lr, "lr");
  }
  Frame encode() const;
  static StepRequest decode(Frame f);
};

// What one rank's micro-batches and optimizer step of one role came to.
struct StepStats {
  double grad_norm = 0;
  bool skipped = false;          // a non-finite gradient norm: the step was skipped
  double loss = 0;               // summed over micro-batches
  double clip_tokens = 0;        // tokens whose clipped term was taken
  double approx_kl_tokens = 0;   // sum over tokens of (old - new log-prob)
  double entropy_sum = 0;
  double tokens = 0;             // response tokens trained
  double train_seconds = 0;      // forward + backward of the micro-batches
  double step_seconds = 0;       // the optimizer step
  double peak_host_mb = 0;
  // The most the rank's device allocator has held since the process started or, in a hybrid job,
  // since its training phase began (the phase change resets it); 0 on CPU.
  double peak_device_gb = 0;
  double bench_tokens_per_s = 0;  // the rank's training benchmark at the job's shapes (0: not measured)
  // The policy loss's named statistics, summed over the micro-batches (losses.h).
  std::vector<std::pair<std::string, double>> loss_metrics;
  // A mixture of experts: this rank's training forwards' tokens per expert, double, flattened
  // [sparse layers, expert_load_experts] (ShardedModel::take_expert_load); undefined otherwise.
  at::Tensor expert_load;
  double expert_load_experts = 0;
  // Router losses (roles.<role>.router_*_loss_coef): this rank's weighted load-balancing and z
  // losses (ShardedModel::take_router_stats), summed over the micro-batches; the ranks' sum is the
  // step's mean.
  double router_aux = 0;
  double router_z = 0;
};

struct StepReply {
  static constexpr Op kOp = Op::kStepReply;
  static constexpr size_t kMaxLossMetrics = 16;  // losses.cpp's bound
  StepStats stats;
  template <typename V>
  void fields(V& v) {
    StepStats& s = stats;
    v.num(s.grad_norm, "grad_norm");
    v.flag(s.skipped, "skipped");
    v.num(s.loss, "loss");
    v.num(s.clip_tokens, "clip_tokens");
    v.num(s.approx_kl_tokens, "approx_kl_tokens");
    v.num(s.entropy_sum, "entropy_sum");
    v.num(s.tokens, "tokens");
    v.num(s.train_seconds, "train_seconds");
    v.num(s.step_seconds, "step_seconds");
    v.num(s.peak_host_mb, "peak_host_mb");
    v.num(s.bench_tokens_per_s, "bench_tokens_per_s");
    v.named(s.loss_metrics, "loss metrics", kMaxLossMetrics);
    v.num(s.expert_load_experts, "experts");
    v.optional(s.expert_load, "expert load", at::kDouble, Rows::kAny);
    v.num(s.router_aux, "router_aux");
    v.num(s.router_z, "router_z");
    v.num(s.peak_device_gb, "peak_device_gb");
  }
  Frame encode() const;
  static StepReply decode(Frame f);
};

struct SyncRequest {
  static constexpr Op kOp = Op::kSync;
  static constexpr size_t kMaxTargets = 4096;
  uint64_t version = 0;
  // Standalone engines (engines.addresses / rendezvous_dir): the host:port of each engine the
  // actor ranks push this version to. Empty: the sync communicator's engines.
  std::vector<std::string> targets;
  template <typename V>
  void fields(V& v) {
    v.version(version, "weight version");
    v.lines(targets, "engine addresses", kMaxTargets);
  }
  Frame encode() const;
  static SyncRequest decode(Frame f);
};

struct SyncReply {
  static constexpr Op kOp = Op::kSyncReply;
  double seconds = 0;
  double wire_bytes = 0;
  // A push to standalone engines: the addresses of those this rank's push failed to (its log says
  // why); the controller takes them out of the job.
  std::vector<std::string> failed;
  template <typename V>
  void fields(V& v) {
    v.num(seconds, "seconds");
    v.num(wire_bytes, "wire_bytes");
    v.lines(failed, "engines whose push failed", SyncRequest::kMaxTargets);
  }
  Frame encode() const;
  static SyncReply decode(Frame f);
};

struct SaveRequest {
  static constexpr Op kOp = Op::kSave;
  std::string dir;
  template <typename V>
  void fields(V& v) {
    v.text(dir, "directory", true);
  }
  Frame encode() const;
  static SaveRequest decode(Frame f);
};

struct LoadRequest {
  static constexpr Op kOp = Op::kLoad;
  std::string dir;
  template <typename V>
  void fields(V& v) {
    v.text(dir, "directory", true);
  }
  Frame encode() const;
  static LoadRequest decode(Frame f);
};

// Messages that are only their op.
struct DoneReply {
  static constexpr Op kOp = Op::kDone;
  template <typename V>
  void fields(V&) {}
  Frame encode() const;
  static DoneReply decode(Frame f);
};

struct TraceRequest {
  static constexpr Op kOp = Op::kTrace;
  template <typename V>
  void fields(V&) {}
  Frame encode() const;
  static TraceRequest decode(Frame f);
};

struct TraceReply {
  static constexpr Op kOp = Op::kTraceReply;
  static constexpr size_t kMaxSpans = 1 << 20;
  std::vector<std::string> names;  // span i is names[i], from begin_us[i] to end_us[i] (wall clock)
  std::vector<double> begin_us, end_us;
  template <typename V>
  void fields(V& v) {
    v.lines(names, "span names", kMaxSpans);
    v.values(begin_us, "span begins");
    v.values(end_us, "span ends");
  }
  Frame encode() const;
  static TraceReply decode(Frame f);
};

struct StopRequest {
  static constexpr Op kOp = Op::kStop;
  template <typename V>
  void fields(V&) {}
  Frame encode() const;
  static StopRequest decode(Frame f);
};

struct StopReply {
  static constexpr Op kOp = Op::kStopReply;
  double peak_host_mb = 0;
  template <typename V>
  void fields(V& v) {
    v.num(peak_host_mb, "peak_host_mb");
  }
  Frame encode() const;
  static StopReply decode(Frame f);
};

// The hybrid engine's phases, on each trainer rank (docs/training.md): `offload` moves the state of
// the rank's roles with roles.<r>.offload to the host (the engines are about to generate); false
// brings it back (training is next).
struct PhaseRequest {
  static constexpr Op kOp = Op::kPhase;
  bool offload = false;
  template <typename V>
  void fields(V& v) {
    v.flag(offload, "offload");
  }
  Frame encode() const;
  static PhaseRequest decode(Frame f);
};

// The rank's device memory after the phase change (model::device_memory; zeros on CPU), the peak
// since the previous phase change, and the bytes moved.
struct PhaseReply {
  static constexpr Op kOp = Op::kPhaseReply;
  double moved_bytes = 0;
  double allocated = 0, reserved = 0, peak_allocated = 0;
  template <typename V>
  void fields(V& v) {
    v.num(moved_bytes, "moved_bytes");
    v.num(allocated, "allocated");
    v.num(reserved, "reserved");
    v.num(peak_allocated, "peak_allocated");
  }
  Frame encode() const;
  static PhaseReply decode(Frame f);
};

struct EngineHello {
  static constexpr Op kOp = Op::kEngineHello;
  std::string token;  // the engines' shared secret for this job
  template <typename V>
  void fields(V& v) {
    v.text(token, "token", false);
  }
  Frame encode() const;
  static EngineHello decode(Frame f);
};

struct EngineAddress {
  static constexpr Op kOp = Op::kEngineAddress;
  std::string address;  // host:port of the engine's gRPC service
  template <typename V>
  void fields(V& v) {
    v.text(address, "address", true);
  }
  Frame encode() const;
  static EngineAddress decode(Frame f);
};

// Any request may be answered by this instead: decoding it as another message throws Error with
// its text.
struct ErrorReply {
  static constexpr Op kOp = Op::kError;
  std::string what;
  template <typename V>
  void fields(V& v) {
    v.text(what, "message", false);
  }
  Frame encode() const;
  static ErrorReply decode(Frame f);
};

// Every message, for the tests that walk them all.
using Messages = std::tuple<ScoreRequest, ScoreReply, TrainActorRequest, TrainCriticRequest, StepRequest, StepReply,
                            SyncRequest, SyncReply, SaveRequest, LoadRequest, DoneReply, TraceRequest, TraceReply,
                            StopRequest, StopReply, PhaseRequest, PhaseReply, EngineHello, EngineAddress, ErrorReply>;

}  // namespace tiller::wire
