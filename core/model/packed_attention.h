// Causal attention over packed rows (packed_rows.h): each sequence attends causally within itself only
// (ARCHITECTURE.md §4 "Packed rows"). Queries [q_start, e) of a row are cut where a sequence starts; each run attends
// the keys of its own sequence with the one causal dispatch every caller shares (prefix_attention), so that:
//  - keys before the start of the chunk's earliest sequence are never read (skipped, not masked: masking them would
//    still pay their FLOPs), and the attention work is the sum over sequences of their causal triangles;
//  - a chunk that spans a boundary needs no mask: each run is a prefix block and a square causal block of its own
//    sequence;
//  - no [T, T] (or [c, e]) mask exists anywhere.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace sbp {

class PackedRows;
struct KVGradSums;  // core/model/chunk_attention.h

// q: [B, n_h, c, hd] at positions [q_start, q_start + c) of each row; k, v: [B, n_kv, q_start + c, hd], the keys
// [0, q_start + c) -> o: [B, n_h, c, hd]. Differentiable in q, and in k, v unless `sums` is given (then the gradients
// of the keys each run read are added into sums->dK/dV at their positions, [B, n_kv, >= q_start + c, hd]).
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::int64_t q_start,
                            double scale, const KVGradSums* sums, const PackedRows& rows);

}  // namespace sbp
