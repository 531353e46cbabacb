// Delta weight sync's encoding of one bucket (private to src/sync; docs/sync.md, "Delta sync"): the
// bucket's new bytes against the copy the receiver holds (the bytes of the last version it
// applied), in the smaller of two forms, each compressed with zstd:
//   xor     the XOR of new and old with its bytes regrouped by their place in the element (every
//           element's byte 0, then every byte 1, ...): a bf16 weight that moved a little changes
//           its low mantissa bits only, so the plane of sign-and-exponent bytes is mostly zeros;
//   sparse  the elements that changed, as the gaps between their indices (LEB128) and their XOR
//           with the old: smaller when few elements change (frozen layers, a small learning rate);
//   full    the new bytes, with the same plane regrouping: the first sync, a join, a resend.
// An encoding carries the 64-bit XXH3 hash of the base it was made against and of the bytes the
// receiver must end with, and decode checks both: a receiver whose copy is not the base, or a
// payload damaged on the way, is refused (DeltaMismatch) before or after, and the sender resends
// the bucket in full. Every size is bounded (kMaxBucketBytes), and a payload that would expand past
// its bucket's size is refused, not followed.
//
// Thread-safe: the functions hold no state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "tiller/core/error.h"

namespace tiller::sync {

// A bucket's bytes are at most this (a sync bucket is engines.sync_bucket_mb, at most 4 GiB).
constexpr uint64_t kMaxBucketBytes = uint64_t{4} << 30;

enum class DeltaForm : uint8_t { kFull = 0, kXor = 1, kSparse = 2 };
const char* delta_form_name(DeltaForm f);

// The receiver's copy is not what the delta was made against, or the result is not what the sender
// holds: the bucket must be sent in full.
class DeltaMismatch : public Error {
 public:
  using Error::Error;
};

struct DeltaOptions {
  int element_bytes = 2;  // 1 (FP8), 2 (bf16, fp16) or 4 (fp32): the plane regrouping's stride
  int zstd_level = 1;     // 1 to 19: 1 compresses a bf16 delta at several GB/s a core
  // The sparse form is tried when at most this share of the elements changed (it needs one pass
  // more); the smaller of the two is sent.
  double sparse_below = 0.25;
};

struct EncodedBucket {
  DeltaForm form = DeltaForm::kFull;
  uint64_t bytes = 0;          // the bucket's size
  uint64_t base_hash = 0;      // XXH3-64 of the base (0 with kFull)
  uint64_t hash = 0;           // XXH3-64 of the new bytes
  uint64_t changed = 0;        // elements that differ from the base (all of them with kFull)
  std::string payload;         // one zstd frame
};

// XXH3-64 of `n` bytes.
uint64_t bucket_hash(const void* data, size_t n);

// `next` against `base` (both `n` bytes): the smaller of xor and sparse, or full when `base` is
// null. ConfigError for a size or option out of bounds (n not a multiple of element_bytes, over
// kMaxBucketBytes).
EncodedBucket encode_bucket(const void* next, const void* base, size_t n, const DeltaOptions& opts = {});

// Applies `e` to `inout` (`n` bytes, the receiver's copy: the base for xor and sparse), in place.
// DeltaMismatch, with `inout` left as it was, when `inout` is not the encoding's base, the payload
// does not decode to the bucket's size, or the result's hash is not the sender's: the caller then
// asks for the bucket in full. ConfigError for a bad element_bytes or size.
void decode_bucket(const EncodedBucket& e, void* inout, size_t n, int element_bytes);
// The same for an encoding whose payload lives elsewhere (a received chunk's): read, not copied.
void decode_bucket(DeltaForm form, uint64_t bytes, uint64_t base_hash, uint64_t hash, const std::string& payload,
                   void* inout, size_t n, int element_bytes);

}  // namespace tiller::sync
