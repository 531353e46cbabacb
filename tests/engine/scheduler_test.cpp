// The engine's host-side core without a model: KV block bookkeeping (sharing, copy-on-write,
// exhaustion) and the continuous-batching scheduler (budgets, chunked prefill, preemption,
// first-come-first-served admission), including a simulation that runs many mixed requests to
// completion through both.
#include <map>
#include <random>

#include <gtest/gtest.h>

#include "engine/kv_sizing.h"
#include "tiller/core/error.h"
#include "tiller/engine/kv_block_manager.h"
#include "tiller/engine/scheduler.h"

namespace tiller::engine {
namespace {

// The KV cache's size from free memory (kv_sizing.h): the fraction, unless a step of
// max_batched_tokens needs more room for its activations than the fraction leaves.
TEST(KvSizing, AStepsActivationsKeepTheirRoom) {
  const model::ModelConfig c = model::preset("qwen2-7b");
  const int64_t gib = int64_t{1} << 30;
  // Qwen2.5-7B, bf16, TP 1: per token 3 x 3584 + 3 x 18944 (the MLP's rows outweigh attention's).
  EXPECT_EQ(step_activation_bytes(c, 1, 2, 1, 0), (3 * 3584 + 3 * 18944) * 2);
  EXPECT_EQ(step_activation_bytes(c, 1000, 2, 2, 0), 1000 * (3 * 3584 + 3 * 18944 / 2) * 2);  // TP 2: half the MLP
  EXPECT_EQ(step_activation_bytes(c, 100, 2, 1, 256) - step_activation_bytes(c, 100, 2, 1, 0),
            2 * 100 * c.vocab_size * 4);  // logits of at most the step's tokens
  // The 64 x 4,096-token step that ran out of memory on an H200 (~18.5 GiB measured): bounded above it.
  const int64_t big = step_activation_bytes(c, 64 * 4096, 2, 1, 256);
  EXPECT_GT(big, 18 * gib + gib / 2);
  EXPECT_LT(big, 40 * gib);
  const int64_t block = 2 * 28 * 16 * 1024;  // 7B: 28 layers, 16 tokens, 512 K + 512 V elements of 2 bytes
  // Default batched tokens: the fraction decides.
  const int64_t small = step_activation_bytes(c, 8192, 2, 1, 256);
  EXPECT_EQ(kv_blocks_for(125 * gib, 0.85, block, small), static_cast<int64_t>(125.0 * gib * 0.85) / block);
  // A 262,144-token step: the activations decide, and the cache leaves them their room.
  const int64_t blocks = kv_blocks_for(125 * gib, 0.85, block, big);
  EXPECT_EQ(blocks, (125 * gib - big) / block);
  EXPECT_GE(125 * gib - blocks * block, big);
  EXPECT_EQ(kv_blocks_for(10 * gib, 0.85, block, big), 0);  // nothing left: the engine refuses, naming the key
  EXPECT_EQ(kv_blocks_for(0, 0.85, block, 0), 0);
}

TEST(KvBlockManager, AppendAllocatesBlocksAsTokensArrive) {
  KvBlockManager kv(8, 4);
  BlockTable t;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.append(t, 5, copies));  // 5 tokens: 2 blocks
  EXPECT_EQ(t.blocks.size(), 2u);
  EXPECT_EQ(t.tokens, 5);
  EXPECT_EQ(kv.num_free(), 6);
  EXPECT_EQ(kv.blocks_needed(t, 3), 0);  // fills block 2
  EXPECT_EQ(kv.blocks_needed(t, 4), 1);
  ASSERT_TRUE(kv.append(t, 3, copies));
  EXPECT_EQ(kv.num_free(), 6);
  EXPECT_TRUE(copies.empty());
  EXPECT_DOUBLE_EQ(kv.usage(), 0.25);
  kv.release(t);
  EXPECT_EQ(kv.num_free(), 8);
  EXPECT_TRUE(t.blocks.empty());
}

TEST(KvBlockManager, ExhaustionChangesNothing) {
  KvBlockManager kv(3, 4);
  BlockTable a, b;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.append(a, 8, copies));
  EXPECT_FALSE(kv.append(b, 5, copies));  // needs 2, 1 free
  EXPECT_TRUE(b.blocks.empty());
  EXPECT_EQ(b.tokens, 0);
  EXPECT_EQ(kv.num_free(), 1);
  EXPECT_TRUE(kv.append(b, 4, copies));
  EXPECT_EQ(kv.num_free(), 0);
}

TEST(KvBlockManager, SamplesSharePromptBlocksAndCopyOnWrite) {
  KvBlockManager kv(16, 4);
  BlockTable prompt;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.append(prompt, 6, copies));  // blocks: full + half
  std::vector<BlockTable> samples;
  for (int i = 0; i < 3; ++i) samples.push_back(kv.fork(prompt));
  kv.release(prompt);  // the prompt's own table goes; the samples keep the blocks
  EXPECT_EQ(kv.num_free(), 14);
  EXPECT_EQ(kv.ref_count(samples[0].blocks[0]), 3);
  EXPECT_EQ(kv.blocks_freed_by(samples[0]), 0);
  // Each sample's first generated token goes into the shared, half-filled block: a private copy.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(kv.blocks_needed(samples[i], 1), i < 2 ? 1 : 0) << i;  // the last holder owns it alone
    ASSERT_TRUE(kv.append(samples[i], 1, copies));
  }
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].from, copies[1].from);
  EXPECT_EQ(copies[0].count, 2);
  EXPECT_NE(samples[0].blocks[1], samples[1].blocks[1]);
  EXPECT_EQ(samples[2].blocks[1], copies[0].from);  // kept the original
  EXPECT_EQ(samples[0].blocks[0], samples[2].blocks[0]);  // full blocks stay shared
  EXPECT_EQ(kv.ref_count(samples[0].blocks[0]), 3);
  for (auto& s : samples) kv.release(s);
  EXPECT_EQ(kv.num_free(), 16);
}

TEST(KvBlockManager, ForkAtABlockBoundaryNeedsNoCopy) {
  KvBlockManager kv(8, 4);
  BlockTable prompt;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.append(prompt, 8, copies));
  BlockTable s = kv.fork(prompt);
  ASSERT_TRUE(kv.append(s, 1, copies));
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(s.blocks.size(), 3u);
  kv.release(s);
  kv.release(prompt);
  EXPECT_EQ(kv.num_free(), 8);
  EXPECT_THROW(kv.release(prompt = BlockTable{{0}, 1}), Error);  // block 0 is free: a broken invariant
}

// Running sequences with their tables, as the engine would hold them.
struct Fixture {
  KvBlockManager kv;
  std::map<int64_t, BlockTable> tables;
  std::vector<SeqState> running, waiting;
  explicit Fixture(int64_t blocks, int64_t block_size = 4) : kv(blocks, block_size) {}
  void run(int64_t id, int64_t tokens, int64_t computed) {
    std::vector<BlockCopy> c;
    EXPECT_TRUE(kv.append(tables[id], computed, c));
    running.push_back({id, tokens, computed, &tables[id]});
  }
  void wait(int64_t id, int64_t tokens) { waiting.push_back({id, tokens, 0, nullptr}); }
};

TEST(Scheduler, DecodesFirstThenAdmitsInOrderWithinTheLimits) {
  Fixture f(64);
  f.run(1, 10, 9);  // decoding
  f.run(2, 7, 6);
  f.wait(3, 5);
  f.wait(4, 6);
  f.wait(5, 3);
  const StepPlan p = schedule({/*max_num_seqs=*/4, /*max_batched_tokens=*/100, true}, f.running, f.waiting, f.kv);
  ASSERT_EQ(p.chunks.size(), 4u);
  EXPECT_EQ(p.chunks[0].id, 1);
  EXPECT_EQ(p.chunks[0].start, 9);
  EXPECT_EQ(p.chunks[0].count, 1);
  EXPECT_EQ(p.chunks[2].id, 3);
  EXPECT_EQ(p.chunks[2].count, 5);
  EXPECT_EQ(p.admitted, (std::vector<int64_t>{3, 4}));  // max_num_seqs 4: sequence 5 waits
  EXPECT_EQ(p.num_tokens, 1 + 1 + 5 + 6);
  EXPECT_TRUE(p.preempted.empty());
}

TEST(Scheduler, ChunkedPrefillSplitsALongPromptOverSteps) {
  Fixture f(64);
  f.run(1, 20, 19);
  f.wait(2, 30);
  StepPlan p = schedule({8, 12, true}, f.running, f.waiting, f.kv);
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[1].id, 2);
  EXPECT_EQ(p.chunks[1].count, 11);  // what the decode left of the budget
  // Without chunking the prompt does not fit the budget and waits, blocking those behind it.
  f.wait(3, 2);
  p = schedule({8, 12, false}, f.running, f.waiting, f.kv);
  EXPECT_EQ(p.chunks.size(), 1u);
  EXPECT_TRUE(p.admitted.empty());
  // A running sequence mid-prefill continues from where it is.
  Fixture g(64);
  g.run(7, 30, 11);
  p = schedule({8, 12, true}, g.running, g.waiting, g.kv);
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].start, 11);
  EXPECT_EQ(p.chunks[0].count, 12);
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOut) {
  Fixture f(4, 4);  // 16 slots
  f.run(1, 9, 8);   // 2 blocks, next token needs a third
  f.run(2, 5, 4);   // 1 block, next token needs a second
  f.run(3, 4, 3);   // 1 block, fits
  f.wait(4, 2);
  const StepPlan p = schedule({8, 100, true}, f.running, f.waiting, f.kv);
  // Sequence 1 needs 1 block, none is free: 3 (newest) is preempted and frees one. Sequence 2
  // then needs one more: it is the newest left, so it preempts itself.
  EXPECT_EQ(p.preempted, (std::vector<int64_t>{3, 2}));
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].id, 1);
  EXPECT_TRUE(p.admitted.empty());  // no admission in a step that preempted
}

TEST(Scheduler, SharedBlocksAreNotCountedAsFreedByPreemption) {
  Fixture f(3, 4);
  f.run(1, 5, 4);  // 1 block, needs a second for its next token
  std::vector<BlockCopy> c;
  f.tables[2] = f.kv.fork(f.tables[1]);  // a sample sharing sequence 1's block
  f.running.push_back({2, 5, 4, &f.tables[2]});
  ASSERT_TRUE(f.kv.append(f.tables[2], 0, c));
  BlockTable filler;
  ASSERT_TRUE(f.kv.append(filler, 8, c));  // the other 2 blocks belong to someone else
  const StepPlan p = schedule({8, 100, true}, f.running, f.waiting, f.kv);
  // Preempting 2 frees nothing (its block is shared), so 1 cannot run either and preempts itself.
  EXPECT_EQ(p.preempted, (std::vector<int64_t>{2, 1}));
  EXPECT_TRUE(p.chunks.empty());
}

// Many requests of mixed lengths through the scheduler and the block manager, as an engine with
// a fake model would run them: every one completes with its length, blocks are never
// over-committed, and the cache is empty at the end.
TEST(KvBlockManager, TruncateKeepsThePrefixAndCopiesASharedLastBlockOnWrite) {
  KvBlockManager kv(16, 4);
  BlockTable a;
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(kv.append(a, 10, copies));  // 3 blocks
  BlockTable b = kv.fork(a);
  kv.truncate(a, 5);                       // blocks 0-1 kept, block 2 dropped by a
  EXPECT_EQ(a.blocks.size(), 2u);
  EXPECT_EQ(a.tokens, 5);
  EXPECT_EQ(kv.ref_count(b.blocks[2]), 1);
  EXPECT_EQ(kv.blocks_needed(a, 1), 1);    // the kept half block is shared with b: copy on write
  ASSERT_TRUE(kv.append(a, 1, copies));
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].count, 1);
  kv.release(a);
  kv.release(b);
  EXPECT_EQ(kv.num_free(), 16);
  EXPECT_THROW(kv.truncate(a, 1), Error);
}

// Parked sessions give their blocks up before a running sequence is preempted, and before a
// waiting one is left out, oldest first; while blocks suffice they stay.
TEST(Scheduler, ParkedSessionsAreEvictedBeforeAnythingIsPreempted) {
  SchedulerLimits limits;
  limits.max_num_seqs = 8;
  limits.max_batched_tokens = 64;
  KvBlockManager kv(6, 4);
  std::vector<BlockCopy> copies;
  BlockTable run, old_session, new_session;
  ASSERT_TRUE(kv.append(run, 8, copies));          // 2 blocks, full
  ASSERT_TRUE(kv.append(old_session, 7, copies));  // 2 blocks
  ASSERT_TRUE(kv.append(new_session, 4, copies));  // 1 block
  const std::vector<SeqState> parked{{10, 8, 7, &old_session, 1}, {11, 5, 4, &new_session, 1}};
  // The running sequence's next token needs a block and one is free: nobody is evicted.
  StepPlan p = schedule(limits, {{1, 9, 8, &run, 1}}, {}, kv, parked);
  EXPECT_TRUE(p.evicted.empty());
  EXPECT_TRUE(p.preempted.empty());
  // A 9-token prompt waiting (3 blocks, 0 free after the decode): the oldest session goes first,
  // then the next, and it is admitted.
  p = schedule(limits, {{1, 9, 8, &run, 1}}, {{2, 9, 0, nullptr, 1}}, kv, parked);
  EXPECT_EQ(p.evicted, (std::vector<int64_t>{10, 11}));
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(p.admitted, (std::vector<int64_t>{2}));
  // Eviction would free too little for the waiting prompt: the sessions stay, nothing is preempted.
  p = schedule(limits, {{1, 9, 8, &run, 1}}, {{2, 20, 0, nullptr, 1}}, kv, parked);
  EXPECT_TRUE(p.admitted.empty());
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_TRUE(p.evicted.empty());
  // A running sequence that needs more than is free takes the sessions' blocks, oldest first.
  BlockTable big;
  ASSERT_TRUE(kv.append(big, 4, copies));  // the last free block
  p = schedule(limits, {{1, 9, 8, &run, 1}, {3, 5, 4, &big, 1}}, {}, kv, parked);
  EXPECT_EQ(p.evicted, (std::vector<int64_t>{10}));
  EXPECT_TRUE(p.preempted.empty());
  kv.release(big);
  kv.release(run);
  kv.release(old_session);
  kv.release(new_session);
}

TEST(Scheduler, SimulatedRequestsAllComplete) {
  for (bool chunked : {true, false}) {
    // Without chunked prefill, a preempted sequence is recomputed in one step: the budget must
    // hold prompt + max_new (<= 50 here), which the engine checks when a request arrives.
    KvBlockManager kv(40, 4);
    const SchedulerLimits limits{6, chunked ? 24 : 50, chunked};
    struct Req {
      int64_t id, prompt, max_new, generated = 0;
      BlockTable table;
      int64_t computed = 0;
    };
    std::mt19937 rng(3);
    std::map<int64_t, Req> reqs;
    std::vector<int64_t> running, waiting;
    for (int64_t id = 0; id < 40; ++id) {
      reqs[id] = Req{id, 1 + static_cast<int64_t>(rng() % 20), 1 + static_cast<int64_t>(rng() % 30)};
      waiting.push_back(id);
    }
    int steps = 0, preemptions = 0;
    while (!running.empty() || !waiting.empty()) {
      ASSERT_LT(++steps, 5000) << "no progress, chunked " << chunked;
      std::vector<SeqState> rs, ws;
      for (int64_t id : running) rs.push_back({id, reqs[id].prompt + reqs[id].generated, reqs[id].computed, &reqs[id].table});
      for (int64_t id : waiting) ws.push_back({id, reqs[id].prompt + reqs[id].generated, 0, nullptr});
      const StepPlan p = schedule(limits, rs, ws, kv);
      ASSERT_LE(p.num_tokens, limits.max_batched_tokens);
      for (int64_t id : p.preempted) {
        kv.release(reqs[id].table);
        reqs[id].computed = 0;
        running.erase(std::find(running.begin(), running.end(), id));
        waiting.insert(waiting.begin(), id);  // preempted go first when space returns
        ++preemptions;
      }
      for (int64_t id : p.admitted) {
        waiting.erase(std::find(waiting.begin(), waiting.end(), id));
        running.push_back(id);
      }
      ASSERT_LE(static_cast<int64_t>(running.size()), limits.max_num_seqs);
      std::vector<BlockCopy> copies;
      for (const auto& c : p.chunks) {
        Req& r = reqs[c.id];
        ASSERT_EQ(c.start, r.computed);
        ASSERT_TRUE(kv.append(r.table, c.count, copies)) << "scheduled beyond the free blocks";
        r.computed += c.count;
        if (r.computed == r.prompt + r.generated) ++r.generated;  // the step samples a token
      }
      for (auto it = running.begin(); it != running.end();) {
        Req& r = reqs[*it];
        if (r.generated == r.max_new) {
          kv.release(r.table);
          it = running.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const auto& [id, r] : reqs) EXPECT_EQ(r.generated, r.max_new) << id;
    EXPECT_EQ(kv.num_free(), kv.num_blocks());
    EXPECT_GT(preemptions, 0) << "the cache is small enough that some requests are preempted";
  }
}

}  // namespace
}  // namespace tiller::engine
