#include "tiller/engine/kv_block_manager.h"

#include <algorithm>

#include "tiller/core/error.h"

namespace tiller::engine {

KvBlockManager::KvBlockManager(int64_t num_blocks, int64_t block_size) : block_size_(block_size) {
  TILLER_CHECK(num_blocks > 0 && block_size > 0, "KV cache of {} blocks of {} tokens", num_blocks, block_size);
  TILLER_CHECK(num_blocks < (int64_t{1} << 31), "{} KV blocks do not fit a 32-bit block id", num_blocks);
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<BlockId>(b));
}

double KvBlockManager::usage() const {
  return 1.0 - static_cast<double>(num_free()) / static_cast<double>(num_blocks());
}

int64_t KvBlockManager::blocks_needed(const BlockTable& t, int64_t new_tokens) const {
  TILLER_CHECK(new_tokens >= 0, "append of {} tokens", new_tokens);
  const int64_t grow = blocks_for(t.tokens + new_tokens) - static_cast<int64_t>(t.blocks.size());
  const bool cow = new_tokens > 0 && t.tokens % block_size_ != 0 && ref_count(t.blocks.back()) > 1;
  return std::max<int64_t>(grow, 0) + (cow ? 1 : 0);
}

int64_t KvBlockManager::blocks_freed_by(const BlockTable& t) const {
  int64_t n = 0;
  for (BlockId b : t.blocks) n += ref_count(b) == 1 ? 1 : 0;
  return n;
}

bool KvBlockManager::append(BlockTable& t, int64_t new_tokens, std::vector<BlockCopy>& copies) {
  if (blocks_needed(t, new_tokens) > num_free()) return false;
  if (new_tokens == 0) return true;
  const int64_t filled = t.tokens % block_size_;
  if (filled != 0 && ref_count(t.blocks.back()) > 1) {
    const BlockId shared = t.blocks.back();
    const BlockId own = take();
    copies.push_back({shared, own, filled});
    drop(shared);
    t.blocks.back() = own;
  }
  t.tokens += new_tokens;
  while (static_cast<int64_t>(t.blocks.size()) < blocks_for(t.tokens)) t.blocks.push_back(take());
  return true;
}

BlockTable KvBlockManager::fork(const BlockTable& parent) {
  for (BlockId b : parent.blocks) {
    TILLER_CHECK(ref_count(b) > 0, "fork of a table holding free block {}", b);
    ++refs_[static_cast<size_t>(b)];
  }
  return parent;
}

void KvBlockManager::release(BlockTable& t) {
  for (BlockId b : t.blocks) drop(b);
  t.blocks.clear();
  t.tokens = 0;
}

void KvBlockManager::truncate(BlockTable& t, int64_t tokens) {
  TILLER_CHECK(tokens >= 0 && tokens <= t.tokens, "truncate of a table of {} tokens to {}", t.tokens, tokens);
  const auto keep = static_cast<size_t>(blocks_for(tokens));
  for (size_t i = keep; i < t.blocks.size(); ++i) drop(t.blocks[i]);
  t.blocks.resize(keep);
  t.tokens = tokens;
}

BlockId KvBlockManager::take() {
  TILLER_CHECK(!free_.empty(), "no free KV block (callers check blocks_needed first)");
  const BlockId b = free_.back();
  free_.pop_back();
  refs_[static_cast<size_t>(b)] = 1;
  return b;
}

void KvBlockManager::drop(BlockId b) {
  int& r = refs_.at(static_cast<size_t>(b));
  TILLER_CHECK(r > 0, "KV block {} released more often than taken", b);
  if (--r == 0) free_.push_back(b);
}

}  // namespace tiller::engine
