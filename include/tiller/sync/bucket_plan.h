// The bucket plan of the weight sync: which bytes of the actor's ZeRO-3 shards travel in which
// bucket, from which actor rank, and where every engine rank copies its tensor-parallel slice of
// them. Computed once per run, identically on every actor rank (a pure function of the model
// config, the actor group's size, the engines' TP size, the wire dtype and the bucket limit), and
// sent to the engines once over their control channel as JSON. Its id (a hash of its contents)
// travels in the header of every sync, so an engine never copies bytes laid out by another plan.
//
// The bytes. Actor rank r holds a contiguous 1/N of every unit's flat buffer (zero/flat_layout.h).
// Its "stream" is its shards of the units in forward order (embedding, blocks, head). A bucket is a
// contiguous range of one rank's stream, at most bucket_bytes in the wire dtype; it may cut a
// parameter anywhere and may span units. The ranks' buckets interleave (r0, r1, ..., r0, r1, ...),
// so successive buckets leave from different actor ranks, and no byte crosses a link twice: a
// bucket is packed on the rank that holds it, with no all-gather first. Alignment gaps and
// padding travel too (at most 64 elements per parameter); engines skip them.
//
// The copies. Each bucket lists its segments: (parameter, element range in the parameter's
// flattened coordinates, offset in the bucket). An engine rank intersects each segment with its
// TP slice of the parameter (tp_dim: whole, rows or columns; an equal split over tp_size) and
// copies that part into place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tiller/model/lora.h"
#include "tiller/model/model_config.h"

namespace tiller::dist {
struct RankPlan;
}

namespace tiller {
struct JobConfig;
}

namespace tiller::sync {

struct PlanParam {
  std::string name;             // HF name
  std::vector<int64_t> shape;   // the whole parameter's
  int tp_dim = -1;              // -1: every TP rank holds it whole; 0: split by rows; 1: by columns
  int64_t numel() const;
};

// Elements [shard_begin, shard_begin + numel) of the sender's shard of `unit`, at `bucket_offset`.
struct PlanSource {
  int unit = 0;
  int64_t shard_begin = 0, numel = 0, bucket_offset = 0;
};

// Elements [param_begin, param_begin + numel) of parameter `param` (flattened), at `bucket_offset`.
struct PlanSegment {
  int param = 0;
  int64_t param_begin = 0, numel = 0, bucket_offset = 0;
};

struct Bucket {
  int sender = 0;       // actor group rank (= rank in the sync communicator)
  int64_t numel = 0;    // elements on the wire
  std::vector<PlanSource> sources;
  std::vector<PlanSegment> segments;
};

struct PlanUnit {
  std::string name;        // "embed", "layers.3", "head"
  int64_t shard_numel = 0; // per actor rank
};

struct BucketPlan {
  uint64_t id = 0;                 // hash of everything below
  std::string wire_dtype;          // "bf16", "fp16" or "fp32": the engines' weight dtype
  int senders = 1;                 // actor group size
  int tp_size = 1;                 // every engine's TP size
  int64_t bucket_bytes = 0;        // the limit the plan was cut with
  std::vector<PlanUnit> units;
  std::vector<PlanParam> params;   // in unit order; a tied LM head is not among them (the embedding is)
  std::vector<Bucket> buckets;     // in sending order

  // A LoRA actor's plan (make_lora_bucket_plan): one unit, "lora", its adapters alone.
  bool adapters_only() const;
  int64_t element_size() const;           // of the wire dtype
  int64_t wire_bytes() const;             // every bucket, gaps included
  int64_t parameter_bytes() const;        // the parameters alone
  int64_t largest_bucket_numel() const;

  uint64_t content_hash() const;          // what id must be
  std::string to_json() const;
  // Parses and checks a plan: the format, the id against the contents, and that the buckets
  // cover every parameter exactly once within bounds. ConfigError names `where` and the problem.
  static BucketPlan from_json(const std::string& text, const std::string& where);
};

// The plan for `cfg`'s LM (the actor's layout over `senders` ranks), engines of `tp_size` ranks
// whose weights are `wire_dtype`, buckets of at most `bucket_bytes` (at least one element).
BucketPlan make_bucket_plan(const model::ModelConfig& cfg, int senders, int tp_size, const std::string& wire_dtype,
                            int64_t bucket_bytes);

// The adapter-only plan of a LoRA actor (model/lora.h): its base is frozen and every engine loaded
// the same base, so a sync sends the adapters alone, in fp32 (the engines hold them unmerged in
// fp32, as the trainer does: engine_weights.h, bind_lora_for_tp). The adapters are one flat fp32
// buffer that every actor rank holds whole (zero::ShardedModel::lora_flat(), lora_parameter_specs'
// order, no gaps): one unit "lora" of that size, sent by actor rank 0 in buckets of at most
// `bucket_bytes`. TP: B by rows for q/k/v/gate/up, A by columns for o/down (tp_split_dim).
BucketPlan make_lora_bucket_plan(const model::ModelConfig& cfg, const model::LoraSpec& spec, int senders, int tp_size,
                                 int64_t bucket_bytes);

// The plan of a `tiller train` job: the actor's model over the actor group's ZeRO-3 ranks, to
// engines of the rank plan's TP size, in the actor's dtype (roles.actor.dtype), in buckets of
// engines.sync_bucket_mb. The controller (which installs it on the engines) and the actor ranks
// (which send under it) both build it here, so the two sides cannot disagree.
BucketPlan job_bucket_plan(const JobConfig& job, const model::ModelConfig& actor_model, const dist::RankPlan& plan);

// How the engines split parameter `hf_name` over TP ranks: model::tp_split_dim (weights.h), the
// rule the engines' slicing follows too.
int tp_split_dim(const std::string& hf_name);

// One copy of an engine rank's slice: `rows` runs of `cols` elements, from the bucket at
// src_offset (stride src_stride) into the flattened local parameter at dst_offset (stride dst_stride).
struct SliceCopy {
  int param = 0;
  int64_t src_offset = 0, dst_offset = 0, rows = 1, cols = 0, src_stride = 0, dst_stride = 0;
};
// The copies that place `segment` into TP rank `tp_rank`'s slice of its parameter (none when the
// segment lies outside the slice; at most three).
std::vector<SliceCopy> slice_copies(const BucketPlan& plan, const PlanSegment& segment, int tp_rank);
// The shape of TP rank's slice of a parameter (equal split along tp_dim).
std::vector<int64_t> local_shape(const PlanParam& p, int tp_size);

}  // namespace tiller::sync
