// Ring attention over key blocks for a sequence-parallel group (issue #48, ARCHITECTURE.md §16): no rank ever holds
// the whole sequence's K/V or their gradient sums. Each rank keeps its zig-zag shard's K/V; the blocks travel around
// the ring (Communicator::ring_shift), one in flight per rank, and every one of the rank's query chunks merges its
// attention over each block by log-sum-exp (merge_key_block). The backward recomputes that merge, then the blocks go
// round again with their dK/dV sums, to which every rank adds its queries' share (key_block_backward, with each row's
// log-sum-exp and rowsum(dO * O), the merged outputs released); after the full circle one more hop brings each block's sums home. dQ stays on the
// rank. StreamBP's chunk loop runs inside each hop. On packed rows each query merges only its own sequence's keys, and a
// part of a block that no query of a chunk's row sees is skipped and counted (ring_blocks.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/model/chunk_attention.h"
#include "core/model/kv_source.h"
#include "core/model/sequence_shard.h"
#include "core/training/communicator.h"
#include "core/training/ring_blocks.h"

namespace sbp {

class RingExchange : public KVSource {
 public:
  // `comm`: the group (its ranks are the shards'); it must outlive this. The zig-zag split of seq_len positions.
  RingExchange(Communicator& comm, std::int64_t seq_len);
  const SequenceShard& shard() const { return shards_[std::size_t(comm_.rank())]; }
  // The longest shard's positions: what every block travels padded to.
  std::int64_t padded_length() const { return padded_; }

  SequenceShard shard_of(std::int64_t rows) const override;
  bool is_local() const override { return false; }
  at::Tensor own_positions(const at::Tensor& whole, std::int64_t dim) const override;
  void sum_over_group(at::Tensor& values) override;
  at::Tensor attend_shard(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionRule& rule) override;
  void stream_forward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, StreamedForward& layer) override;
  at::Tensor stream_backward(at::Tensor kv, std::int64_t c, const AttentionRule& rule, c10::ScalarType sum_dtype,
                             StreamedBackward& layer) override;

  // The attention of queries `q` (one per chunk of this rank's rows `chunks`, [B, n_h, c, hd]) over every key, the
  // blocks `kv` ([2, B, n_kv, padded, hd], this rank's) going round: each chunk's merged output and log-sum-exp. On
  // packed rows (rule.packed) each query merges only the keys of its own sequence; a part of a block that no query of
  // a chunk's row sees is skipped (block_counts).
  struct Merged {
    std::vector<at::Tensor> o, lse;  // per chunk: [B, n_h, c, hd] (>= fp32), [B, n_h, c]
  };
  Merged ring_forward(const std::vector<ChunkRows>& chunks, const std::vector<at::Tensor>& q, const at::Tensor& kv,
                      const AttentionRule& rule);
  // Its backward given every chunk's dO (in the model dtype or wider; widened part by part where narrower, which
  // loses nothing) and its rows' log-sum-exps and rowsum(dO * O) (output_rowsum: the merged outputs need not be kept):
  // adds each chunk's dq into `dq` (>= fp32, as Merged::o) and returns the
  // sums of this rank's own keys' gradients [2, B, n_kv, padded, hd] in `sum_dtype`, home after the circle.
  at::Tensor ring_backward(const std::vector<ChunkRows>& chunks, const std::vector<at::Tensor>& q,
                           const std::vector<at::Tensor>& grad_o, const std::vector<BackwardRows>& rows, const at::Tensor& kv,
                           const AttentionRule& rule, c10::ScalarType sum_dtype, std::vector<at::Tensor>& dq);
  // What the backward holds of a chunk's dO [B, n_h, c, hd] for the whole ring pass: the gradient as it comes, in the
  // model dtype (in bf16 its values are bf16, so widening it part by part loses nothing). Tests widen it to the merge
  // dtype, the buffers held before, to show both give the same bits.
  virtual at::Tensor held_grad_output(at::Tensor grad_o) const { return grad_o; }
  // Every pass so far of this rank (each ring_forward and ring_backward): key blocks computed and skipped.
  const RingBlockCounts& block_counts() const { return counts_; }

 protected:
  // What a hop carries.
  enum class Cargo { keys, key_gradients, home };
  // One hop: `block` to the next rank, the previous rank's returned. `hop` counts the hops of this pass from 0
  // (the home hop of the gradients is hop N - 1). Tests subclass it to break the ring (faults live there).
  virtual at::Tensor pass_on(const at::Tensor& block, Cargo cargo, int hop);
  Communicator& group() { return comm_; }

 private:
  // Whose block a rank holds after `hop` hops: rank - hop (mod N).
  const SequenceShard& owner(int hop) const;

  Communicator& comm_;
  std::vector<SequenceShard> shards_;
  std::int64_t padded_ = 0;
  RingBlockCounts counts_;
};

}  // namespace sbp
