/*
 * stream.cuh - internal to csrc/cuda: THE dot product of a weight row with float32 activations, and the per-warp
 * pipeline that streams weight rows through shared memory. Every weight-reading kernel (matmul, the fused
 * attention input, routed and shared experts) is a Job run by stream_rows below, so one (row, activation) pair
 * always gives the same bits, whichever kernel, launch shape or pipeline depth computed it.
 *
 * Lane layout and reduction order (fixed by the weight format and the row length, nothing else):
 *   A row is cut into chunks of kChunk = 2048 values; lane l of the warp owns 64 values of a chunk:
 *     Q8_0, Q4_0, Q4_1: blocks 2l and 2l + 1 of the chunk (values 64l .. 64l + 63);
 *     F16, BF16: the value pairs 2(l + 32i), 2(l + 32i) + 1, i = 0 .. 31;
 *     F32: the values l + 32i, i = 0 .. 63.
 *   A lane keeps one float32 accumulator per row and adds chunk after chunk, inside a chunk in the order above:
 *   per block acc = fma(d, s, acc) with s = sum4 of four chains (values 0-7, 8-15, 16-23, 24-31 of the block, each
 *   a rounded product then an fma chain) (Q4_1 then adds fma(m, x_0 + ... + x_31, acc), a chain of rounded adds);
 *   plain formats keep four chains per chunk (value or word i in chain i % 4) and add acc + sum4 once per chunk.
 *   The 32 lane accumulators are summed by warp_sum's butterfly. All arithmetic is explicit _rn intrinsics.
 *
 * Pipeline: a warp runs its work items (items w, w + W, w + 2W, ... of a job, W = warps in the grid) as a sequence
 *   of windows, one row chunk each, through `stages` shared-memory buffers that the copy engine fills (one bulk copy
 *   per window, issued by lane 0, completing on the buffer's mbarrier) `stages - 1` windows ahead of the one being
 *   computed. A window is copied as the aligned 16-byte granules covering it, so its first byte lands at offset
 *   (address mod 16) of its buffer; rows that are only 2-byte aligned are read through a funnel shift (same
 *   arithmetic). The activation chunk lives in 64 registers per lane
 *   and is loaded once for all the windows that multiply it. Before pdl_wait only windows of rows whose addresses
 *   depend on no activation are issued (weights are immutable); activations are read after it.
 *
 * Job interface (device, const): items(); decode(item) -> Item (what the other calls need, computed once per item);
 *   segments() (per item); seg_cols(seg) (row length); is_static(Item) (its rows depend on no activation);
 *   row(Item, seg, r) (start of row r < NR); xrow(Item, seg) (the activation row); load_x(Item, seg, chunk, lane, x,
 *   aux, norm) (fills the registers, may normalise); warp_cache(first, step) -> WarpCache (per-warp state of the
 *   epilogues); begin(Item, WarpCache&) -> State; segment(Item, seg, dot[NR], State&, WarpCache&) and
 *   finish(Item, State&) (epilogues; called by every lane, dot[] is the same on all lanes).
 */
#ifndef TORNADO_MOE_CUDA_STREAM_CUH
#define TORNADO_MOE_CUDA_STREAM_CUH

#include <type_traits>

#include "norm.cuh"

namespace tm_cuda {

enum class Fmt : int { Q8_0, Q4_0, Q4_1, F16, BF16, F32 };

constexpr int kChunk = 2048;   // values of a row chunk
constexpr int kLaneVals = 64;  // values of a chunk one lane owns
constexpr int kMaxStages = 6;
constexpr int kStreamWarps = 4;  // warps per block (fewer only when a shared-memory cap forces it)
constexpr int kStreamBlocksPerSm = 3;  // 168 registers a thread: no spills in any job

// ---- index arithmetic -----------------------------------------------------------------------------------------

// a / b and a % b for a >= 0, b > 0, through a 32-bit division when both fit: a 64-bit division is a subroutine of
// ~70 instructions on the GPU, and items are decoded on the streaming path.
struct DivMod {
  int64_t q, r;
};
__device__ __forceinline__ DivMod divmod(int64_t a, int64_t b) {
  if (((a | b) >> 31) == 0) {
    const uint32_t q = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    return DivMod{q, a - static_cast<int64_t>(q) * b};
  }
  const int64_t q = a / b;
  return DivMod{q, a - q * b};
}

// ---- byte to float --------------------------------------------------------------------------------------------

// 2^23 + byte i of `word` as a float (exact): a byte-to-float conversion at full ALU rate (no I2F).
__device__ __forceinline__ float biased_byte(uint32_t word, int i) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650u + static_cast<unsigned>(i)));
}
__device__ __forceinline__ float q8_value(uint32_t word, int i) {  // int8 byte i
  return __fsub_rn(biased_byte(word ^ 0x80808080u, i), 8388736.0f);  // 2^23 + 128
}
template <bool HI>
__device__ __forceinline__ float nibble(uint32_t word, int i, float bias) {  // low or high nibble of byte i, - bias
  return __fsub_rn(biased_byte((HI ? word >> 4 : word) & 0x0F0F0F0Fu, i), bias);
}

// N words of a buffer starting at byte `off` (2-byte aligned; SH: off % 4 == 2, read through a funnel shift).
template <int N, bool SH>
__device__ __forceinline__ void load_words(const uint32_t* buf, int off, uint32_t (&w)[N]) {
  const uint32_t* p = buf + (off >> 2);
  if constexpr (SH) {
    uint32_t lo = p[0];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t hi = p[i + 1];
      w[i] = __funnelshift_r(lo, hi, 16);
      lo = hi;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = p[i];
  }
}

// The fp16 at byte offset OFF (even) of a word array.
template <int OFF, int N>
__device__ __forceinline__ float half_at(const uint32_t (&w)[N]) {
  return fp16_bits_to_f32((w[OFF >> 2] >> (8 * (OFF & 3))) & 0xFFFFu);
}

// (a + b) + (c + d): how the four partial sums of a block (values 0-7, 8-15, 16-23, 24-31, each a rounded product
// then an fma chain) are combined; four independent chains keep the FMA pipe busy.
__device__ __forceinline__ float sum4(const float (&s)[4]) {
  return __fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3]));
}

// sum_j q_j x_j of a 4-bit block whose 16 quant bytes start at byte QOFF (value j < 16: low nibble of byte j, else
// high nibble of byte j - 16), q = nibble - (bias - 2^23), in the four chains of sum4.
template <int QOFF, int XOFF, int N>
__device__ __forceinline__ float nibble_block_sum(const uint32_t (&w)[N], const float (&x)[64], float bias) {
  float s[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int j = 8 * c; j < 8 * c + 8; ++j) {
      const int b = QOFF + (j & 15);
      const float q = j < 16 ? nibble<false>(w[b >> 2], b & 3, bias) : nibble<true>(w[b >> 2], b & 3, bias);
      s[c] = j == 8 * c ? __fmul_rn(q, x[XOFF + j]) : __fmaf_rn(q, x[XOFF + j], s[c]);
    }
  }
  return sum4(s);
}

// ---- the formats ----------------------------------------------------------------------------------------------

template <Fmt F>
struct Unit;

// Q8_0: 34-byte blocks (fp16 d, 32 int8). A lane's block pair is 68 bytes = 17 words (stride 17: no bank conflict).
template <>
struct Unit<Fmt::Q8_0> {
  static constexpr int kQtype = TM_Q8_0, kChunkBytes = 64 * 34;
  __device__ static int x_index(int lane, int j) { return 64 * lane + j; }
  template <int DOFF, int QOFF, int XOFF>
  __device__ __forceinline__ static float block(const uint32_t (&w)[17], const float (&x)[64], float acc) {
    float s[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[c] = __fmul_rn(q8_value(w[(QOFF + 8 * c) >> 2], (QOFF + 8 * c) & 3), x[XOFF + 8 * c]);
#pragma unroll
      for (int j = 8 * c + 1; j < 8 * c + 8; ++j)
        s[c] = __fmaf_rn(q8_value(w[(QOFF + j) >> 2], (QOFF + j) & 3), x[XOFF + j], s[c]);
    }
    return __fmaf_rn(half_at<DOFF>(w), sum4(s), acc);
  }
  template <bool SH>
  __device__ __forceinline__ static float dot(const uint32_t* buf, int off, int lane, int nvals,
                                              const float (&x)[64], const float (&)[2], float acc) {
    const int nb = nvals >> 5;
    if (2 * lane >= nb) return acc;
    uint32_t w[17];
    load_words<17, SH>(buf, off + 68 * lane, w);
    acc = block<0, 2, 0>(w, x, acc);
    if (2 * lane + 1 < nb) acc = block<34, 36, 32>(w, x, acc);
    return acc;
  }
};

// Q4_0: 18-byte blocks (fp16 d, 16 bytes: low nibbles are values 0..15, high nibbles 16..31), v = (q - 8) d.
template <>
struct Unit<Fmt::Q4_0> {
  static constexpr int kQtype = TM_Q4_0, kChunkBytes = 64 * 18;
  __device__ static int x_index(int lane, int j) { return 64 * lane + j; }
  template <int DOFF, int QOFF, int XOFF>
  __device__ __forceinline__ static float block(const uint32_t (&w)[9], const float (&x)[64], float acc) {
    return __fmaf_rn(half_at<DOFF>(w), nibble_block_sum<QOFF, XOFF>(w, x, 8388616.0f), acc);  // 2^23 + 8
  }
  template <bool SH>
  __device__ __forceinline__ static float dot(const uint32_t* buf, int off, int lane, int nvals,
                                              const float (&x)[64], const float (&)[2], float acc) {
    const int nb = nvals >> 5;
    if (2 * lane >= nb) return acc;
    uint32_t w[9];
    load_words<9, SH>(buf, off + 36 * lane, w);
    acc = block<0, 2, 0>(w, x, acc);
    if (2 * lane + 1 < nb) acc = block<18, 20, 32>(w, x, acc);
    return acc;
  }
};

// Q4_1: 20-byte blocks (fp16 d, fp16 m, 16 bytes of nibbles as Q4_0), v = q d + m: a block adds d * sum(q x) and
// then m * sum(x); the two sums of x (aux) are computed once per activation chunk.
template <>
struct Unit<Fmt::Q4_1> {
  static constexpr int kQtype = TM_Q4_1, kChunkBytes = 64 * 20;
  __device__ static int x_index(int lane, int j) { return 64 * lane + j; }
  template <int DOFF, int XOFF>
  __device__ __forceinline__ static float block(const uint32_t (&w)[10], const float (&x)[64], float sx, float acc) {
    acc = __fmaf_rn(half_at<DOFF>(w), nibble_block_sum<DOFF + 4, XOFF>(w, x, 8388608.0f), acc);  // 2^23
    return __fmaf_rn(half_at<DOFF + 2>(w), sx, acc);
  }
  template <bool SH>
  __device__ __forceinline__ static float dot(const uint32_t* buf, int off, int lane, int nvals,
                                              const float (&x)[64], const float (&aux)[2], float acc) {
    const int nb = nvals >> 5;
    if (2 * lane >= nb) return acc;
    uint32_t w[10];
    load_words<10, SH>(buf, off + 40 * lane, w);
    acc = block<0, 0>(w, x, aux[0], acc);
    if (2 * lane + 1 < nb) acc = block<20, 32>(w, x, aux[1], acc);
    return acc;
  }
};

// F16 / BF16: lane l reads the words l + 32i of the chunk (two values each).
template <bool BF>
struct Unit16 {
  static constexpr int kQtype = BF ? TM_BF16 : TM_F16, kChunkBytes = kChunk * 2;
  __device__ static int x_index(int lane, int j) { return 2 * (lane + 32 * (j >> 1)) + (j & 1); }
  __device__ __forceinline__ static float cvt(uint32_t bits) {
    return BF ? bf16_bits_to_f32(bits) : fp16_bits_to_f32(bits);
  }
  template <bool SH>
  __device__ __forceinline__ static float dot(const uint32_t* buf, int off, int lane, int nvals,
                                              const float (&x)[64], const float (&)[2], float acc) {
    const uint32_t* p = buf + (off >> 2);
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // word i goes to chain i % 4
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int k = lane + 32 * i;
      if (2 * k < nvals) {
        const uint32_t wd = SH ? __funnelshift_r(p[k], p[k + 1], 16) : p[k];
        s[i & 3] = __fmaf_rn(cvt(wd & 0xFFFFu), x[2 * i], s[i & 3]);
        if (2 * k + 1 < nvals) s[i & 3] = __fmaf_rn(cvt(wd >> 16), x[2 * i + 1], s[i & 3]);
      }
    }
    return __fadd_rn(acc, sum4(s));
  }
};
template <>
struct Unit<Fmt::F16> : Unit16<false> {};
template <>
struct Unit<Fmt::BF16> : Unit16<true> {};

// F32 (always 4-byte aligned): lane l reads the words l + 32i.
template <>
struct Unit<Fmt::F32> {
  static constexpr int kQtype = TM_F32, kChunkBytes = kChunk * 4;
  __device__ static int x_index(int lane, int j) { return lane + 32 * j; }
  template <bool SH>
  __device__ __forceinline__ static float dot(const uint32_t* buf, int off, int lane, int nvals,
                                              const float (&x)[64], const float (&)[2], float acc) {
    const uint32_t* p = buf + (off >> 2);
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // value i goes to chain i % 4
#pragma unroll
    for (int i = 0; i < 64; ++i)
      if (lane + 32 * i < nvals) s[i & 3] = __fmaf_rn(__uint_as_float(p[lane + 32 * i]), x[i], s[i & 3]);
    return __fadd_rn(acc, sum4(s));
  }
};

template <Fmt F>
constexpr bool kBlockFmt = F == Fmt::Q8_0 || F == Fmt::Q4_0 || F == Fmt::Q4_1;

// ---- activations ----------------------------------------------------------------------------------------------

// Lane `lane`'s 64 values of chunk c of the activation row xr (cols values; 0 past the end). With nw, the values are
// normalised as tm_rmsnorm does: (x * inv) * nw. xr is read with plain loads (it may be the previous kernel's
// output), nw (a weight) through the read-only path.
template <Fmt F>
__device__ __forceinline__ void load_x(const float* xr, const float* nw, float inv, int64_t cols, int64_t c, int lane,
                                       float (&x)[64], float (&aux)[2]) {
  const int64_t base = c * kChunk;
  if constexpr (kBlockFmt<F>) {
    // 64 consecutive values per lane; cols is a multiple of 32, so a float4 is all in or all out.
    const float* p = xr + base + 64 * lane;
    const bool vec = (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (base + 64 * lane + 4 * q < cols) {
        if (vec) {
          v = *reinterpret_cast<const float4*>(p + 4 * q);
        } else {
          v = make_float4(p[4 * q], p[4 * q + 1], p[4 * q + 2], p[4 * q + 3]);
        }
      }
      x[4 * q] = v.x;
      x[4 * q + 1] = v.y;
      x[4 * q + 2] = v.z;
      x[4 * q + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 64; ++j) {
      const int64_t e = base + Unit<F>::x_index(lane, j);
      x[j] = e < cols ? xr[e] : 0.0f;
    }
  }
  if (nw != nullptr) {
#pragma unroll
    for (int j = 0; j < 64; ++j) {
      const int64_t e = base + Unit<F>::x_index(lane, j);
      if (e < cols) x[j] = rms_apply(x[j], inv, __ldg(nw + e));
    }
  }
  if constexpr (F == Fmt::Q4_1) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float s = x[32 * b];
#pragma unroll
      for (int j = 1; j < 32; ++j) s = __fadd_rn(s, x[32 * b + j]);
      aux[b] = s;
    }
  } else {
    aux[0] = aux[1] = 0.0f;
  }
}

// dot(a, b) of two float32 vectors of n values by one warp (every lane returns it): lane l adds a[i] b[i] for
// i = l, l + 32, ... with fma in increasing i, then warp_sum. Read in rounds of 1024 values (64 loads per lane in
// flight); `a` is a weight (read-only path), `b` an activation.
__device__ __forceinline__ float warp_dot_f32(const float* __restrict__ a, const float* b, int64_t n) {
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  for (int64_t base = 0; base < n; base += 32 * 32) {
    float va[32], vb[32];
#pragma unroll
    for (int m = 0; m < 32; ++m) {
      const int64_t i = base + 32 * m + lane;
      va[m] = i < n ? __ldg(a + i) : 0.0f;
      vb[m] = i < n ? b[i] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < 32; ++m)
      if (base + 32 * m + lane < n) acc = __fmaf_rn(va[m], vb[m], acc);
  }
  return warp_sum(acc);
}

// A hint that the line holding p will be read soon from L1.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// Jobs whose epilogues keep no per-warp state.
struct NoWarpCache {};

// Per-warp cache of the normalisation factor of the activation row last normalised.
struct NormCache {
  const float* row = nullptr;
  float inv = 0.0f;
};

// ---- the pipeline ---------------------------------------------------------------------------------------------

// One bulk copy (the Hopper copy engine) per window, completing on the window buffer's mbarrier: one instruction of
// one lane instead of a copy loop in every lane.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  // Generic-proxy reads of this buffer (the previous window) come before the copy engine's writes.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

template <Fmt F>
__host__ __device__ constexpr int stage_bytes_of() {
  return Unit<F>::kChunkBytes + 32;  // the window's granules (its offset < 16) and the shifted reads' extra word
}

__host__ __device__ inline int64_t chunks_of(int64_t cols) { return (cols + kChunk - 1) / kChunk; }

// Shared memory of a block: per warp `stages` mbarriers (8 bytes each), then per warp `stages` window buffers.
__host__ __device__ inline int64_t barrier_bytes(int warps, int stages) { return (warps * stages * 8 + 15) / 16 * 16; }

template <Fmt F, int NR, class Job>
__device__ __forceinline__ void stream_rows(const Job& job, int stages) {
  using U = Unit<F>;
  constexpr int kStage = stage_bytes_of<F>();
  extern __shared__ __align__(16) unsigned char stream_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = static_cast<int>(blockDim.x >> 5);
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * warps + warp;
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(stream_smem)) + 8u * warp * stages;
  unsigned char* ring = stream_smem + barrier_bytes(warps, stages) + static_cast<size_t>(warp) * stages * kStage;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int64_t n_items = job.items();
  const int nseg = job.segments();
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(bars + 8u * s);
    mbar_init_fence();
  }
  __syncwarp();

  // Producer: the next window to issue and the buffer it goes to.
  int64_t p_item = first, p_chunk = 0;
  int p_seg = 0, p_r = 0, p_slot = 0;
  typename Job::Item p_it = job.decode(p_item < n_items ? p_item : 0);
  auto issue_next = [&]() {
    if (p_item >= n_items) return;
    const int64_t cols = job.seg_cols(p_seg);
    if (lane == 0) {
      const int64_t b0 = p_chunk * U::kChunkBytes;
      const int64_t rest = tm_qtype_row_bytes(U::kQtype, cols) - b0;
      const uintptr_t a = reinterpret_cast<uintptr_t>(job.row(p_it, p_seg, p_r) + b0);
      const uintptr_t g0 = a & ~static_cast<uintptr_t>(15);
      const uint32_t bytes = static_cast<uint32_t>((a + (rest < U::kChunkBytes ? rest : U::kChunkBytes) - g0 + 15) &
                                                   ~static_cast<uintptr_t>(15));
      bulk_copy(ring_s + static_cast<uint32_t>(p_slot * kStage), reinterpret_cast<const void*>(g0), bytes,
                bars + 8u * p_slot);
    }
    p_slot = p_slot + 1 == stages ? 0 : p_slot + 1;
    if (++p_r == NR) {
      p_r = 0;
      if (++p_chunk == chunks_of(cols)) {
        p_chunk = 0;
        if (++p_seg == nseg) {
          p_seg = 0;
          p_item += step;
          if (p_item < n_items) p_it = job.decode(p_item);
        }
      }
    }
  };

  bool waited = false;
  for (int s = 0; s + 1 < stages; ++s) {
    if (!waited && !(p_item < n_items && job.is_static(p_it))) {
      pdl_wait();
      waited = true;
    }
    issue_next();
  }
  if (!waited) pdl_wait();
  pdl_trigger();

  float x[kLaneVals], aux[2];
  const float* x_row = nullptr;
  int64_t x_chunk = -1;
  NormCache norm;
  int c_slot = 0;
  uint32_t phases = 0;  // bit s: parity of the next completion of buffer s
  typename Job::WarpCache wc = job.warp_cache(first, step);
  for (int64_t item = first; item < n_items; item += step) {
    const typename Job::Item it = job.decode(item);
    typename Job::State st = job.begin(it, wc);
    for (int seg = 0; seg < nseg; ++seg) {
      const int64_t cols = job.seg_cols(seg);
      const int64_t nch = chunks_of(cols);
      const float* xr = job.xrow(it, seg);
      float acc[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
      for (int64_t c = 0; c < nch; ++c) {
        if (xr != x_row || c != x_chunk) {
          job.template load_x<F>(it, seg, c, lane, x, aux, norm);
          x_row = xr;
          x_chunk = c;
        }
        const int nvals = static_cast<int>(cols - c * kChunk < kChunk ? cols - c * kChunk : kChunk);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          issue_next();  // refills the buffer released at the end of the previous window
          mbar_wait(bars + 8u * c_slot, (phases >> c_slot) & 1u);
          phases ^= 1u << c_slot;
          const uint8_t* a = job.row(it, seg, r) + c * U::kChunkBytes;
          const int off = static_cast<int>(reinterpret_cast<uintptr_t>(a) & 15);
          const uint32_t* buf = reinterpret_cast<const uint32_t*>(ring + c_slot * kStage);
          if (off & 2)
            acc[r] = U::template dot<true>(buf, off, lane, nvals, x, aux, acc[r]);
          else
            acc[r] = U::template dot<false>(buf, off, lane, nvals, x, aux, acc[r]);
          __syncwarp();  // every lane is done with the buffer before it is refilled
          c_slot = c_slot + 1 == stages ? 0 : c_slot + 1;
        }
      }
      float dot[NR];
#pragma unroll
      for (int r = 0; r < NR; ++r) dot[r] = warp_sum(acc[r]);
      job.segment(it, seg, dot, st, wc);
    }
    job.finish(it, st);
  }
}

template <Fmt F, int NR, class Job>
__global__ void __launch_bounds__(kStreamWarps * 32, kStreamBlocksPerSm) stream_kernel(const Job job, int stages) {
  stream_rows<F, NR>(job, stages);
}

// ---- host side ------------------------------------------------------------------------------------------------

inline bool fmt_of(int qtype, Fmt* f) {
  switch (qtype) {
    case TM_Q8_0: *f = Fmt::Q8_0; return true;
    case TM_Q4_0: *f = Fmt::Q4_0; return true;
    case TM_Q4_1: *f = Fmt::Q4_1; return true;
    case TM_F16: *f = Fmt::F16; return true;
    case TM_BF16: *f = Fmt::BF16; return true;
    case TM_F32: *f = Fmt::F32; return true;
    default: return false;
  }
}

template <Fmt F>
using FmtTag = std::integral_constant<Fmt, F>;

// Calls fn(FmtTag<F>{}) for the format of qtype.
template <class Fn>
inline int dispatch_fmt(const char* fn_name, int qtype, Fn&& fn) {
  Fmt f;
  if (!fmt_of(qtype, &f))
    return tm_set_error(TM_ERR_UNSUPPORTED_QTYPE, "%s: no CUDA kernel for weight format %d", fn_name, qtype);
  switch (f) {
    case Fmt::Q8_0: return fn(FmtTag<Fmt::Q8_0>{});
    case Fmt::Q4_0: return fn(FmtTag<Fmt::Q4_0>{});
    case Fmt::Q4_1: return fn(FmtTag<Fmt::Q4_1>{});
    case Fmt::F16: return fn(FmtTag<Fmt::F16>{});
    case Fmt::BF16: return fn(FmtTag<Fmt::BF16>{});
    default: return fn(FmtTag<Fmt::F32>{});
  }
}

// Launches stream_kernel<F, NR> for `items` work items: kStreamBlocksPerSm blocks of kStreamWarps warps per
// multiprocessor when shared memory allows (fewer warps or stages under a smaller limit; results do not depend on
// it), at most one warp per item, at most max_stages buffers per warp.
template <Fmt F, int NR, class Job>
int launch_stream(const Limits& lim, const char* fn, const Job& job, int64_t items, int max_stages,
                  cudaStream_t stream) {
  constexpr int64_t kStage = stage_bytes_of<F>() + 8;  // a buffer and its mbarrier
  constexpr int64_t kBlockReserve = 1024;  // shared memory the system keeps per resident block
  int64_t budget = lim.smem_sm / kStreamBlocksPerSm - kBlockReserve;
  if (budget > lim.smem_block) budget = lim.smem_block;
  budget -= 16;  // the barrier area's rounding
  int warps = kStreamWarps;
  int64_t stages = budget / (warps * kStage);
  while (stages < 1 && warps > 1) {
    warps /= 2;
    stages = budget / (warps * kStage);
  }
  if (stages < 1)
    return tm_set_error(TM_ERR_INVALID_ARGUMENT, "%s: needs %lld bytes of shared memory per block, the limit is %lld",
                        fn, static_cast<long long>(kStage), static_cast<long long>(lim.smem_block));
  if (stages > max_stages) stages = max_stages;
  if (stages > kMaxStages) stages = kMaxStages;
  const int64_t smem = barrier_bytes(warps, static_cast<int>(stages)) + warps * stages * stage_bytes_of<F>();
  int64_t per_sm = lim.smem_sm / (smem + kBlockReserve);
  if (per_sm > kStreamBlocksPerSm * kStreamWarps / warps) per_sm = kStreamBlocksPerSm * kStreamWarps / warps;
  if (per_sm < 1) per_sm = 1;
  int64_t grid = ceil_div(items, warps);
  if (grid > per_sm * lim.sm_count) grid = per_sm * lim.sm_count;
  if (grid > lim.max_grid_x) grid = lim.max_grid_x;
  if (grid < 1) grid = 1;
  auto* kernel = &stream_kernel<F, NR, Job>;
  TM_STATUS_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, fn));
  return launch(lim, fn, kernel, dim3(static_cast<unsigned>(grid)), dim3(32u * warps), static_cast<size_t>(smem),
                stream, job, static_cast<int>(stages));
}

}  // namespace tm_cuda

#endif
