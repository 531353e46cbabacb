// Paged KV cache bookkeeping: which fixed-size blocks of the cache each sequence owns.
//
// The cache is num_blocks blocks of block_size token slots (per layer, K and V; the model runner
// owns the tensors). A sequence's BlockTable lists its blocks in token order: token t lies in
// blocks[t / block_size] at slot t % block_size. Blocks are reference counted: fork() gives the
// n samples of a prompt the prompt's blocks without copying, and the first write into a shared,
// partly filled block gives the writer a private copy (copy-on-write: append() reports the block
// copy the runner must make before the step).
//
// Running out of blocks is an ordinary outcome: append() returns false and changes nothing, and
// the scheduler answers by preempting a sequence. Host-side only; not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tiller::engine {

using BlockId = int32_t;

struct BlockTable {
  std::vector<BlockId> blocks;
  int64_t tokens = 0;  // token slots in use (the last block may be partly filled)
};

// Slots [0, count) of block `from` are to be copied into block `to` before the step runs.
struct BlockCopy {
  BlockId from = 0;
  BlockId to = 0;
  int64_t count = 0;
};

class KvBlockManager {
 public:
  KvBlockManager(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  double usage() const;  // fraction of blocks in use
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }
  int ref_count(BlockId b) const { return refs_.at(static_cast<std::size_t>(b)); }

  // Free blocks that append(table, new_tokens) would take (new blocks plus a copy-on-write one).
  int64_t blocks_needed(const BlockTable& table, int64_t new_tokens) const;
  // Blocks that release(table) would return to the free list (those only this table holds).
  int64_t blocks_freed_by(const BlockTable& table) const;

  // Extends `table` by `new_tokens` slots. Appends a copy to `copies` when the write would go
  // into a shared block. Returns false, changing nothing, when the free blocks do not suffice.
  bool append(BlockTable& table, int64_t new_tokens, std::vector<BlockCopy>& copies);
  // A table sharing every block of `parent` (one more reference each).
  BlockTable fork(const BlockTable& parent);
  // Drops the table's references; blocks nobody references any more become free. Empties it.
  void release(BlockTable& table);
  // Keeps the table's first `tokens` slots (<= its tokens), dropping the blocks past them. A write
  // into the kept last block later copies it first if it is shared (append()).
  void truncate(BlockTable& table, int64_t tokens);

 private:
  BlockId take();
  void drop(BlockId b);

  int64_t block_size_;
  std::vector<int> refs_;
  std::vector<BlockId> free_;  // a stack: recently freed blocks are reused first
};

}  // namespace tiller::engine
