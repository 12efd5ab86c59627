/*
 * moe_ffn.cu - tm_router_experts_ffn on CUDA: the whole FFN half of a qwen2moe decode step (RMSNorm, router,
 * softmax, top-k, the shared expert's gate-up and down, every routed slot's gate-up and down, the residual add) in
 * ONE persistent launch, bitwise tm_router_experts_gate_up followed by tm_experts_down_accumulate.
 *
 * Why: in two launches the FFN half took ~33 us a layer on the H200 for 73.5 MB of weights (17 us at copy
 * bandwidth). Each launch is one to three waves of short blocks that pay their own round trips, the routed blocks
 * cannot stream before the router's ids, and the down's blocks wait for the gate-up grid's end (results/NOTES.md,
 * lessons 43-62). Here the weights stream through a ring of shared memory by the copy engine, independently of the
 * dependencies between the steps, which hold back only the arithmetic. Measured on the H200 it is slower than the
 * two launches (results/NOTES.md v5, lessons 63-66: the router's loads queue behind the weight stream), so it runs
 * only when chosen (tm_set_ffn_one_launch).
 *
 * The launch: one block per multiprocessor (all co-resident: the blocks wait for each other), 18 warps:
 *   warps 0-15  consumers, two groups of 8; group g takes the block's chunks q with q % 2 == g, a job per warp;
 *   warp 16     producer: its lane 0 copies the block's first router row, then the block's chunks, in order, into
 *               kFfnStages stages of shared memory (cp.async.bulk, completion on a transaction barrier per stage, a
 *               second barrier per stage that the consuming group's warps free), at most kFfnInFlight of them in
 *               flight. It starts at the kernel's first instruction: weights are immutable, so under programmatic
 *               dependent launch (common.cuh) the first copies land while the previous kernel runs; the routed
 *               chunks follow once the block's router warp has the ids;
 *   warp 17     router: the router rows (and the shared-expert gate row) b, b + G, ..., then the block's own top-k
 *               of every logit, then it watches the other blocks' flags for the consumers.
 * A block's chunks, by phase (a function of block, grid and shapes that producer and consumers compute alike;
 * ring order SG, RG, SD, RD, or with TM_FFN_SD_FIRST=1 SG, SD, RG, RD):
 *   SG  the shared expert's gate-up tiles of 8 row pairs: tile c of ceil(ffn_sh / 8) is block c % G's;
 *   RG  routed gate-up tiles (slot, 8 row pairs of expert ids[slot]): tile c is block (c + ceil(ffn_sh / 8)) % G's
 *       (a block with one SG tile more has one RG tile less);
 *   SD  the shared down's rows of the block's output rows [row0, row0 + rows) (row pairs spread evenly), 8 a chunk;
 *   RD  the routed down's rows of the block's output rows, per slot, 16 a chunk (a row pair a warp).
 * Dependencies between blocks are 64-bit words tagged with the call's epoch (common.cuh), so nothing is cleared:
 *   h       every block normalises x itself on its first 8 warps (norm.cuh's tree: the h of every other kernel);
 *   logits  one tagged word per router row; every block's router warp polls them all and runs router.cuh's top-k
 *           (the same bits in every block; block 0 writes ids and weights out); the gate's sigmoid likewise;
 *   act_sh  a group releases its word (st.release) once its SG chunks are stored; SD starts once the router warp
 *           has seen all 2 G words (it arrives on an mbarrier the consumers wait on);
 *   act     the same, RG -> RD.
 * Finally each block adds its rows' terms into x in the order of the two launches: x + shared, then slot 0, 1, ...
 * Every dot product is qdot.cuh's warp_dot on the same rows (read from shared memory: its SM reader) and every
 * epilogue the same rounded operations as moe.cuh's kernels, so every output is theirs bit for bit.
 */
#include <algorithm>

#include "norm.cuh"
#include "router.cuh"

namespace tm_cuda {
namespace {

constexpr int kFfnGroupWarps = 8;
constexpr int kFfnConsumers = 2 * kFfnGroupWarps * 32;      // threads 0 .. 511
constexpr int kFfnProducerWarp = 2 * kFfnGroupWarps;        // warp 16
constexpr int kFfnRouterWarp = kFfnProducerWarp + 1;        // warp 17
constexpr int kFfnThreads = (kFfnRouterWarp + 1) * 32;
// Ring stages and shared-down rows a chunk (measurement knobs): a stage holds the largest chunk, and each chunk is
// consumed by the 8 warps of one group (idle warps arrive too), whichever group that is.
#ifndef TM_FFN_STAGES
#define TM_FFN_STAGES 4
#endif
#ifndef TM_FFN_SD_ROWS
#define TM_FFN_SD_ROWS 8
#endif
constexpr int kFfnStages = TM_FFN_STAGES;
// Chunks a producer has in flight at most (copies issued, not landed). Every byte queued in the memory system
// delays every load behind it, the router's included: with the whole ring in flight (18 MB over 132 SMs) the
// ids came 10 us after h on the H200; two chunks a SM are still more than the copy bandwidth needs.
#ifndef TM_FFN_IN_FLIGHT
#define TM_FFN_IN_FLIGHT 2
#endif
constexpr int kFfnInFlight = TM_FFN_IN_FLIGHT < kFfnStages ? TM_FFN_IN_FLIGHT : kFfnStages;
constexpr int kTileRows = 8;   // SG / RG chunk: a row pair a warp
constexpr int kSdRows = TM_FFN_SD_ROWS;  // SD chunk: a row a warp
static_assert(kSdRows >= 1 && kSdRows <= 8, "a shared-down row a consumer warp of a group");
constexpr int kRdRows = 16;    // RD chunk: a row pair a warp
constexpr int kFfnMaxSlots = 4;                  // ids packed in one word (for the producer)
constexpr int kFfnMaxExperts = 64;               // router_topk_warp
constexpr int kFfnMaxBlocks = TM_FFN_MAX_BLOCKS;  // act flags in the scratch
// Named barriers (0 is __syncthreads): 1, 2 a group's 8 warps (1 also the norm's); 3 the consumers and the router
// warp (h and the tag are in shared memory); 4 the consumers.
constexpr int kBarH = 3, kBarConsumers = 4;
enum ChunkKind : int { kSG, kSD, kRG, kRD };

// The scratch, in 64-bit words: word 0 is the ticket word of tm_router_experts_gate_up (the same epoch counter, so
// that the two kernels may share a scratch: every word either of them reads carries the epoch of its call).
struct FfnSync {
  unsigned long long* ticket;
  unsigned long long* gate;     // tag | the float bits of sigmoid(gate_inp_sh . h)
  unsigned long long* logits;   // [kFfnMaxExperts]
  unsigned long long* sh_done;  // [2 G] a group's SG chunks are stored
  unsigned long long* rt_done;  // [2 G] a group's RG chunks are stored
};
__device__ __forceinline__ FfnSync ffn_sync(int32_t* scratch) {
  auto* w = reinterpret_cast<unsigned long long*>(scratch);
  return FfnSync{w, w + 33, w + 40, w + 128, w + 128 + 2 * kFfnMaxBlocks};
}

// What a block's roles hand each other in shared memory.
struct FfnShared {
  uint64_t full[kFfnStages], empty[kFfnStages];  // the ring: a stage's copies landed / its group is done with it
  uint64_t sh_ready, rt_ready;  // every block's act_sh / act is stored (the router warp arrives, consumers wait)
  uint64_t row_landed;          // the block's first router row is in shared memory
  uint32_t tag;                 // the call's epoch tag (0 until consumer thread 0 has it)
  uint32_t ids_packed, ids_ready;
  int32_t ids[kFfnMaxSlots];
  float weights[kFfnMaxSlots], gate, norm[kNormWarps + 4];
  Pick list[kFfnMaxSlots];
};

struct FfnArgs {
  float* x;  // normalised by every block, then each block's rows of it updated in place
  const float* norm_w;
  float eps;
  float* h;
  const float* w_router;
  int router_mode;
  const float* gate_inp;  // nullable
  int gate_mode;
  float* gate_out;
  int32_t* ids;
  float* weights;
  int normalize;
  const uint8_t *w_gate_sh, *w_up_sh, *w_down_sh, *w_gate, *w_up, *w_down;
  float* act_sh;
  float* act;
  int32_t* scratch;
  int hidden, ffn_sh, ffn, n_experts, top_k;
  uint32_t rb_h, rb_fs, rb_f;  // row bytes: gate/up rows, shared down rows, routed down rows
  uint32_t stage_bytes;
  int n_sg, rg_tiles, rows_max;  // SG tiles, RG tiles per slot, output rows a block at most
  int router_rows;               // n_experts, + 1 with the shared-expert gate row
  uint32_t router_row_offset;    // bytes from the ring's end to the router row's copy
};

// The order of a block's phases (ring order = consumption order). Default: SG, RG, SD, RD, so that the shared down
// (whose inputs are every block's SG chunks) comes after the routed gate-up and nobody waits for it, and the
// routed down waits for every RG chunk behind the block's SD work. TM_FFN_SD_FIRST=1: SG, SD, RG, RD (a
// measurement knob: the SD chunks wait for every block's SG chunks and hold ring stages meanwhile).
#ifndef TM_FFN_SD_FIRST
#define TM_FFN_SD_FIRST 0
#endif
__host__ __device__ constexpr int phase_kind(int p) {
  return TM_FFN_SD_FIRST ? p : (p == 1 ? kRG : p == 2 ? kSD : p);
}

// The block's share of the work: chunks of each kind, and where each phase starts in the block's sequence.
struct BlockWork {
  int n[4];       // chunks of kind SG, SD, RG, RD
  int begin[5];   // sequence index of phase p's first chunk; begin[4] = total
  int row0, rows; // output rows
  int rg_first;   // its first RG tile
  int rd_pieces;  // RD chunks per slot
};
__device__ __forceinline__ BlockWork block_work(const FfnArgs& a, int b, int grid) {
  auto share = [&](int n, int first) { return first < n ? (n - 1 - first) / grid + 1 : 0; };
  BlockWork w;
  w.n[kSG] = share(a.n_sg, b);
  const int pairs = a.hidden / 2, base = pairs / grid, extra = pairs % grid;
  const int more = b >= grid - extra ? 1 : 0;  // the last `extra` blocks take a pair more
  w.row0 = 2 * (b * base + (more ? b - (grid - extra) : 0));
  w.rows = 2 * (base + more);
  w.n[kSD] = (w.rows + kSdRows - 1) / kSdRows;
  w.rg_first = ((b - a.n_sg % grid) % grid + grid) % grid;
  w.n[kRG] = share(a.top_k * a.rg_tiles, w.rg_first);
  w.rd_pieces = (w.rows + kRdRows - 1) / kRdRows;
  w.n[kRD] = a.top_k * w.rd_pieces;
  w.begin[0] = 0;
  for (int p = 0; p < 4; ++p) w.begin[p + 1] = w.begin[p] + w.n[phase_kind(p)];
  return w;
}

struct Chunk {
  int kind, slot, first, n;  // first row (of the tile, or output row) and rows
};
// Chunk i of kind `kind` of block b.
__device__ __forceinline__ Chunk chunk_of(const FfnArgs& a, const BlockWork& w, int b, int grid, int kind, int i) {
  if (kind == kSG) {
    const int first = (b + i * grid) * kTileRows;
    return Chunk{kSG, 0, first, min(kTileRows, a.ffn_sh - first)};
  }
  if (kind == kSD) return Chunk{kSD, 0, w.row0 + i * kSdRows, min(kSdRows, w.rows - i * kSdRows)};
  if (kind == kRG) {
    const int c = w.rg_first + i * grid, slot = c / a.rg_tiles, first = (c - slot * a.rg_tiles) * kTileRows;
    return Chunk{kRG, slot, first, min(kTileRows, a.ffn - first)};
  }
  const int slot = i / w.rd_pieces, piece = i - slot * w.rd_pieces;
  return Chunk{kRD, slot, w.row0 + piece * kRdRows, min(kRdRows, w.rows - piece * kRdRows)};
}
// ---- a measurement build only (-DTM_FFN_TIMELINE=1; scripts/ffn_timeline.py) ----
// Per block of the latest launch, the global timer (ns) at the events below; tm_cuda_ffn_timeline copies them out
// and clears them. Without the flag the stamps are empty.
#ifndef TM_FFN_TIMELINE
#define TM_FFN_TIMELINE 0
#endif
enum FfnEvent : int {
  kEvStart,        // the block's first instruction
  kEvWaited,       // consumers past pdl_wait
  kEvH,            // h and the tag in shared memory
  kEvPhaseEnd0,    // + 2 p + g: group g's last chunk of phase p done (p = 0 .. 3: 8 events)
  kEvWaitEnd0 = kEvPhaseEnd0 + 8,  // + 2 p + g: group g's wait before phase p over (p = 1 .. 3 used)
  kEvDone = kEvWaitEnd0 + 8,       // x written
  kEvIds,          // the producer has the ids
  kEvIssuedAll,    // the producer's last copy issued
  kEvPublished,    // the router warp has the block's top-k
  kEvShReady,      // the router warp has seen every block's act_sh flags
  kEvRtReady,      // ... and act flags
  kEvChunk0,       // + 3 q + {0: copies issued, 1: warp 0 of its group past the full wait, 2: its job done}
  kFfnChunksStamped = 24,
  kFfnEvents = kEvChunk0 + 3 * kFfnChunksStamped
};
#if TM_FFN_TIMELINE
__device__ unsigned long long ffn_timeline[kFfnMaxBlocks][kFfnEvents];
__device__ __forceinline__ void ffn_stamp(int ev) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (ev < kFfnEvents) ffn_timeline[blockIdx.x][ev] = t;
}
#else
__device__ __forceinline__ void ffn_stamp(int) {}
#endif
__device__ __forceinline__ void stamp_chunk(int q, int what) {
  if (q < kFfnChunksStamped) ffn_stamp(kEvChunk0 + 3 * q + what);
}

// A measurement knob (wrong results, timing only): the routed chunks stream without waiting for the router's
// ids, which bounds what an earlier router could gain.
#ifndef TM_FFN_IDS_PROBE
#define TM_FFN_IDS_PROBE 0
#endif

// A word of shared memory another role of the block sets (volatile: re-read at every poll), once nonzero.
__device__ __forceinline__ uint32_t wait_set(const uint32_t* word) {
  uint32_t v;
  while ((v = *reinterpret_cast<const volatile uint32_t*>(word)) == 0) __nanosleep(TM_FLAG_SPIN_NS);
  return v;
}
// The payload of a tagged word once it carries `tag` (relaxed polls: the payload is all the reader needs).
__device__ __forceinline__ uint32_t wait_tagged(const unsigned long long* w, uint32_t tag) {
  for (;;) {
    const unsigned long long v = ld_relaxed_u64(w);
    if (tag_of(v) == tag) return static_cast<uint32_t>(v);
    __nanosleep(TM_FLAG_SPIN_NS);
  }
}
// One warp: until all n words carry `tag`. The polls are relaxed and all of a round in flight at once (an acquire
// load each would invalidate L1 and wait, one after the other); one fence after them makes what the words'
// writers released before them visible to the block's threads past the caller's next barrier.
// (The router warp polls them while the consumers work: it sleeps longer between rounds.)
__device__ __forceinline__ void wait_all_released(const unsigned long long* w, int n, uint32_t tag, int lane) {
  for (;;) {
    bool ok = true;
    for (int i = lane; i < n; i += 32) ok &= tag_of(ld_relaxed_u64(w + i)) == tag;
    if (__all_sync(kFullMask, ok)) break;
    __nanosleep(128);
  }
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// Producer (one thread): every chunk of the block into the ring, in order.
__device__ __forceinline__ void ffn_producer(const FfnArgs& a, const BlockWork& w, uint8_t* ring, FfnShared& sm) {
  const int b = blockIdx.x, grid = gridDim.x;
  uint64_t* full = sm.full;
  uint64_t* empty = sm.empty;
  if (b < a.router_rows) {  // the block's first router row, ahead of every chunk in the memory system's queues
    const float* row = b == a.n_experts ? a.gate_inp : a.w_router + static_cast<int64_t>(b) * a.hidden;
    const uint32_t bytes = static_cast<uint32_t>(a.hidden) * 4;
    mbar_arrive_expect_tx(&sm.row_landed, bytes);
    bulk_copy_to_smem(ring + static_cast<size_t>(kFfnStages) * a.stage_bytes + a.router_row_offset, row, bytes,
                      &sm.row_landed);
  }
  uint32_t ids = 0;
  int q = 0;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int kind = phase_kind(p);
    if (kind == kRG && w.n[kRG] + w.n[kRD] > 0) {  // routed rows: once the block's router warp has the ids
#if TM_FFN_IDS_PROBE
      ids = 0x03020100u;  // timing only: experts 0, 1, 2, 3 at once, as if the ids were known at the start
#else
      wait_set(&sm.ids_ready);
      ids = *reinterpret_cast<volatile uint32_t*>(&sm.ids_packed);
#endif
      ffn_stamp(kEvIds);
    }
    for (int i = 0; i < w.n[kind]; ++i, ++q) {
      const Chunk c = chunk_of(a, w, b, grid, kind, i);
      const int stage = q % kFfnStages;
      if (q >= kFfnStages) mbar_wait(&empty[stage], ((q / kFfnStages) - 1) & 1);
      if (q >= kFfnInFlight) {  // chunk q - kFfnInFlight has landed (its stage is not refilled before chunk q)
        const int back = q - kFfnInFlight;
        mbar_wait(&full[back % kFfnStages], (back / kFfnStages) & 1);
      }
      stamp_chunk(q, 0);
      uint8_t* dst = ring + static_cast<size_t>(stage) * a.stage_bytes;
      const int64_t e = static_cast<int64_t>((ids >> (8 * c.slot)) & 0xffu);
      if (kind == kSG || kind == kRG) {  // gate rows at 0, up rows at kTileRows rows
        const int64_t row = (kind == kRG ? e * a.ffn : 0) + c.first;
        const uint32_t bytes = static_cast<uint32_t>(c.n) * a.rb_h;
        const uint8_t* g = (kind == kRG ? a.w_gate : a.w_gate_sh) + row * a.rb_h;
        const uint8_t* u = (kind == kRG ? a.w_up : a.w_up_sh) + row * a.rb_h;
        mbar_arrive_expect_tx(&full[stage], 2 * bytes);
        bulk_copy_to_smem(dst, g, bytes, &full[stage]);
        bulk_copy_to_smem(dst + kTileRows * a.rb_h, u, bytes, &full[stage]);
      } else if (kind == kSD) {
        const uint32_t bytes = static_cast<uint32_t>(c.n) * a.rb_fs;
        mbar_arrive_expect_tx(&full[stage], bytes);
        bulk_copy_to_smem(dst, a.w_down_sh + static_cast<int64_t>(c.first) * a.rb_fs, bytes, &full[stage]);
      } else {
        const uint32_t bytes = static_cast<uint32_t>(c.n) * a.rb_f;
        mbar_arrive_expect_tx(&full[stage], bytes);
        bulk_copy_to_smem(dst, a.w_down + (e * a.hidden + c.first) * a.rb_f, bytes, &full[stage]);
      }
    }
  }
  ffn_stamp(kEvIssuedAll);
}

// Router warp: the router rows b, b + G, ... (row n_experts: the shared-expert gate), then the block's own top-k
// of every logit (router.cuh's function on the same values: every block gets the ids and weights bit for bit;
// block 0 writes them out), handed to the producer; then it watches the other blocks' act flags for the
// consumers, so that no consumer polls global memory at a phase boundary.
__device__ __forceinline__ void ffn_router(const FfnArgs& a, const float* h_s, const float* row_s, uint32_t tag,
                                           FfnShared& sm) {
  const int lane = threadIdx.x & 31;
  const FfnSync sy = ffn_sync(a.scratch);
  for (int r = blockIdx.x; r < a.router_rows; r += gridDim.x) {
    const bool gate_row = r == a.n_experts;
    const float* row = gate_row ? a.gate_inp : a.w_router + static_cast<int64_t>(r) * a.hidden;
    float v;
    if (r == static_cast<int>(blockIdx.x)) {  // the producer's copy (qdot.cuh: the same bits from shared memory)
      mbar_wait(&sm.row_landed, 0);
      v = warp_dot_f32x4_row_smem(row_s, h_s, a.hidden);
    } else {
      v = warp_dot_f32_row(gate_row ? a.gate_mode : a.router_mode, row, h_s, a.hidden);
    }
    if (lane == 0) {
      if (gate_row) {
        const float g = sigmoid_f32(v);
        a.gate_out[0] = g;
        tagged_store(sy.gate, tag, __float_as_uint(g));
      } else {
        tagged_store(sy.logits + r, tag, __float_as_uint(v));
      }
    }
  }
  float l[2];
  wait_tagged_logits(sy.logits, a.n_experts, tag, l);
  router_topk_warp(l[0], l[1], a.n_experts, a.top_k, a.normalize, sm.list, sm.ids, sm.weights);
  if (lane == 0) {  // lane 0 wrote the picks
    uint32_t packed = 0;
    for (int s = 0; s < a.top_k; ++s) {
      packed |= (static_cast<uint32_t>(sm.ids[s]) & 0xffu) << (8 * s);
      if (blockIdx.x == 0) {
        a.ids[s] = sm.ids[s];
        a.weights[s] = sm.weights[s];
      }
    }
    sm.ids_packed = packed;
    __threadfence_block();
    *reinterpret_cast<volatile uint32_t*>(&sm.ids_ready) = 1;
    ffn_stamp(kEvPublished);
  }
  wait_all_released(sy.sh_done, 2 * gridDim.x, tag, lane);
  if (lane == 0) {
    sm.gate = a.gate_inp != nullptr ? __uint_as_float(wait_tagged(sy.gate, tag)) : 1.0f;
    ffn_stamp(kEvShReady);
    mbar_arrive(&sm.sh_ready);  // release: sm.gate and what the fence acquired, to the consumers that wait on it
  }
  wait_all_released(sy.rt_done, 2 * gridDim.x, tag, lane);
  if (lane == 0) {
    ffn_stamp(kEvRtReady);
    mbar_arrive(&sm.rt_ready);
  }
}

// Consumer warps. FH: the gate/up rows' layout, FS / FR: the shared / routed down rows'; V: float4 activation loads.
template <Fmt FH, Fmt FS, Fmt FR, bool V>
__device__ __forceinline__ void ffn_consumer(const FfnArgs& a, const BlockWork& w, uint8_t* ring, float* h_s,
                                             float* s_sh, float* s_rt, FfnShared& sm) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = warp / kFfnGroupWarps, wg = warp % kFfnGroupWarps;
  const int b = blockIdx.x, grid = gridDim.x;
  const bool stamper = wg == 0 && lane == 0;
  const FfnSync sy = ffn_sync(a.scratch);
  pdl_wait();
  pdl_trigger();
  if (threadIdx.x == 0) ffn_stamp(kEvWaited);
  unsigned long long ticket = 0;
  if (threadIdx.x == 0) ticket = atomicAdd(sy.ticket, 1ull);  // its round trip overlaps the norm
  if (g == 0)
    block_rmsnorm(a.x, a.norm_w, a.hidden, a.eps, h_s, b == 0 ? a.h : nullptr, sm.norm, NormWarpsBarrier<1>{});
  if (threadIdx.x == 0) {
    const uint32_t epoch = static_cast<uint32_t>(ticket >> 32);
    // Every other block of this call has its ticket: the next call's epoch, from count 0.
    if (static_cast<uint32_t>(ticket) == static_cast<uint32_t>(grid) - 1)
      *sy.ticket = static_cast<unsigned long long>(epoch + 1) << 32;
    sm.tag = epoch + 1;
  }
  named_barrier<kFfnConsumers + 32>(kBarH);
  const uint32_t tag = sm.tag;
  if (threadIdx.x == 0) ffn_stamp(kEvH);

  const int nb_h = a.hidden / 32, nb_fs = a.ffn_sh / 32, nb_f = a.ffn / 32;
  // Gate-up: a row pair (gate row, up row) a warp; act = silu(g) * u (moe.cuh's gate_up_block).
  auto gate_up = [&](const Chunk& c, const uint8_t* st, float* act) {
    if (wg >= c.n) return;
    const uint8_t* wr[2] = {st + wg * a.rb_h, st + (kTileRows + wg) * a.rb_h};
    const float* xs[1] = {h_s};
    float gu[2][1];
    warp_dot<FH, 2, 1, true, true, true>(wr, xs, nb_h, gu);
    if (lane == 0) act[c.first + wg] = __fmul_rn(silu_f32(gu[0][0]), gu[1][0]);
  };
  // moe_experts_down.cu's shared term: w_eff * dot(W_down_sh[r], act_sh), w_eff the gate (1 without one)
  auto shared_down = [&](const Chunk& c, const uint8_t* st) {
    if (wg >= c.n) return;
    const uint8_t* wr[1] = {st + wg * a.rb_fs};
    const float* xs[1] = {a.act_sh};
    float d[1][1];
    warp_dot<FS, 1, 1, false, V, true>(wr, xs, nb_fs, d);
    if (lane == 0) s_sh[c.first - w.row0 + wg] = __fmul_rn(sm.gate, d[0][0]);
  };
  // moe_experts_down.cu's routed terms: w_eff * dot(W_down[e][r], act[s]) for a row pair sharing the slot's activations
  auto routed_down = [&](const Chunk& c, const uint8_t* st) {
    if (2 * wg >= c.n) return;
    const uint8_t* wr[2] = {st + 2 * wg * a.rb_f, st + (2 * wg + 1) * a.rb_f};
    const float* xs[1] = {a.act + c.slot * a.ffn};
    float d[2][1];
    warp_dot<FR, 2, 1, true, V, true>(wr, xs, nb_f, d);
    if (lane == 0) {
      const int i = c.first - w.row0 + 2 * wg;
      const float we = sm.weights[c.slot];
      s_rt[i * a.top_k + c.slot] = __fmul_rn(we, d[0][0]);
      s_rt[(i + 1) * a.top_k + c.slot] = __fmul_rn(we, d[1][0]);
    }
  };

#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int kind = phase_kind(p), begin = w.begin[p], end = w.begin[p + 1];
    const int first = begin + ((begin ^ g) & 1);  // the group's chunks: q % 2 == g
    if (first < end && (kind == kSD || kind == kRD)) {  // inputs from every block: the router warp watched
      mbar_wait(kind == kSD ? &sm.sh_ready : &sm.rt_ready, 0);
      if (stamper) ffn_stamp(kEvWaitEnd0 + 2 * p + g);
    }
    // (an RG chunk is copied only once the ids are out: its stage's barrier orders them for the consumer)
    for (int q = first; q < end; q += 2) {
      const int stage = q % kFfnStages;
      const Chunk c = chunk_of(a, w, b, grid, kind, q - begin);
      mbar_wait(&sm.full[stage], (q / kFfnStages) & 1);
      if (stamper) stamp_chunk(q, 1);
      const uint8_t* st = ring + static_cast<size_t>(stage) * a.stage_bytes;
      if (kind == kSG) gate_up(c, st, a.act_sh);
      else if (kind == kRG) gate_up(c, st, a.act + c.slot * a.ffn);
      else if (kind == kSD) shared_down(c, st);
      else routed_down(c, st);
      __syncwarp();
      if (lane == 0) mbar_arrive(&sm.empty[stage]);
      if (stamper) stamp_chunk(q, 2);
    }
    if (kind == kSG || kind == kRG) {  // the group's activations are stored: release them to every block
      named_barrier<kFfnGroupWarps * 32>(1 + g);
      if (wg == 0 && lane == 0) flag_release((kind == kSG ? sy.sh_done : sy.rt_done) + 2 * b + g, tag, 0);
    }
    if (stamper) ffn_stamp(kEvPhaseEnd0 + 2 * p + g);
  }

  named_barrier<kFfnConsumers>(kBarConsumers);  // both groups' terms are in shared memory
  // x = ((x + shared) + w_0 y_0) + ... (experts_down_kernel's order)
  for (int i = threadIdx.x; i < w.rows; i += kFfnConsumers) {
    float* xo = a.x + w.row0 + i;
    float acc = __fadd_rn(__ldcg(xo), s_sh[i]);  // in place: read around L1 (common.cuh)
    for (int s = 0; s < a.top_k; ++s) acc = __fadd_rn(acc, s_rt[i * a.top_k + s]);
    *xo = acc;
  }
  if (threadIdx.x == 0) ffn_stamp(kEvDone);
}

template <Fmt FH, Fmt FS, Fmt FR, bool V>
__global__ void __launch_bounds__(kFfnThreads, 1) router_experts_ffn_kernel(const FfnArgs a) {
  static_assert(kFfnGroupWarps * 32 == kNormThreads, "group 0 computes norm.cuh's tree");
  extern __shared__ __align__(128) uint8_t ffn_smem[];  // the ring, h, the shared and routed terms
  __shared__ FfnShared sm;
  uint8_t* ring = ffn_smem;
  float* h_s = reinterpret_cast<float*>(ffn_smem + static_cast<size_t>(kFfnStages) * a.stage_bytes);
  float* s_sh = h_s + router_h_floats(a.hidden);
  float* s_rt = s_sh + a.rows_max;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    ffn_stamp(kEvStart);
    sm.tag = sm.ids_ready = 0;
    for (int s = 0; s < kFfnStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], kFfnGroupWarps);
    }
    mbar_init(&sm.sh_ready, 1);
    mbar_init(&sm.rt_ready, 1);
    mbar_init(&sm.row_landed, 1);
    mbar_init_fence();
  }
  __syncthreads();
  const BlockWork w = block_work(a, blockIdx.x, gridDim.x);
  if (warp == kFfnProducerWarp) {
    if (lane == 0) ffn_producer(a, w, ring, sm);
    return;
  }
  if (warp == kFfnRouterWarp) {
    pdl_wait();
    named_barrier<kFfnConsumers + 32>(kBarH);
    ffn_router(a, h_s, reinterpret_cast<const float*>(ring + static_cast<size_t>(kFfnStages) * a.stage_bytes +
                                                       a.router_row_offset),
               sm.tag, sm);
    return;
  }
  ffn_consumer<FH, FS, FR, V>(a, w, ring, h_s, s_sh, s_rt, sm);
}

// The persistent launch's plan for these shapes on the device of `lim`; false where it does not apply: another
// format, a prefill, more slots or experts than it packs or ranks, rows whose chunks are not whole 16-byte copies
// (gate/up and shared-down rows of a multiple of 256 values; routed down rows of a multiple of 128, copied in
// pairs), no bulk copies (compute capability < 9), too little shared memory, or not chosen (tm_set_ffn_one_launch;
// off by default: on the H200 it measured slower than the two launches, results/NOTES.md v5).
struct FfnPlan {
  int grid;
  uint32_t rb_h, rb_fs, rb_f, stage;
  int rows_max;
  uint32_t router_row_offset;  // after the ring: h, the shared and routed terms, then the router row's copy
  int64_t smem;
};
bool ffn_plan(const Limits& lim, int qtype, int64_t n_tokens, int64_t n_experts, int64_t top_k, int64_t hidden,
              int64_t ffn_sh, int64_t ffn, FfnPlan* p) {
  if (!lim.ffn_one_launch || lim.cc_major < 9 || qtype != TM_Q8_0_TILED || n_tokens != 1 || top_k < 1 ||
      top_k > kFfnMaxSlots || n_experts < top_k || n_experts > kFfnMaxExperts || hidden % 256 != 0 ||
      ffn_sh % 256 != 0 || ffn % 128 != 0 || hidden <= 0 || ffn_sh <= 0 || ffn <= 0 || hidden > (1 << 20) ||
      ffn_sh > (1 << 20) || ffn > (1 << 20))
    return false;
  p->grid = lim.sm_count < kFfnMaxBlocks ? lim.sm_count : kFfnMaxBlocks;
  p->rb_h = static_cast<uint32_t>(tm_qtype_row_bytes(TM_Q8_0, hidden));
  p->rb_fs = static_cast<uint32_t>(tm_qtype_row_bytes(TM_Q8_0, ffn_sh));
  p->rb_f = static_cast<uint32_t>(tm_qtype_row_bytes(TM_Q8_0, ffn));
  const int64_t stage = std::max({int64_t{2} * kTileRows * p->rb_h, int64_t{kSdRows} * p->rb_fs,
                                  int64_t{kRdRows} * p->rb_f});
  p->stage = static_cast<uint32_t>(ceil_div(stage, 128) * 128);
  p->rows_max = 2 * static_cast<int>(ceil_div(hidden / 2, p->grid));
  p->router_row_offset =
      static_cast<uint32_t>(ceil_div(4 * (router_h_floats(hidden) + int64_t{p->rows_max} * (1 + top_k)), 16) * 16);
  p->smem = int64_t{kFfnStages} * p->stage + p->router_row_offset + 4 * hidden;
  return p->grid >= 1 && p->smem + 1024 <= lim.smem_block;  // 1 KB: the static shared memory
}

}  // namespace
}  // namespace tm_cuda

using namespace tm_cuda;

// The persistent launch where it applies (shapes, formats, alignment, the device, chosen), else TM_NOT_APPLICABLE:
// dispatch.cpp then makes the two calls it stands for (the same bits).
extern "C" int tm_cuda_router_experts_ffn(float* x, const float* norm_w, float eps, float* h,
                                          const float* w_router, int32_t* ids, float* weights, int qtype,
                                          const void* w_gate_sh, const void* w_up_sh, const void* w_down_sh,
                                          float* act_sh, int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh,
                                          const void* w_gate, const void* w_up, const void* w_down, float* act,
                                          int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k,
                                          int normalize, int64_t ffn, int32_t* scratch, void* stream) {
  const char* fn = "tm_router_experts_ffn";
  Limits lim;
  TM_TRY(get_limits(&lim));
  FfnPlan plan;
  bool fits = ffn_plan(lim, qtype, n_tokens, n_experts, top_k, hidden, ffn_sh, ffn, &plan);
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(h), w_gate_sh, w_up_sh, w_down_sh,
                        w_gate, w_up, w_down, static_cast<const void*>(act_sh), static_cast<const void*>(act),
                        static_cast<const void*>(w_router), static_cast<const void*>(gate_inp_sh)})
    fits = fits && aligned(p, 16);  // the copies' alignment (a null gate row is)
  if (!fits) return TM_NOT_APPLICABLE;
  FfnArgs a{};
  a.x = x;
  a.norm_w = norm_w;
  a.eps = eps;
  a.h = h;
  a.w_router = w_router;
  a.router_mode = f32_row_mode(hidden, aligned(w_router, 16));
  a.gate_inp = gate_inp_sh;
  a.gate_mode = f32_row_mode(hidden, aligned(gate_inp_sh, 16));
  a.gate_out = gate_sh;
  a.ids = ids;
  a.weights = weights;
  a.normalize = normalize;
  a.w_gate_sh = static_cast<const uint8_t*>(w_gate_sh);
  a.w_up_sh = static_cast<const uint8_t*>(w_up_sh);
  a.w_down_sh = static_cast<const uint8_t*>(w_down_sh);
  a.w_gate = static_cast<const uint8_t*>(w_gate);
  a.w_up = static_cast<const uint8_t*>(w_up);
  a.w_down = static_cast<const uint8_t*>(w_down);
  a.act_sh = act_sh;
  a.act = act;
  a.scratch = scratch;
  a.hidden = static_cast<int>(hidden);
  a.ffn_sh = static_cast<int>(ffn_sh);
  a.ffn = static_cast<int>(ffn);
  a.n_experts = static_cast<int>(n_experts);
  a.top_k = static_cast<int>(top_k);
  a.rb_h = plan.rb_h;
  a.rb_fs = plan.rb_fs;
  a.rb_f = plan.rb_f;
  a.stage_bytes = plan.stage;
  a.n_sg = static_cast<int>(ceil_div(ffn_sh, kTileRows));
  a.rg_tiles = static_cast<int>(ceil_div(ffn, kTileRows));
  a.rows_max = plan.rows_max;
  a.router_rows = static_cast<int>(n_experts) + (gate_inp_sh != nullptr ? 1 : 0);
  a.router_row_offset = plan.router_row_offset;
  const bool v = aligned(act_sh, 16) && aligned(act, 16) && ffn % 4 == 0;  // the downs' activation loads
  const cudaStream_t s = as_stream(stream);
  auto run = [&](auto kernel) -> int {
    TM_TRY(ensure_dynamic_smem(reinterpret_cast<const void*>(kernel), plan.smem, fn));
    return launch(lim, fn, kernel, dim3(static_cast<unsigned>(plan.grid)), dim3(kFfnThreads),
                  static_cast<size_t>(plan.smem), s, a);
  };
  // gate/up and shared down rows are whole 16-byte tiled rows (the copies' alignment asks for them); the routed down
  // rows may be Q8_0T (rows of an odd multiple of 128 values)
  constexpr Fmt T16 = Fmt::Q8_0T16, T8 = Fmt::Q8_0T;
  if (fmt_for(TM_Q8_0_TILED, ffn) == T16)
    return v ? run(router_experts_ffn_kernel<T16, T16, T16, true>) : run(router_experts_ffn_kernel<T16, T16, T16, false>);
  return v ? run(router_experts_ffn_kernel<T16, T16, T8, true>) : run(router_experts_ffn_kernel<T16, T16, T8, false>);
}

extern "C" int tm_cuda_router_experts_ffn_launches(int qtype, int64_t n_tokens, int64_t n_experts, int64_t top_k,
                                                   int64_t hidden, int64_t ffn_sh, int64_t ffn) {
  Limits lim;
  TM_TRY(get_limits(&lim));
  FfnPlan plan;
  return ffn_plan(lim, qtype, n_tokens, n_experts, top_k, hidden, ffn_sh, ffn, &plan) ? 1 : 2;
}

#if TM_FFN_TIMELINE
// The measurement build's stamps (ffn_timeline above): up to `blocks` rows of kFfnEvents u64 into host memory, then
// zeroed. Returns the events per row, or -1.
extern "C" TM_API int64_t tm_cuda_ffn_timeline(void* host, int64_t blocks) {
  const int64_t n = blocks < kFfnMaxBlocks ? blocks : kFfnMaxBlocks;
  void* dev = nullptr;
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(host, ffn_timeline, static_cast<size_t>(n) * sizeof(ffn_timeline[0])) != cudaSuccess ||
      cudaGetSymbolAddress(&dev, ffn_timeline) != cudaSuccess ||
      cudaMemset(dev, 0, sizeof(ffn_timeline)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return -1;
  return kFfnEvents;
}
#endif
