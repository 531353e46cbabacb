#include "sync/delta_codec.h"

#include <xxhash.h>
#include <zstd.h>

#include <cstring>
#include <memory>
#include <vector>

#include <fmt/format.h>

namespace tiller::sync {
namespace {

void check_sizes(size_t n, int element_bytes) {
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4)
    throw ConfigError(fmt::format("delta sync: element size {} bytes: use 1 (fp8), 2 (bf16, fp16) or 4 (fp32)",
                                  element_bytes));
  if (n > kMaxBucketBytes)
    throw ConfigError(fmt::format("delta sync: a bucket of {} bytes is over the {} allowed", n, kMaxBucketBytes));
  if (n % static_cast<size_t>(element_bytes) != 0)
    throw ConfigError(fmt::format("delta sync: a bucket of {} bytes is not whole elements of {} bytes", n,
                                  element_bytes));
}

// out[p * m + i] = in[i * E + p]: each byte place of the m elements together.
void to_planes(const uint8_t* in, size_t m, int e, uint8_t* out) {
  if (e == 2) {  // bf16, fp16: the common case, in a loop the compiler vectorizes
    uint8_t* lo = out;
    uint8_t* hi = out + m;
    for (size_t i = 0; i < m; ++i) {
      lo[i] = in[2 * i];
      hi[i] = in[2 * i + 1];
    }
    return;
  }
  for (int p = 0; p < e; ++p) {
    uint8_t* o = out + static_cast<size_t>(p) * m;
    for (size_t i = 0; i < m; ++i) o[i] = in[i * static_cast<size_t>(e) + static_cast<size_t>(p)];
  }
}

void from_planes(const uint8_t* in, size_t m, int e, uint8_t* out) {
  if (e == 2) {
    const uint8_t* lo = in;
    const uint8_t* hi = in + m;
    for (size_t i = 0; i < m; ++i) {
      out[2 * i] = lo[i];
      out[2 * i + 1] = hi[i];
    }
    return;
  }
  for (int p = 0; p < e; ++p) {
    const uint8_t* s = in + static_cast<size_t>(p) * m;
    for (size_t i = 0; i < m; ++i) out[i * static_cast<size_t>(e) + static_cast<size_t>(p)] = s[i];
  }
}

// Scratch buffers kept by each thread between calls (slot 0..3), grown as needed and left
// uninitialised: a fresh buffer costs a page fault per 4 KiB on first touch (~1 GB/s), more than
// the work done in it. A thread keeps up to four of its largest chunk.
uint8_t* scratch(size_t n, int slot) {
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
  };
  thread_local Buffer buffers[4];
  Buffer& b = buffers[slot];
  if (b.size < n) {
    b.data.reset();
    b.data.reset(new uint8_t[n]);
    b.size = n;
  }
  return b.data.get();
}

// The lanes of an element size in a 64-bit word: the high bit of each lane, and the others.
constexpr uint64_t high_bits(int e) {
  return e == 1 ? 0x8080808080808080ull : e == 2 ? 0x8000800080008000ull : 0x8000000080000000ull;
}

// x = a ^ b over n bytes (whole elements of e bytes); returns how many elements are not zero in x.
uint64_t xor_count(const uint8_t* a, const uint8_t* b, uint8_t* x, size_t n, int e) {
  const uint64_t hi = high_bits(e), lo = ~hi;
  const uint64_t lane_ones = hi >> (8 * e - 1);  // 1 in every lane
  uint64_t changed = 0;
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t wa, wb;
    std::memcpy(&wa, a + k, 8);
    std::memcpy(&wb, b + k, 8);
    const uint64_t w = wa ^ wb;
    std::memcpy(x + k, &w, 8);
    // A lane's high bit ends set when any of its bits is: its low bits carry into it.
    // Those high bits moved down to each lane's lowest bit, summed into the top lane by one multiply
    // (no popcount instruction needed).
    const uint64_t ones = ((((w & lo) + lo) | w) & hi) >> (8 * e - 1);
    changed += (ones * lane_ones) >> (64 - 8 * e);
  }
  for (; k < n; k += static_cast<size_t>(e)) {  // n - k is a multiple of e (8 is one of e's multiples)
    bool differs = false;
    for (int p = 0; p < e; ++p) {
      x[k + static_cast<size_t>(p)] = a[k + static_cast<size_t>(p)] ^ b[k + static_cast<size_t>(p)];
      differs |= x[k + static_cast<size_t>(p)] != 0;
    }
    changed += differs ? 1 : 0;
  }
  return changed;
}

// inout ^= x over n bytes.
void xor_into(uint8_t* inout, const uint8_t* x, size_t n) {
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t a, b;
    std::memcpy(&a, inout + k, 8);
    std::memcpy(&b, x + k, 8);
    a ^= b;
    std::memcpy(inout + k, &a, 8);
  }
  for (; k < n; ++k) inout[k] ^= x[k];
}

// One context per thread: a context is ~1 MB of tables, too costly to make for every chunk.
std::string compress(const uint8_t* raw, size_t n, int level) {
  thread_local std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> ctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  if (!ctx) throw Error("delta sync: zstd: cannot make a compression context (out of memory)");
  const size_t bound = ZSTD_compressBound(n);
  uint8_t* buf = scratch(bound, 3);
  const size_t z = ZSTD_compressCCtx(ctx.get(), buf, bound, raw, n, level);
  if (ZSTD_isError(z)) throw Error(fmt::format("delta sync: zstd: {}", ZSTD_getErrorName(z)));
  return std::string(reinterpret_cast<const char*>(buf), z);
}

// The payload's frame into `out`, which it must fill exactly (`expected` bytes).
void decompress(const std::string& payload, uint8_t* out, size_t expected, const char* form) {
  const unsigned long long declared = ZSTD_getFrameContentSize(payload.data(), payload.size());
  if (declared != expected)
    throw DeltaMismatch(fmt::format("delta sync: a {} payload that declares {} bytes, expected {}", form,
                                    declared == ZSTD_CONTENTSIZE_ERROR     ? std::string("no frame")
                                    : declared == ZSTD_CONTENTSIZE_UNKNOWN ? std::string("an unknown size")
                                                                           : std::to_string(declared),
                                    expected));
  thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> ctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!ctx) throw Error("delta sync: zstd: cannot make a decompression context (out of memory)");
  const size_t got = ZSTD_decompressDCtx(ctx.get(), out, expected, payload.data(), payload.size());
  if (ZSTD_isError(got) || got != expected)
    throw DeltaMismatch(fmt::format("delta sync: a {} payload that does not decode ({})", form,
                                    ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short"));
}

void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

// A LEB128 value at `at` (advanced past it); false past `end` or over 64 bits.
bool get_varint(const uint8_t*& at, const uint8_t* end, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at == end) return false;
    const uint8_t b = *at++;
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;
}

bool same_element(const uint8_t* a, const uint8_t* b, int e) {
  switch (e) {
    case 1: return a[0] == b[0];
    case 2: return std::memcmp(a, b, 2) == 0;
    default: return std::memcmp(a, b, 4) == 0;
  }
}

// The sparse form before compression: the count, the gaps (index - previous index - 1, the first
// from -1), then the changed elements' XOR with the base, in planes (`x`: the whole XOR).
std::vector<uint8_t> sparse_raw(const uint8_t* x, size_t m, int e, uint64_t changed) {
  std::vector<uint8_t> raw;
  raw.reserve(static_cast<size_t>(changed) * (static_cast<size_t>(e) + 2) + 10);
  put_varint(raw, changed);
  std::vector<uint8_t> values;
  values.reserve(static_cast<size_t>(changed) * static_cast<size_t>(e));
  static const uint8_t kZero[4] = {0, 0, 0, 0};
  uint64_t prev_plus_one = 0;
  const size_t per_word = 8 / static_cast<size_t>(e);
  for (size_t i = 0; i < m; ++i) {
    if (i % per_word == 0 && i + per_word <= m) {  // a whole word of unchanged elements: skip it
      uint64_t w;
      std::memcpy(&w, x + i * static_cast<size_t>(e), 8);
      if (w == 0) {
        i += per_word - 1;
        continue;
      }
    }
    const uint8_t* a = x + i * static_cast<size_t>(e);
    if (same_element(a, kZero, e)) continue;
    put_varint(raw, i - prev_plus_one);
    prev_plus_one = i + 1;
    values.insert(values.end(), a, a + e);
  }
  const size_t at = raw.size();
  raw.resize(at + values.size());
  to_planes(values.data(), static_cast<size_t>(changed), e, raw.data() + at);
  return raw;
}

}  // namespace

const char* delta_form_name(DeltaForm f) {
  switch (f) {
    case DeltaForm::kFull: return "full";
    case DeltaForm::kXor: return "xor";
    case DeltaForm::kSparse: return "sparse";
  }
  return "unknown";
}

uint64_t bucket_hash(const void* data, size_t n) { return XXH3_64bits(data, n); }

EncodedBucket encode_bucket(const void* next_v, const void* base_v, size_t n, const DeltaOptions& opts) {
  const int e = opts.element_bytes;
  check_sizes(n, e);
  if (opts.zstd_level < 1 || opts.zstd_level > 19)
    throw ConfigError(fmt::format("delta sync: zstd level {}: allowed 1 to 19", opts.zstd_level));
  if (!(opts.sparse_below >= 0 && opts.sparse_below <= 1))
    throw ConfigError(fmt::format("delta sync: sparse_below = {}: allowed 0 to 1", opts.sparse_below));
  const auto* next = static_cast<const uint8_t*>(next_v);
  const auto* base = static_cast<const uint8_t*>(base_v);
  const size_t m = n / static_cast<size_t>(e);
  EncodedBucket out;
  out.bytes = n;
  out.hash = bucket_hash(next, n);
  uint8_t* planes = scratch(n, 0);
  if (base == nullptr) {
    out.form = DeltaForm::kFull;
    out.changed = m;
    to_planes(next, m, e, planes);
    out.payload = compress(planes, n, opts.zstd_level);
    return out;
  }
  out.base_hash = bucket_hash(base, n);
  uint8_t* x = scratch(n, 1);
  const uint64_t changed = xor_count(next, base, x, n, e);
  out.changed = changed;
  const double share = m == 0 ? 0 : static_cast<double>(changed) / static_cast<double>(m);
  if (share <= opts.sparse_below) {
    const std::vector<uint8_t> raw = sparse_raw(x, m, e, changed);
    out.form = DeltaForm::kSparse;
    out.payload = compress(raw.data(), raw.size(), opts.zstd_level);
    // Under one element in 64 the sparse form is the smaller one by far (measured: 1.6-4.4% changed
    // gave 35-80x less than the XOR of the same bytes); above it, both are tried.
    if (changed * 64 <= m) return out;
  }
  to_planes(x, m, e, planes);
  std::string dense = compress(planes, n, opts.zstd_level);
  if (out.form != DeltaForm::kSparse || dense.size() < out.payload.size()) {
    out.form = DeltaForm::kXor;
    out.payload = std::move(dense);
  }
  return out;
}

void decode_bucket(const EncodedBucket& enc, void* inout, size_t n, int element_bytes) {
  decode_bucket(enc.form, enc.bytes, enc.base_hash, enc.hash, enc.payload, inout, n, element_bytes);
}

void decode_bucket(DeltaForm form, uint64_t bytes, uint64_t base_hash, uint64_t hash, const std::string& payload,
                   void* inout_v, size_t n, int e) {
  struct {
    DeltaForm form;
    uint64_t base_hash, hash;
    const std::string& payload;
  } enc{form, base_hash, hash, payload};
  check_sizes(n, e);
  if (bytes != n)
    throw DeltaMismatch(fmt::format("delta sync: an encoding of {} bytes for a bucket of {}", bytes, n));
  auto* inout = static_cast<uint8_t*>(inout_v);
  const size_t m = n / static_cast<size_t>(e);
  auto result_mismatch = [&] {
    return DeltaMismatch(fmt::format("delta sync: the {} bucket decoded to other bytes than the sender's (hash "
                                     "{:016x}, expected {:016x})",
                                     delta_form_name(enc.form), bucket_hash(inout, n), enc.hash));
  };
  if (enc.form == DeltaForm::kFull) {
    uint8_t* planes = scratch(n, 0);
    decompress(enc.payload, planes, n, "full");
    uint8_t* bytes = scratch(n, 1);
    from_planes(planes, m, e, bytes);
    if (bucket_hash(bytes, n) != enc.hash)
      throw DeltaMismatch(fmt::format("delta sync: the full bucket's bytes do not hash to the sender's {:016x}",
                                      enc.hash));
    std::memcpy(inout, bytes, n);
    return;
  }
  if (enc.form != DeltaForm::kXor && enc.form != DeltaForm::kSparse)
    throw DeltaMismatch(fmt::format("delta sync: unknown form {}", static_cast<int>(enc.form)));
  const uint64_t have = bucket_hash(inout, n);
  if (have != enc.base_hash)
    throw DeltaMismatch(fmt::format("delta sync: this copy of the bucket (hash {:016x}) is not the one the delta was "
                                    "made against ({:016x})",
                                    have, enc.base_hash));
  if (enc.form == DeltaForm::kXor) {
    uint8_t* planes = scratch(n, 0);
    decompress(enc.payload, planes, n, "xor");
    uint8_t* x = scratch(n, 1);
    from_planes(planes, m, e, x);
    xor_into(inout, x, n);
    if (bucket_hash(inout, n) != enc.hash) {
      const DeltaMismatch err = result_mismatch();
      xor_into(inout, x, n);  // back to the base
      throw err;
    }
    return;
  }
  // Sparse: the raw form's size is not declared up front; it is at most the count's varint, a
  // 10-byte gap and the value of every element.
  const uint64_t bound = 10 + static_cast<uint64_t>(m) * (10 + static_cast<uint64_t>(e));
  const unsigned long long declared = ZSTD_getFrameContentSize(enc.payload.data(), enc.payload.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR || declared == ZSTD_CONTENTSIZE_UNKNOWN || declared > bound)
    throw DeltaMismatch("delta sync: a sparse payload without a frame of a size its bucket allows");
  std::vector<uint8_t> raw(static_cast<size_t>(declared));
  decompress(enc.payload, raw.data(), raw.size(), "sparse");
  const uint8_t* at = raw.data();
  const uint8_t* end = raw.data() + raw.size();
  uint64_t count = 0;
  if (!get_varint(at, end, count) || count > m)
    throw DeltaMismatch("delta sync: a sparse payload with a bad count of elements");
  std::vector<uint64_t> index(static_cast<size_t>(count));
  uint64_t next_min = 0;
  for (uint64_t& i : index) {
    uint64_t gap = 0;
    if (!get_varint(at, end, gap) || gap >= m || next_min + gap >= m)
      throw DeltaMismatch("delta sync: a sparse payload with an index outside its bucket");
    i = next_min + gap;
    next_min = i + 1;
  }
  if (static_cast<uint64_t>(end - at) != count * static_cast<uint64_t>(e))
    throw DeltaMismatch("delta sync: a sparse payload whose values do not match its count");
  std::vector<uint8_t> values(static_cast<size_t>(count) * static_cast<size_t>(e));
  from_planes(at, static_cast<size_t>(count), e, values.data());
  auto apply = [&] {  // XOR is its own inverse: applied twice, the base is back
    for (size_t k = 0; k < index.size(); ++k) {
      uint8_t* dst = inout + index[k] * static_cast<uint64_t>(e);
      const uint8_t* v = values.data() + k * static_cast<size_t>(e);
      for (int p = 0; p < e; ++p) dst[p] ^= v[p];
    }
  };
  apply();
  if (bucket_hash(inout, n) != enc.hash) {
    const DeltaMismatch err = result_mismatch();
    apply();
    throw err;
  }
}

}  // namespace tiller::sync
