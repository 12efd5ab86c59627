/*
 * moe_experts_down.cu - tm_experts_down_accumulate: the shared expert's down and every slot's in one launch, the
 * residual summed in the order of the two launches it stands for (moe.cuh; the kernel's comment below).
 */
#include "rgu_timeline.cuh"
#include "moe.cuh"

namespace tm_cuda {
namespace {

// The dot products dot(W_down[e][ra], act[t, s]) and dot(W_down[e][ra + 1], act[t, s]) of slot s (expert e):
// two rows of one expert share the slot's activations (one warp_dot with NR = 2, as a gate-up pair), and the
// slot's factor w_eff (NaN for an expert id out of range), through down_dots' lookups (slot_expert, slot_weight);
// not folded into down_dots itself: this code is what the H200 measured, and a shared body changes the compiler's
// register allocation. rb is ra + 1, or ra itself at the last row of an odd hidden size (computed twice, stored
// once). The slot's id is read before the dot and its weight after it (loading both ahead measured slower on the
// H100: results/NOTES.md lesson 121).
template <Fmt F, bool V, bool Q>
__device__ __forceinline__ void down_row_pair(const DownArgs& a, int64_t t, int64_t ra, int64_t rb, int64_t s,
                                              float (&d)[2][1], float& w_eff) {
  const int64_t slot = t * a.top_k + s;
  int64_t e = slot_expert(a, slot);
  const bool bad = e < 0 || e >= a.n_experts;
  if (bad) e = 0;
  const uint8_t* base = a.w_down + e * a.hidden * a.row_bytes;
  const uint8_t* wr[2] = {base + ra * a.row_bytes, base + rb * a.row_bytes};
  if constexpr (Q) {
    const uint8_t* xq[1] = {a.act_q + slot * a.act_q_stride};
    warp_dot_q8act<F, 2, 1, true, false, TM_DOWN_PF>(wr, xq, a.nblocks, d);
  } else {
    const float* xs[1] = {a.act + slot * a.ffn};
    warp_dot<F, 2, 1, true, V>(wr, xs, a.nblocks, d);
  }
  w_eff = bad ? kNaN : slot_weight(a, slot);
}

// tm_experts_down_accumulate: blocks of 8 warps for kSplitRows = 4 output rows r0 .. r0 + 3 of one token.
//   Warp w < 4 computes the shared expert's term for row r0 + w (after the gate, which each of them computes: the
//   same bits; one routed warp computing it for the block was slower on the H200, results/NOTES.md v4h).
//   Warp 4 + j computes the routed terms of the row pair r0 + 2 (j / 2), + 1 for the slots s = j % 2, j % 2 + 2, ..:
//   the pair shares each slot's activation loads, and with the slots split over two warps a routed warp reads as
//   many bytes (2 rows x 2 of 4 slots x 1408 values) as a shared warp (one 5632-value row). So no warp of a block
//   idles while the others finish, and the loads fit 64 registers: 4 blocks per SM on tiled rows, a token's grid
//   (hidden / 4 blocks) resident in one wave. In the decode chain this is 1.5 us per layer faster than v4j's shape
//   (one row x 4 slots per routed warp, 126-128 registers, 2 blocks per SM), though slower launched back to back
//   alone (kernel_bench 14.0 against 12.7 us); twice the warps did not double the throughput (results/NOTES.md,
//   v4l, lesson 23).
//   With SM (tiled rows of a multiple of 256 values, when shared memory allows) a shared warp has its row copied
//   into shared memory by the copy engine before pdl_wait and reads it there (common.cuh's bulk_row_to_smem):
//   one round trip instead of 11 dependent ones from L2 for a 5632-value row (H200, that shape alone: 7.19 ->
//   5.92 us, results/NOTES.md v4o and lesson 37); else it prefetches the row into L2.
//   Terms go to shared memory; after one barrier lane 0 of warp w adds them to x[t, r0 + w] in the order of the
//   two launches this replaces: the shared term, then the slots in order, each a rounded multiply then a rounded
//   add, from the float32 x read once; with xw it also writes the next norm's factor, and the four rows' sum of
//   squares (one group of norm.cuh's grouped sum) after a named barrier, and with xw_q xw's int8 group of the
//   block's four rows for the next qkv_rope. Q: every warp multiplies the gate-up's int8 groups (act_q) instead of
//   rounding act itself, with the reader's L2 prefetch TM_DOWN_PF batches ahead. No term's bits depend on the
//   grouping (qdot.cuh: a row's result does not depend on how many rows a warp reads at once).
constexpr int kSplitRows = kRowsPerBlock / 2;
static_assert(kSplitRows == kNormGroup, "a down block's rows are one group of the deferred norm's grouped sum");
// 4 blocks an SM on tiled rows: at 5 ptxas spills 32 bytes (results/NOTES.md lesson 144; not measured).
constexpr int down_min_blocks(Fmt s, Fmt r) {
  return fmt_tiled(s) && fmt_tiled(r) ? 4 : TM_WEIGHT_MIN_BLOCKS;
}

// Whether experts_down_kernel's shared warps read their rows from copies in shared memory (a measurement knob: 0
// prefetches them into L2 instead, the same bits). qkv_rope does not copy its rows: on the H200 it measured slower
// that way end to end (745.3 against 771.7 tok/s for the down's copies alone; results/NOTES.md v4o, lesson 37).
#ifndef TM_DOWN_ROWS_IN_SMEM
#define TM_DOWN_ROWS_IN_SMEM 1
#endif
// Bytes of experts_down_kernel's dynamic shared memory before the shared rows' copies (16-byte aligned).
__host__ __device__ inline int64_t down_rows_offset(int64_t top_k) {
  return ceil_div((kSplitRows * top_k + kSplitRows) * 4, 16) * 16;
}

// xw = x * w and x's group sums xss over [n_tokens, hidden] (the two-launch form's; norm.cuh's operations, so the
// fused kernel's bits), and with xw_q xw's int8 groups: one thread a group.
__global__ void __launch_bounds__(256) norm_factor_kernel(const float* x, const float* __restrict__ w, float* xw,
                                                          float* xss, uint8_t* xw_q, int64_t n_tokens,
                                                          int64_t hidden) {
  static_assert(kNormGroup == 4, "a norm group is one int8 group");
  pdl_begin();
  const int64_t groups = norm_groups(hidden);
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n_tokens * groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = k / groups, g = k % groups;
    const float* xt = x + t * hidden;
    float v[kNormGroup] = {};
    for (int64_t i = g * kNormGroup; i < (g + 1) * kNormGroup && i < hidden; ++i)
      xw[t * hidden + i] = v[i - g * kNormGroup] = norm_factor_xw(xt[i], __ldg(w + i));
    xss[k] = group_sum_sq([&](int64_t i) { return xt[i]; }, g, hidden);
    if (xw_q != nullptr) store_q8act(xw_q + t * q8act_bytes(hidden), g, tm_act::q8_group(v[0], v[1], v[2], v[3]));
  }
}

template <Fmt FS, bool VS, Fmt FR, bool VR, bool SM, bool Q>
__global__ void __launch_bounds__(kRowsPerBlock * 32, down_min_blocks(FS, FR))
    experts_down_kernel(DownArgs sh, DownArgs rt, const float* __restrict__ gate_inp, const float* __restrict__ h,
                        float* x, const float* __restrict__ next_norm_w, float* xw, float* xss, uint8_t* xw_q,
                        int gate_mode, int64_t tok0) {
  // [kSplitRows][top_k] routed terms, [kSplitRows] shared terms, then (SM) the shared warps' row copies
  extern __shared__ __align__(16) float down_smem[];
  __shared__ uint64_t rows_landed[kSplitRows];
  __shared__ float s_next_w[kSplitRows];  // next_norm_w of the rows lane 0 of each shared warp writes
  float* s_routed = down_smem;
  float* s_shared = down_smem + kSplitRows * rt.top_k;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = tok0 + blockIdx.y;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kSplitRows;
  const bool shared_warp = warp < kSplitRows;
  // (SM) this shared warp's row copy, formed at each use (the SASS the H200 measured)
  auto row_copy = [&]() {
    return reinterpret_cast<uint8_t*>(down_smem) + down_rows_offset(rt.top_k) + warp * sh.row_bytes;
  };
  stamp(0, kDownTimelineRow0);
  if constexpr (SM) {  // the shared expert's rows are known up front
    if (shared_warp && r0 + warp < sh.hidden && lane == 0)
      bulk_row_to_smem(row_copy(), sh.w_down + (r0 + warp) * sh.row_bytes, static_cast<uint32_t>(sh.row_bytes),
                       &rows_landed[warp]);
  } else if (shared_warp && r0 + warp < sh.hidden && t == 0) {
    prefetch_row_l2(sh.w_down + (r0 + warp) * sh.row_bytes, sh.row_bytes, lane);
  }
  // xw's weights (immutable) into shared memory before the wait: no register held across the dot, no load after it
  if (xw != nullptr && shared_warp && lane == 0 && r0 + warp < sh.hidden)
    s_next_w[warp] = __ldg(next_norm_w + r0 + warp);
  pdl_begin();
  stamp(1, kDownTimelineRow0);
  stamp_role(3, kDownTimelineRow0);
  if (shared_warp) {
    const int64_t r = r0 + warp;
    if (r < sh.hidden) {
      float gate = 1.0f;
      if (gate_mode != kGateNone) gate = shared_gate(gate_inp, h + t * sh.hidden, sh.hidden, gate_mode);
      float d[1][1], w_eff[1];
      if constexpr (SM) {
        __syncwarp();  // lane 0's barrier init before the other lanes poll it
        bulk_wait(&rows_landed[warp]);
        down_dots<FS, 1, VS, true, Q>(sh, t, r, 0, gate_mode != kGateNone, gate, d, w_eff, row_copy());
      } else {
        down_dots<FS, 1, VS, false, Q>(sh, t, r, 0, gate_mode != kGateNone, gate, d, w_eff);
      }
      if (lane == 0) s_shared[warp] = __fmul_rn(w_eff[0], d[0][0]);
    }
    stamp_latest(3, kDownTimelineRow0);
  } else {
    const int j = warp - kSplitRows, pair = 2 * (j >> 1);  // the pair's first row, relative to r0
    const int64_t ra = r0 + pair, rb = ra + 1 < rt.hidden ? ra + 1 : ra;
    if (ra < rt.hidden) {
      for (int64_t s = j & 1; s < rt.top_k; s += 2) {
        float d[2][1], w_eff;
        down_row_pair<FR, VR, Q>(rt, t, ra, rb, s, d, w_eff);
        if (lane == 0) {
          s_routed[pair * rt.top_k + s] = __fmul_rn(w_eff, d[0][0]);
          if (rb != ra) s_routed[(pair + 1) * rt.top_k + s] = __fmul_rn(w_eff, d[1][0]);
        }
      }
    }
  }
  if (!shared_warp) stamp_latest(2, kDownTimelineRow0);
  __syncthreads();
  // Lane 0 of shared warp w adds row r0 + w's terms to x; the block's rows are one group of the next
  // normalisation's grouped sum (kNormGroup == kSplitRows): with xss the four meet at a named barrier and warp 0
  // writes the group's sum beside xw. (Lane j of warp 0 adding row j instead ran 1.3 us a layer slower on the
  // H200: results/NOTES.md v12.)
  __shared__ float s_rows[kSplitRows], s_xw[kSplitRows];
  if (!shared_warp) return;
  const int64_t r = r0 + warp;
  if (lane == 0 && r < sh.hidden) {
    float* xo = x + t * sh.hidden + r;
    float acc = __fadd_rn(__ldcg(xo), s_shared[warp]);  // in place: read around L1 (common.cuh)
    for (int64_t s = 0; s < rt.top_k; ++s) acc = __fadd_rn(acc, s_routed[warp * rt.top_k + s]);
    *xo = acc;
    if (xw != nullptr) {
      s_xw[warp] = norm_factor_xw(acc, s_next_w[warp]);
      xw[t * sh.hidden + r] = s_xw[warp];
    }
    s_rows[warp] = acc;
  }
  if (xss != nullptr) {  // the block's rows are also one int8 group of xw (hidden % 4 == 0 when xw_q is given)
    named_barrier<kSplitRows * 32>(1);
    if (warp == 0 && lane == 0)
      xss[t * norm_groups(sh.hidden) + blockIdx.x] =
          group_sum_sq([&](int64_t i) { return s_rows[i - r0]; }, blockIdx.x, sh.hidden);
    if (xw_q != nullptr && warp == 0 && lane == 1)
      store_q8act(xw_q + t * q8act_bytes(sh.hidden), blockIdx.x,
                  tm_act::q8_group(s_xw[0], s_xw[1], s_xw[2], s_xw[3]));
  }
  stamp_end(kDownTimelineRow0);
}

// Row layouts one experts_down_kernel instantiation may pair (the shared and routed rows differ in length, so a
// tiled format may differ in load width; any other format must match): the other pairs take two launches.
constexpr bool down_pair_ok(Fmt s, Fmt r) { return s == r || (fmt_tiled(s) && fmt_tiled(r)); }

}  // namespace

#if TM_RGU_TIMELINE
bool take_down_timeline_rows(TimelineRow* host, int64_t n) { return take_timeline_rows(host, n); }
#endif

int launch_norm_factors(const Limits& lim, const char* fn, const float* x, const float* w, float* xw, float* xss,
                        uint8_t* xw_q, int64_t n_tokens, int64_t dim, cudaStream_t s) {
  const int64_t blocks = ceil_div(n_tokens * norm_groups(dim), 256);
  return launch(lim, fn, norm_factor_kernel, dim3(static_cast<unsigned>(blocks < 65535 ? blocks : 65535)), dim3(256),
                0, s, x, w, xw, xss, xw_q, n_tokens, dim);
}

}  // namespace tm_cuda

using namespace tm_cuda;

extern "C" int tm_cuda_experts_down_accumulate(int qtype, const void* w_down_sh, const float* act_sh,
                                               const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,
                                               const void* w_down, const float* act, const int32_t* ids,
                                               const float* weights, const float* h, float* x,
                                               const float* next_norm_w, float* xw, float* xss, int64_t n_tokens,
                                               int64_t top_k, int64_t n_experts, int64_t hidden, int64_t ffn,
                                               const uint8_t* act_groups_sh, const uint8_t* act_groups,
                                               uint8_t* xw_groups, void* stream) {
  const char* fn = "tm_experts_down_accumulate";
  TM_TRY(check_f32_alignment(fn, "x", x));
  TM_TRY(check_f32_alignment(fn, "next_norm_w", next_norm_w));
  TM_TRY(check_f32_alignment(fn, "xw", xw));
  TM_TRY(check_f32_alignment(fn, "xss", xss));
  TM_TRY(check_f32_alignment(fn, "gate_sh", gate_sh));
  DownArgs sh, rt;
  int gate_mode, no_gate;
  bool vs, vr;
  // A given gate_sh is the shared term's slot weight: w_eff = gate_sh[t], the bits of the gated path's
  // 1 * sigmoid(z) (down_dots), with one float read instead of the gate's dot in every shared warp.
  TM_TRY(down_args(fn, qtype, w_down_sh, act_sh, nullptr, gate_sh, gate_inp_sh, h, 1, 1, hidden, ffn_sh, &sh,
                   &gate_mode, &vs));
  TM_TRY(down_args(fn, qtype, w_down, act, ids, weights, nullptr, nullptr, top_k, n_experts, hidden, ffn, &rt,
                   &no_gate, &vr));
  set_act_groups(&sh, act_groups_sh, ffn_sh);
  set_act_groups(&rt, act_groups, ffn);
  Limits lim;
  TM_TRY(get_limits(&lim));
  const cudaStream_t s = as_stream(stream);
  const int64_t smem = (kSplitRows * top_k + kSplitRows) * static_cast<int64_t>(sizeof(float));
  const int64_t tiles = ceil_div(hidden, kSplitRows);
  auto two_launches = [&]() -> int {
    TM_TRY(launch_moe_down(lim, fn, qtype, sh, vs, gate_inp_sh, h, x, n_tokens, 0, 1, gate_mode, s));
    TM_TRY(launch_moe_down(lim, fn, qtype, rt, vr, nullptr, nullptr, x, n_tokens, 0, top_k, kGateNone, s));
    if (xw == nullptr) return TM_OK;
    return launch_norm_factors(lim, fn, x, next_norm_w, xw, xss, xw_groups, n_tokens, hidden, s);
  };
  // Thousands of slots (or a test cap on shared memory): the two launches this one stands for.
  if (smem > 48 * 1024 || smem > lim.smem_block || tiles > lim.max_grid_x) return two_launches();
  return dispatch_fmt(fmt_for(qtype, ffn_sh), vs, [&](auto fstag, auto vstag) -> int {
    return dispatch_fmt(fmt_for(qtype, ffn), vr, [&](auto frtag, auto vrtag) -> int {
      constexpr Fmt FS = decltype(fstag)::value, FR = decltype(frtag)::value;
      constexpr bool VS = decltype(vstag)::value, VR = decltype(vrtag)::value;
      if constexpr (down_pair_ok(FS, FR)) {
        auto run = [&](auto kernel, int64_t bytes) -> int {
          TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes, fn));
          for (int64_t t0 = 0; t0 < n_tokens; t0 += lim.max_grid_yz) {
            const int64_t gy = n_tokens - t0 < lim.max_grid_yz ? n_tokens - t0 : lim.max_grid_yz;
            TM_TRY(launch(lim, fn, kernel, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(gy)),
                          dim3(kRowsPerBlock * 32), static_cast<size_t>(bytes), s, sh, rt, gate_inp_sh, h, x,
                          next_norm_w, xw, xss, xw_groups, gate_mode, t0));
          }
          return TM_OK;
        };
        // The int8 groups the gate-up stored, where both weight sets are tiled rows (the same bits as the floats)
        constexpr bool kTiled = fmt_tiled(FS) && fmt_tiled(FR);
        const bool q = kTiled && act_groups_sh != nullptr;
        if constexpr (FS == Fmt::Q8_0T16 && TM_DOWN_ROWS_IN_SMEM) {  // when the copies fit (the same bits)
          const int64_t smem_rows = down_rows_offset(top_k) + kSplitRows * sh.row_bytes;
          if (smem_rows <= lim.smem_block)
            return q ? run(experts_down_kernel<FS, VS, FR, VR, true, kTiled>, smem_rows)
                     : run(experts_down_kernel<FS, VS, FR, VR, true, false>, smem_rows);
        }
        return q ? run(experts_down_kernel<FS, VS, FR, VR, false, kTiled>, smem)
                 : run(experts_down_kernel<FS, VS, FR, VR, false, false>, smem);
      } else {
        return two_launches();
      }
    });
  });
}
