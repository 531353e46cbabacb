// The controller <-> rank messages of `tiller train` (private to src/rollout): one struct per
// message, each encoded into and decoded from a Frame here and nowhere else.
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
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tiller/core/deadline.h"
#include "tiller/core/roles.h"
#include "tiller/dist/communicator.h"

namespace tiller::rollout {

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

// Whole sequences packed back to back (prompt + response each), or, under sequence parallelism,
// one rank's rows of such a packed row (zero/sequence_parallel.h: SequenceSplit cuts it).
//
// Row t "is a response row" when its next token is a response token: rows prompt_len - 1 ..
// seq_len - 2 of each sequence. Per-response-token arrays (log-probs, advantages, ...) follow the
// response rows in order, so a slice's part of such an array is a contiguous range of it.
struct PackedSequences {
  at::Tensor tokens;       // int64: rows [first_row, first_row + tokens.numel()) of the packed row
  at::Tensor seq_lens;     // int64 [B]: every sequence of the packed row
  at::Tensor prompt_lens;  // int64 [B], each in [1, seq_len)
  int64_t first_row = 0;
  int64_t next_token = 0;  // the token of row first_row + n (a slice's last target); 0 past the end

  int64_t size() const { return seq_lens.defined() ? seq_lens.numel() : 0; }  // sequences of the row
  int64_t rows() const;               // tokens of the whole packed row
  int64_t held() const { return tokens.defined() ? tokens.numel() : 0; }
  bool whole() const { return first_row == 0 && held() == rows(); }
  int64_t response_tokens() const;    // response rows held (the whole row: sum of seq_len - prompt_len)
  int64_t response_before() const;    // response rows before first_row
  int64_t ends() const;               // sequences whose last row is held (they get reward scores)
  int64_t ends_before() const;        // sequences that end before first_row
  // The slices of `parts` ranks (rank j's is [j]), cut by SequenceSplit; a whole row when parts == 1.
  std::vector<PackedSequences> cut(int parts) const;
};

struct ScoreRequest {
  PackedSequences batch;
  double temperature = 1.0;  // the sampling temperature: log-probs are of logits / temperature
  Frame encode() const;
  static ScoreRequest decode(Frame f);
};

// Per-response-token tensors are float [R] (R: the request's response rows), the reward's float
// [ends()]; undefined for roles the rank does not hold.
struct ScoreReply {
  RoleSet roles;
  at::Tensor actor_logp, actor_entropy;
  at::Tensor critic_values;
  at::Tensor ref_logp;
  at::Tensor reward_scores;
  std::array<double, kRoleCount> seconds{};  // compute seconds per role (canonical order)
  // The rank's scoring benchmark per role (tokens/s at the job's shapes; 0: not measured).
  std::array<double, kRoleCount> bench{};
  Frame encode() const;
  // `request` is what was asked: the sizes are checked against it.
  static ScoreReply decode(Frame f, const PackedSequences& request);
};

struct TrainActorRequest {
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
  Frame encode() const;
  static TrainActorRequest decode(Frame f);
};

struct TrainCriticRequest {
  PackedSequences batch;
  at::Tensor old_values;  // float [R]
  at::Tensor returns;     // float [R]
  at::Tensor loss_mask;   // uint8 [R] or undefined (TrainActorRequest's)
  double normalizer = 1;
  Frame encode() const;
  static TrainCriticRequest decode(Frame f);
};

struct StepRequest {
  Role role = Role::kActor;  // actor or critic
  double lr = 0;
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
  double bench_tokens_per_s = 0;  // the rank's training benchmark at the job's shapes (0: not measured)
  // The policy loss's named statistics, summed over the micro-batches (losses.h).
  std::vector<std::pair<std::string, double>> loss_metrics;
};

struct StepReply {
  StepStats stats;
  Frame encode() const;
  static StepReply decode(Frame f);
};

struct SyncRequest {
  uint64_t version = 0;
  Frame encode() const;
  static SyncRequest decode(Frame f);
};

struct SyncReply {
  double seconds = 0;
  double wire_bytes = 0;
  Frame encode() const;
  static SyncReply decode(Frame f);
};

struct SaveRequest {
  std::string dir;
  Frame encode() const;
  static SaveRequest decode(Frame f);
};

struct LoadRequest {
  std::string dir;
  Frame encode() const;
  static LoadRequest decode(Frame f);
};

struct DoneReply {
  Frame encode() const;
  static DoneReply decode(Frame f);
};

struct TraceRequest {
  Frame encode() const;
  static TraceRequest decode(Frame f);
};

struct TraceReply {
  std::vector<std::string> names;  // span i is names[i], from begin_us[i] to end_us[i] (wall clock)
  std::vector<double> begin_us, end_us;
  Frame encode() const;
  static TraceReply decode(Frame f);
};

struct StopRequest {
  Frame encode() const;
  static StopRequest decode(Frame f);
};

struct StopReply {
  double peak_host_mb = 0;
  Frame encode() const;
  static StopReply decode(Frame f);
};

// The hybrid engine's phases, on each trainer rank (docs/training.md): `offload` moves the state of
// the rank's roles with roles.<r>.offload to the host (the engines are about to generate); false
// brings it back (training is next).
struct PhaseRequest {
  bool offload = false;
  Frame encode() const;
  static PhaseRequest decode(Frame f);
};

// The rank's device memory after the phase change (model::device_memory; zeros on CPU), the peak
// since the previous phase change, and the bytes moved.
struct PhaseReply {
  double moved_bytes = 0;
  double allocated = 0, reserved = 0, peak_allocated = 0;
  Frame encode() const;
  static PhaseReply decode(Frame f);
};

struct EngineHello {
  std::string token;  // the engines' shared secret for this job
  Frame encode() const;
  static EngineHello decode(Frame f);
};

struct EngineAddress {
  std::string address;  // host:port of the engine's gRPC service
  Frame encode() const;
  static EngineAddress decode(Frame f);
};

struct ErrorReply {
  std::string what;
  Frame encode() const;
  static ErrorReply decode(Frame f);
};

}  // namespace tiller::rollout
