#include "engine/step_batch.h"

#include <cstring>

#include "tiller/core/error.h"

namespace tiller::engine {
namespace {

class Writer {
 public:
  void put(int64_t v) { out_.push_back(v); }
  void put_list(const std::vector<int64_t>& v) {
    put(static_cast<int64_t>(v.size()));
    out_.insert(out_.end(), v.begin(), v.end());
  }
  void put_floats(const std::vector<float>& v) {
    put(static_cast<int64_t>(v.size()));
    for (float f : v) {
      int32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      put(bits);
    }
  }
  std::vector<int64_t> take() { return std::move(out_); }

 private:
  std::vector<int64_t> out_;
};

class Reader {
 public:
  explicit Reader(const std::vector<int64_t>& in) : in_(in) {}
  int64_t get() {
    TILLER_CHECK(pos_ < in_.size(), "step message truncated at word {}", pos_);
    return in_[pos_++];
  }
  int64_t count() {
    const int64_t n = get();
    TILLER_CHECK(n >= 0 && static_cast<size_t>(n) <= in_.size() - pos_, "step message: bad length {} at word {}", n,
                 pos_ - 1);
    return n;
  }
  std::vector<int64_t> get_list() {
    const int64_t n = count();
    std::vector<int64_t> v(in_.begin() + static_cast<std::ptrdiff_t>(pos_),
                           in_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  std::vector<float> get_floats() {
    std::vector<float> v(static_cast<size_t>(count()));
    for (float& f : v) {
      const auto bits = static_cast<int32_t>(get());
      std::memcpy(&f, &bits, sizeof f);
    }
    return v;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  const std::vector<int64_t>& in_;
  size_t pos_ = 0;
};

}  // namespace

bool StepBatch::is_decode() const {
  for (int64_t l : lens_q)
    if (l != 1) return false;
  return !lens_q.empty();
}

std::vector<int64_t> StepBatch::encode() const {
  TILLER_CHECK(prev_rows.empty(), "a step with tokens still on the device cannot be sent to TP followers");
  Writer w;
  w.put_list(tokens);
  w.put_list(positions);
  w.put_list(lens_q);
  w.put_list(lens_k);
  for (const auto& t : tables) w.put_list(std::vector<int64_t>(t.begin(), t.end()));
  w.put(static_cast<int64_t>(copies.size()));
  for (const auto& c : copies) {
    w.put(c.from);
    w.put(c.to);
    w.put(c.count);
  }
  w.put_list(sample_rows);
  w.put_floats(sampling.temperature);
  w.put_floats(sampling.top_p);
  w.put_list(sampling.top_k);
  w.put_floats(sampling.min_p);
  w.put_floats(sampling.uniform);
  return w.take();
}

StepBatch StepBatch::decode(const std::vector<int64_t>& message) {
  Reader r(message);
  StepBatch b;
  b.tokens = r.get_list();
  b.positions = r.get_list();
  b.lens_q = r.get_list();
  b.lens_k = r.get_list();
  TILLER_CHECK(b.lens_q.size() == b.lens_k.size(), "step message: {} query lengths, {} key lengths", b.lens_q.size(),
               b.lens_k.size());
  for (size_t i = 0; i < b.lens_q.size(); ++i) {
    std::vector<int64_t> t = r.get_list();
    b.tables.emplace_back(t.begin(), t.end());
  }
  const int64_t copies = r.count();
  for (int64_t i = 0; i < copies; ++i) {
    BlockCopy c;
    c.from = static_cast<BlockId>(r.get());
    c.to = static_cast<BlockId>(r.get());
    c.count = r.get();
    b.copies.push_back(c);
  }
  b.sample_rows = r.get_list();
  b.sampling.temperature = r.get_floats();
  b.sampling.top_p = r.get_floats();
  b.sampling.top_k = r.get_list();
  b.sampling.min_p = r.get_floats();
  b.sampling.uniform = r.get_floats();
  TILLER_CHECK(r.done(), "step message has trailing words");
  return b;
}

}  // namespace tiller::engine
