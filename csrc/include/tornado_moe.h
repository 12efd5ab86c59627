/*
 * tornado_moe.h - the one C ABI of the tornado-moe kernel set.
 *
 * Every kernel is a plain C function taking raw pointers, sizes and a stream handle. The torch ops
 * (csrc/torch) and the JNI natives (csrc/jni) only marshal their arguments into these functions.
 *
 * Conventions (apply to every function below):
 *  - `device` is TM_DEVICE_CPU (host pointers, synchronous, `stream` ignored) or TM_DEVICE_CUDA (device
 *    pointers, asynchronous on `stream`, a cudaStream_t; 0 means the legacy default stream).
 *  - Activations, norms weights, biases, KV cache, logits: float32, row-major, contiguous.
 *  - Quantized weights are GGUF tensors exactly as stored in the file (raw bytes, row-major, each row a whole
 *    number of blocks). `qtype` is the GGML type id (tm_qtype). A matrix "W [rows, cols]" has `rows` rows of
 *    `cols` values (numpy order of the GGUF tensor); expert stacks "W [E, rows, cols]" are E such matrices
 *    back to back.
 *  - Integer sizes are int64_t; token ids, expert ids and positions are int32_t.
 *  - Return value: TM_OK (0) or a negative tm_status; tm_last_error() then holds a message (thread-local).
 *  - Determinism: no floating-point atomics; every reduction has a fixed order that does not depend on
 *    scheduling, on the launch configuration chosen for a size, or on CUDA-graph capture. Elementwise
 *    accumulations `acc = acc + w * v` are evaluated as a rounded multiply then a rounded add (no FMA
 *    contraction), in the order documented below.
 *  - CUDA launches use programmatic dependent launch (a kernel may start while its predecessor drains; it reads
 *    nothing the predecessor writes before the dependency is resolved), which never changes a result;
 *    TORNADO_MOE_PDL=0 in the environment turns it off.
 *  - Launch limits (CUDA): grid y/z never exceed 65535 and dynamic shared memory never exceeds the device's
 *    opt-in limit (read from the device); large problems are split into several launches or loops.
 *  - Positions: kernels that depend on the position read it from `pos` (device memory for CUDA), so that a
 *    captured CUDA graph can be replayed for every token after a device-side update. Token t of a call is at
 *    position pos[0] + t.
 */
#ifndef TORNADO_MOE_H
#define TORNADO_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define TM_API __declspec(dllexport)
#else
#define TM_API __attribute__((visibility("default")))
#endif

typedef enum tm_device { TM_DEVICE_CPU = 0, TM_DEVICE_CUDA = 1 } tm_device;

/* GGML type ids of the supported weight formats. */
typedef enum tm_qtype {
  TM_F32 = 0,   /* 4-byte floats */
  TM_F16 = 1,   /* IEEE half */
  TM_Q4_0 = 2,  /* 32 values: fp16 d, 16 bytes of nibbles (low nibbles = values 0..15, high = 16..31); v = (q-8)*d */
  TM_Q4_1 = 3,  /* 32 values: fp16 d, fp16 m, 16 bytes of nibbles as Q4_0; v = q*d + m */
  TM_Q5_0 = 6,  /* 32 values: fp16 d, 32 fifth bits (uint32, bit j = value j), 16 bytes of nibbles as Q4_0;
                 * v = (q-16)*d */
  TM_Q5_1 = 7,  /* 32 values: fp16 d, fp16 m, the fifth bits as Q5_0's, 16 bytes of nibbles as Q4_0; v = q*d + m */
  TM_Q8_0 = 8,  /* 32 values: fp16 d, 32 int8; v = q*d */
  TM_Q2_K = 10, /* 256 values in 16 sub-blocks of 16: 16 bytes of 4-bit scales (low nibble) and mins (high), 64
                 * bytes of 2-bit codes, fp16 d, fp16 dmin; value 128h + 32k + l (h < 2, k < 4, l < 32) is bits 2k,
                 * 2k+1 of code byte 32h + l; v = (d*sc)*q - dmin*m */
  TM_Q3_K = 11, /* 256 values in 16 sub-blocks of 16: 32 bytes hmask, 64 bytes of 2-bit codes as Q2_K's, 12 bytes
                 * of 6-bit scales, fp16 d; value 128h + 32k + l adds bit 4h+k of hmask[l] as its third bit;
                 * v = (d*(sc-32))*(q-4) (layout: ggml's dequantize_row_q3_K) */
  TM_Q4_K = 12, /* 256 values in 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[j] and mins
                 * m[j], 128 bytes of nibbles (bytes 32c..32c+31: low nibbles = sub-block 2c, high = 2c+1);
                 * v = (d*sc[j])*q - dmin*m[j] */
  TM_Q5_K = 13, /* Q4_K with a fifth bit: fp16 d, fp16 dmin, 12 bytes of scales and mins as Q4_K's, 32 bytes qh
                 * (bit j of qh[l] is the fifth bit of value l of sub-block j), 128 bytes of nibbles as Q4_K's */
  TM_Q6_K = 14, /* 256 values in 16 sub-blocks of 16: 128 bytes of low nibbles ql, 64 bytes of 2-bit high parts qh,
                 * 16 int8 scales, fp16 d; v = (d*scale[s])*(q-32) (value layout: ggml's dequantize_row_q6_K) */
  TM_IQ4_NL = 20, /* 32 values: fp16 d, 16 bytes of nibbles as Q4_0; v = d*kv[q], kv llama.cpp's 16 non-linear
                   * levels (-127 ... 113) */
  TM_IQ4_XS = 23, /* 256 values in 8 sub-blocks of 32: fp16 d, uint16 of 2-bit scale highs, 4 bytes of 4-bit scale
                   * lows, 128 bytes: sub-block j's 16 bytes as an IQ4_NL block's nibbles; v = (d*(ls-32))*kv[q] */
  TM_BF16 = 30, /* bfloat16 */
  /* Not a GGML type: Q8_0 rows re-laid out so that the GPU reads them with 8/16-byte loads (tornado_moe.quant.tiled
   * writes it). Same values, same bytes per row (34 per 32 values); rows of a multiple of 128 values, the tensor
   * 16-byte aligned on CUDA. A row of n values has nb = n/32 blocks and S = n/128 "steps" of 4 blocks; in step s, lane
   * l = 8 * (b % 4) + i / 4 of 32 owns the 4 codes i..i+3 (i % 4 == 0) of block b = 4s + l / 8. Steps form groups
   * of 4 (the last group holds the S % 4 remaining ones); in group g of w steps, lane l's code word of step
   * 4g + u is at byte 512g + 4(w*l + u) (+ i % 4 for the single code), and the fp16 scale of block b of that
   * step at byte 32*nb + 32g + 2(w*(b % 4) + u). qtypes.h's tm_q8t_code_offset / tm_q8t_scale_offset compute
   * them. Code bytes are the int8 q as the GGUF block stores them (tm_q8t_code reads one). */
  TM_Q8_0_TILED = 264
} tm_qtype;

typedef enum tm_status {
  TM_OK = 0,
  TM_ERR_INVALID_ARGUMENT = -1, /* null pointer, bad size, unknown enum value */
  TM_ERR_UNSUPPORTED_QTYPE = -2,/* weight format without a kernel */
  TM_ERR_NO_CUDA = -3,          /* library built without CUDA, or no CUDA device */
  TM_ERR_CUDA = -4,             /* a CUDA call or launch failed */
  TM_ERR_UNKNOWN_KERNEL = -5    /* tm_invoke with an unknown kernel index */
} tm_status;

/* ---- library and device ------------------------------------------------------------------------------ */
TM_API const char* tm_last_error(void);
TM_API const char* tm_version(void);
/* 1 when the library was compiled with the CUDA kernels, else 0. */
TM_API int tm_cuda_compiled(void);
/* Number of visible CUDA devices (0 without CUDA). Never fails. */
TM_API int tm_cuda_device_count(void);
/* Properties of the current CUDA device, read from the device (never hard-coded). */
typedef struct tm_device_props {
  int sm_count;
  int max_grid_y;              /* 65535 on every current GPU */
  int max_grid_z;
  int64_t smem_per_block_optin;/* bytes of shared memory a block may opt in to */
  int64_t l2_bytes;
  char name[256];
} tm_device_props;
TM_API int tm_cuda_device_props(tm_device_props* out);
/* Test hook: cap the opt-in shared memory and grid y/z limits the CUDA launchers plan with (0 = device value),
 * so that tests can force the chunked/looped launch paths on small problems. */
TM_API int tm_set_launch_limits_for_testing(int64_t smem_per_block, int max_grid_yz);
/* Whether tm_router_experts_ffn may run as its persistent launch where that applies (1) or always as its two
 * launches (0); -1 restores the process default, the environment's TORNADO_MOE_FFN_ONE_LAUNCH=1 (on) or
 * anything else (off: on the H200 the one launch measured slower, results/NOTES.md v5). Graphs built after the
 * call follow it (tm_router_experts_ffn_launches). */
TM_API int tm_set_ffn_one_launch(int on);
/* Whole-stream CUDA graphs for callers without their own graph API (the Java route). */
TM_API int tm_cuda_graph_begin_capture(void* stream);
TM_API int tm_cuda_graph_end_capture(void* stream, void** graph_exec_out);
TM_API int tm_cuda_graph_launch(void* graph_exec, void* stream);
TM_API int tm_cuda_graph_destroy(void* graph_exec);
TM_API int tm_stream_synchronize(tm_device device, void* stream);

/* ---- kernels ------------------------------------------------------------------------------------------ */

/* out[t, :] = dequant(table[ids[t], :]); table [vocab, dim] of qtype. */
TM_API int tm_embedding(tm_device device, int qtype, const void* table, const int32_t* ids, float* out,
                        int64_t n_tokens, int64_t vocab, int64_t dim, void* stream);

/* y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w. The sum of squares is accumulated in float32 in a
 * fixed tree. x and y may alias. */
TM_API int tm_rmsnorm(tm_device device, const float* x, const float* w, float* y, int64_t n_tokens, int64_t dim,
                      float eps, void* stream);

/* The two factors of the deferred RMSNorm: xw[t, i] = x[t, i] * w[i] (a rounded product) and
 * inv[t] = 1 / sqrt(ss / dim + eps) (IEEE division and square root), so that y = (x * inv) * w is the row's RMSNorm.
 * A normalised product is then dot(W, xw) * inv (tm_matmul's scale): xw needs no reduction, so the kernel that
 * writes x can write it too, and a kernel that consumes it streams its weights at once and needs inv only after the
 * dot product (results/NOTES.md v10-v11). ss has its own order, the grouped sum, so that the kernel that writes x
 * can also leave its partial sums: xss[t, g] (g < tm_norm_groups(dim); xss nullable) = ((x0*x0 + x1*x1) + x2*x2) +
 * x3*x3 over x[t, 4g .. 4g + 3] (TM_NORM_GROUP values; fewer at the row's end), each product and sum rounded;
 * lane l of 32 sums its chunk of c = ceil(groups / 32) consecutive groups, xss[t, l*c .. l*c + c - 1], in
 * increasing order, and the 32 lane sums are added as a butterfly (m = 16, 8, 4, 2, 1: s_l = s_l + s_(l xor m));
 * ss is that total. x and xw may alias. */
TM_API int tm_rmsnorm_factors(tm_device device, const float* x, const float* w, float* xw, float* xss, float* inv,
                              int64_t n_tokens, int64_t dim, float eps, void* stream);

/* Values per group of tm_rmsnorm_factors' grouped sum, and the groups (xss's floats) of a row of dim values. */
#define TM_NORM_GROUP 4
static inline int64_t tm_norm_groups(int64_t dim) { return (dim + TM_NORM_GROUP - 1) / TM_NORM_GROUP; }

/* Int8 activation groups. Every product with Q8_0 weights multiplies its float32 activations rounded in groups of 4
 * consecutive values: codes q_i = rint(x_i / 2^e) in [-127, 127] with the group's power-of-two scale 2^e, the
 * smallest with max |x_i| / 2^e < 127.5 (csrc/common/act_quant.h defines it; groups below 2^-100 are 0, a NaN or
 * infinity makes the group NaN). A kernel that writes activations may also write their groups ("groups"
 * arguments, nullable, 16-byte aligned), so that the next product reads them instead of rounding the floats in
 * every warp that multiplies them: the same values, so the same bits. A row of n values (n a multiple of 4) takes
 * tm_act_groups_bytes(n) bytes: per 512 values 1024 bytes, lane l's 4 codes of steps u = 0..3 at 16 l + 4 u, then
 * their float scales at 512 + 16 l + 4 u, group j being step j / 32 of lane j % 32. Where a function says so, its
 * groups are written by both devices; the CPU's products read the floats (the same values). */
static inline int64_t tm_act_groups_bytes(int64_t n) { return (n + 511) / 512 * 1024; }

/* Quantized matrix product. y[t, r] = dot(W[r, :], x[t, :]) (* scale[t] if scale) (+ bias[r] if bias), each a
 * rounded operation; if accumulate: y[t, r] = y[t, r] + that (residual add fused). W [rows, cols] of qtype; bias
 * nullable (float32 [rows]); scale nullable (float32 [n_tokens]: tm_rmsnorm_factors' inv, so that x = xw gives the
 * normalised product). x_groups (nullable; [T, tm_act_groups_bytes(cols)] bytes): x's int8 groups as the
 * kernel that wrote x wrote them (tm_attention's out_groups), read instead of rounding x. x_sums (nullable, not
 * with scale; float32 [n_tokens, tm_norm_groups(cols)]): x's grouped sums of squares as tm_rmsnorm_factors writes
 * xss; the product is then scaled by the inv tm_rmsnorm_factors would compute from them with eps (the same bits),
 * so that a kernel that wrote xw and xss (tm_experts_down_accumulate) needs no norm launch before this one.
 * next_norm_w, y_w and y_ss (all or none; float32 [rows], [T, rows] and [T, tm_norm_groups(rows)]): also the next
 * normalisation's factors of the y written here, y_w = y * next_norm_w and y's grouped sums of squares, as
 * tm_rmsnorm_factors writes xw and xss (the same bits), so that its consumer needs no norm launch (attn_output for
 * the shared expert's gate-up: tm_router_experts_gate_up's xw and xss). y_w_groups (nullable, only with y_w, rows a
 * multiple of 4; [T, tm_act_groups_bytes(rows)] bytes): y_w's int8 groups too. CUDA writes them in the product's own
 * launch for one token with rows a multiple of 8 and no scale, else in a second launch after it. */
TM_API int tm_matmul(tm_device device, int qtype, const void* w, const float* x, const float* bias, float* y,
                     int64_t n_tokens, int64_t rows, int64_t cols, int accumulate, const float* scale,
                     const uint8_t* x_groups, const float* x_sums, float eps, const float* next_norm_w, float* y_w,
                     float* y_ss, uint8_t* y_w_groups, void* stream);

/* RoPE and KV-cache append. q [T, n_heads, head_dim] is rotated in place; k [T, n_kv, head_dim] is rotated and
 * written with v [T, n_kv, head_dim] to k_cache/v_cache [max_ctx, n_kv, head_dim] at row pos[0] + t.
 * neox = 1: pairs (i, i + head_dim/2) (GPT-NeoX / qwen2moe); neox = 0: pairs (2i, 2i+1) (GGUF llama).
 * theta_i = pos * freq_base^(-2i/head_dim). Fails if pos[0] + T > max_ctx (CPU checks; CUDA skips the write). */
TM_API int tm_rope_kv_append(tm_device device, float* q, const float* k, const float* v, float* k_cache,
                             float* v_cache, const int32_t* pos, int64_t n_tokens, int64_t n_heads,
                             int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx, float freq_base, int neox,
                             void* stream);

/* The attention input of a layer in one launch: (xw, inv) = tm_rmsnorm_factors(x, norm_w, eps); q = W_q xw * inv
 * + b_q, k = W_k xw * inv + b_k, v = W_v xw * inv + b_v as tm_matmul with scale inv (W_q [n_heads * head_dim,
 * hidden], W_k and W_v [n_kv_heads * head_dim, hidden], all of qtype; biases nullable); then RoPE and the KV append
 * as tm_rope_kv_append: the rotated q into q [T, n_heads, head_dim], the rotated k and v into k_cache/v_cache at row
 * pos[0] + t. Bitwise the result of those five calls in sequence on the same device; k and v are never stored.
 * xw and xss (both or neither, [T, hidden] and [T, tm_norm_groups(hidden)]): x * norm_w and x's partial sums of
 * squares (tm_rmsnorm_factors') as the kernel that wrote x also wrote them (tm_experts_down_accumulate's xw and
 * xss); NULL: computed here (the same bits, later). xw_groups (nullable, only with xw; [T,
 * tm_act_groups_bytes(hidden)] bytes): xw's int8 groups as that kernel wrote them. */
TM_API int tm_qkv_rope(tm_device device, int qtype, const float* x, const float* xw, const float* xss,
                       const float* norm_w, float eps, const void* w_q,
                       const void* w_k, const void* w_v, const float* b_q, const float* b_k, const float* b_v, float* q,
                       float* k_cache, float* v_cache, const int32_t* pos, int64_t n_tokens, int64_t hidden,
                       int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t max_ctx, float freq_base,
                       int neox, const uint8_t* xw_groups, void* stream);

/* int32 words of the scratch tm_attention needs: one record per (token, head) pair, an arrival counter (4 words)
 * then 8 partial results of head_dim + 2 floats. Pair p's record is at the same place whatever n_tokens a call has,
 * so calls of different token counts may share one scratch. */
static inline int64_t tm_attention_scratch_words(int64_t n_tokens, int64_t n_heads, int64_t head_dim) {
  return n_tokens * n_heads * (4 + 8 * (head_dim + 2));
}

/* Causal attention over the cache (grouped-query: head h reads kv head h / (n_heads / n_kv_heads)).
 * out[t, h, :] = sum_j softmax_j(q[t,h,:] . k_cache[j,kvh,:] / sqrt(head_dim)) v_cache[j, kvh, :],
 * j = 0 .. pos[0] + t. q, out [T, n_heads, head_dim]. scratch: int32 [tm_attention_scratch_words(n_tokens, n_heads,
 * head_dim)], all zero before the first call; CUDA merges a context of more than 128 positions through it (the
 * counters are back at zero after every call, and a call of any token count may follow one of another) and the CPU
 * does not touch it. Calls sharing a scratch must not run at the same time (one stream does that). out_groups
 * (nullable, head_dim a multiple of 4; [T, tm_act_groups_bytes(n_heads * head_dim)] bytes): also out's int8
 * groups (rows of n_heads * head_dim values), for the output projection. */
TM_API int tm_attention(tm_device device, const float* q, const float* k_cache, const float* v_cache, float* out,
                        const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t n_kv_heads,
                        int64_t head_dim, int64_t max_ctx, int32_t* scratch, uint8_t* out_groups, void* stream);

/* Router: logits[e] = dot(w_router[e, :], h[t, :]) (w_router float32 [E, hidden]); p = softmax over all E
 * (float32, max-subtracted); top_k largest p, ties to the lowest expert id, in descending order of p.
 * ids [T, top_k] int32, weights [T, top_k] float32 = p of the selected experts, divided by their sum when
 * normalize != 0 (Mixtral / norm_topk_prob) and kept as is otherwise (qwen2moe). */
TM_API int tm_router_topk(tm_device device, const float* w_router, const float* h, int32_t* ids, float* weights,
                          int64_t n_tokens, int64_t n_experts, int64_t hidden, int64_t top_k, int normalize,
                          void* stream);

/* h = rmsnorm(x, norm_w, eps) written to h [T, hidden], then tm_router_topk on it, in one launch: bitwise the result
 * of tm_rmsnorm followed by tm_router_topk on the same device. */
TM_API int tm_rmsnorm_router_topk(tm_device device, const float* x, const float* norm_w, float eps, float* h,
                                  const float* w_router, int32_t* ids, float* weights, int64_t n_tokens,
                                  int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, void* stream);

/* Routed experts, gate-up + SwiGLU, for the slots [slot_begin, slot_begin + slot_count) of every token:
 * e = ids[t, s]; act[t, s, :] = silu(W_gate[e] h[t]) * (W_up[e] h[t]), silu(g) = g / (1 + exp(-g)).
 * w_gate, w_up [n_experts, ffn, hidden] of qtype; h [T, hidden]; ids [T, top_k]; act [T, top_k, ffn].
 * scale (nullable; float32 [T]): g and u of token t each multiplied by scale[t] (a rounded product) before the
 * SwiGLU: with h = tm_rmsnorm_factors' xw and scale its inv, the gate-up of the normalised row in the deferred form
 * (the shared expert's: tm_router_experts_gate_up's xw).
 * The fused task calls it once with (0, top_k); the per-slot tasks once per slot with (s, 1): the result for a
 * given (t, s) is bitwise the same either way. ids == NULL means expert 0 for every slot (a dense FFN or a
 * shared expert is this function with n_experts = 1, top_k = 1). On CUDA a call of several tokens and at most
 * 4,096 (token, slot) pairs runs as grouped GEMMs (a block per expert and row tile, each row read once per 4 of its
 * tokens): the same bits as a block per pair, which one token and larger calls take. */
TM_API int tm_moe_gate_up(tm_device device, int qtype, const void* w_gate, const void* w_up, const float* h,
                          const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t slot_begin,
                          int64_t slot_count, int64_t n_experts, int64_t ffn, int64_t hidden, const float* scale,
                          void* stream);

/* The shared expert's gate-up and every routed slot's, in one launch: bitwise
 *   tm_moe_gate_up(w_gate_sh, w_up_sh, h, NULL, act_sh, n_tokens, 1, 0, 1, 1, ffn_sh, hidden) followed by
 *   tm_moe_gate_up(w_gate, w_up, h, ids, act, n_tokens, top_k, 0, top_k, n_experts, ffn, hidden)
 * (the two write different buffers and read only h and ids, so their order is free); one grid instead of two
 * saves a launch and a ramp-up and drain of the GPU per layer. Where tm_moe_gate_up's grouped GEMMs take both
 * (several tokens), CUDA makes the two calls instead: reading each row once per 4 tokens saves more.
 * w_gate_sh, w_up_sh [ffn_sh, hidden], act_sh [T, ffn_sh]; the routed arguments as tm_moe_gate_up's; both weight
 * sets of qtype. */
TM_API int tm_experts_gate_up(tm_device device, int qtype, const void* w_gate_sh, const void* w_up_sh, float* act_sh,
                              int64_t ffn_sh, const void* w_gate, const void* w_up, const float* h,
                              const int32_t* ids, float* act, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                              int64_t ffn, int64_t hidden, void* stream);

/* Blocks of the persistent launch tm_router_experts_ffn may use at most (its scratch holds two words a block). */
#define TM_FFN_MAX_BLOCKS 1024

/* The int32 word where tm_router_experts_gate_up's scratch holds h's int8 activation groups (what its routed
 * blocks of Q8_0 rows multiply, csrc/common/act_quant.h): past its synchronisation words and logits, and past the
 * words tm_router_experts_ffn keeps in a scratch they share (its flags carry epochs: no group may pass for one),
 * on a 16-byte boundary. */
static inline int64_t tm_router_gate_up_groups_word(int64_t n_tokens, int64_t n_experts) {
  const int64_t gate_up = 64 + 4 * ((n_tokens + 31) / 32 * 32) + 2 * n_tokens * n_experts;
  const int64_t ffn = 2 * (128 + 4 * (int64_t)TM_FFN_MAX_BLOCKS);
  return ((gate_up > ffn ? gate_up : ffn) + 3) / 4 * 4;
}

/* int32 words of the scratch tm_router_experts_gate_up needs: 64 + 4 * (n_tokens rounded up to 32)
 * synchronisation words (a ticket word, then two groups of 64-bit flags, each on 128-byte lines of its own),
 * then n_tokens * n_experts router logits of 64 bits (each tagged with the call), then from
 * tm_router_gate_up_groups_word per token h's int8 groups (256 words per 512 values of hidden), then n_tokens
 * floats (the deferred norm's inv where the separate launches need it). */
static inline int64_t tm_router_gate_up_scratch_words(int64_t n_tokens, int64_t n_experts, int64_t hidden) {
  return tm_router_gate_up_groups_word(n_tokens, n_experts) + n_tokens * (tm_act_groups_bytes(hidden) / 4) +
         n_tokens;
}

/* The fused router and every expert's gate-up, in one launch: bitwise
 *   tm_rmsnorm_router_topk(x, norm_w, eps, h, w_router, ids, weights, n_tokens, n_experts, hidden, top_k, normalize)
 * followed by
 *   tm_experts_gate_up(qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh, w_gate, w_up, h, ids, act, n_tokens, top_k,
 *                      n_experts, ffn, hidden).
 * On CUDA the shared expert's rows stream while the router runs (blocks of one grid wait on integer flags, not on
 * the end of a launch). scratch: int32 [tm_router_gate_up_scratch_words(n_tokens, n_experts, hidden)], 16-byte
 * aligned, all zero before the first call; each call leaves the synchronisation words as the next one continues
 * from them (an epoch; the logits and h's groups are work space), whatever n_tokens it has. Calls sharing a
 * scratch must not run at the same time (one stream does that), and nothing else may write it between them. With
 * more than 64 experts, where the grid would exceed the device's limits, or for a step of several tokens that
 * tm_experts_gate_up runs as grouped GEMMs, CUDA makes the two calls above instead (the same bits; of the scratch
 * only h's groups are written, which the grouped GEMMs of tiled rows read). The CPU always does.
 * gate_inp_sh (nullable, float32 [hidden]): the shared expert's gate row; then gate_sh (float32 [n_tokens]) gets
 * gate_sh[t] = sigmoid(dot(gate_inp_sh, h[t, :])), the factor tm_moe_down_accumulate would compute from
 * gate_inp_sh and h (the same bits), for tm_experts_down_accumulate to read instead of computing it in every
 * block. gate_sh must be given exactly when gate_inp_sh is. act_groups_sh and act_groups (both or neither;
 * [T, tm_act_groups_bytes(ffn_sh)] and [T, top_k, tm_act_groups_bytes(ffn)] bytes, ffn_sh and ffn multiples of 4):
 * act_sh's and act's int8 groups instead of the floats, for tm_experts_down_accumulate, which then reads only the
 * groups: act_sh and act become work space that the one-launch path does not write (its blocks' float stores
 * cost the decode step ~0.5%).
 * xw and xss (both or neither; float32 [T, hidden] and [T, tm_norm_groups(hidden)]): the FFN norm deferred for the
 * shared expert: x * norm_w and x's grouped sums of squares as tm_rmsnorm_factors writes them (tm_matmul's y_w and
 * y_ss: attn_output writes them). The shared expert's gate-up is then
 *   tm_moe_gate_up(w_gate_sh, w_up_sh, xw, NULL, act_sh, n_tokens, 1, 0, 1, 1, ffn_sh, hidden, inv)
 * (inv: tm_rmsnorm_factors' from the same x, which it computes from xss with eps) instead of the product with h,
 * so that its blocks stream their rows at once instead of normalising x first (results/NOTES.md lesson 186); the
 * router's logits, gate_sh and the routed slots still take h. xw_groups (nullable, only with xw;
 * [T, tm_act_groups_bytes(hidden)] bytes): xw's int8 groups, which the one launch's shared blocks of TM_Q8_0_TILED
 * rows multiply (without them CUDA makes the separate calls). */
TM_API int tm_router_experts_gate_up(tm_device device, const float* x, const float* norm_w, float eps, float* h,
                                     const float* w_router, int32_t* ids, float* weights, int qtype,
                                     const void* w_gate_sh, const void* w_up_sh, float* act_sh, int64_t ffn_sh,
                                     const float* gate_inp_sh, float* gate_sh,
                                     const void* w_gate, const void* w_up, float* act, int64_t n_tokens,
                                     int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, int64_t ffn,
                                     int32_t* scratch, uint8_t* act_groups_sh, uint8_t* act_groups, const float* xw,
                                     const float* xss, const uint8_t* xw_groups, void* stream);

/* Routed experts, down projection + accumulate, slots [slot_begin, slot_begin + slot_count) in increasing
 * order, one running float32 accumulator per output row seeded from x and written once:
 *   acc = x[t, r]; for s: acc = acc + weights[t, s] * dot(W_down[ids[t, s]][r, :], act[t, s, :]); x[t, r] = acc
 * w_down [n_experts, hidden, ffn] of qtype. Calling it once with (0, top_k) or top_k times with (s, 1) gives
 * bitwise identical x. weights == NULL means weight 1. gate_inp (nullable, float32 [hidden]) scales every slot's
 * product by sigmoid(dot(gate_inp, h[t, :])) before the add (the qwen2moe shared-expert gate); h is read only
 * then (nullable otherwise). */
TM_API int tm_moe_down_accumulate(tm_device device, int qtype, const void* w_down, const float* act,
                                  const int32_t* ids, const float* weights, const float* gate_inp, const float* h,
                                  float* x, int64_t n_tokens, int64_t top_k, int64_t slot_begin, int64_t slot_count,
                                  int64_t n_experts, int64_t hidden, int64_t ffn, void* stream);

/* The shared expert's down projection and every routed slot's, in one launch: bitwise
 *   tm_moe_down_accumulate(w_down_sh, act_sh, NULL, NULL, gate_inp_sh, h, x, n_tokens, 1, 0, 1, 1, hidden, ffn_sh)
 * followed by
 *   tm_moe_down_accumulate(w_down, act, ids, weights, NULL, NULL, x, n_tokens, top_k, 0, top_k, n_experts, hidden,
 *                          ffn)
 * (x = ((x + shared) + w_0 y_0) + ..., the order of the two calls). w_down_sh [hidden, ffn_sh], act_sh
 * [T, ffn_sh]; the routed arguments as tm_moe_down_accumulate's. The shared term's gate, at most one of:
 * gate_inp_sh (float32 [hidden]: sigmoid(dot(gate_inp_sh, h[t, :])) computed here, h then required), or gate_sh
 * (float32 [n_tokens]: those factors as tm_router_experts_gate_up wrote them; h may then be NULL); neither: no
 * gate. next_norm_w, xw and xss (all or none; float32 [hidden], [T, hidden] and [T, tm_norm_groups(hidden)]): also
 * xw[t, r] = x[t, r] * next_norm_w[r], the first factor of the next normalisation, and xss, the partial sums of
 * squares of the x written here (both as tm_rmsnorm_factors writes them), so that the next layer's tm_qkv_rope need
 * not compute them. act_groups_sh and act_groups (both or neither; qtype TM_Q8_0_TILED): act_sh's and act's int8
 * groups as tm_router_experts_gate_up wrote them, read instead of the floats (act_sh and act are then not read;
 * the groups' values are what Q8_0 rows multiply anyway, so x has the bits of the call given the floats).
 * xw_groups (nullable, only with xw, hidden a multiple of 4; [T, tm_act_groups_bytes(hidden)] bytes): also xw's
 * int8 groups, for tm_qkv_rope. */
TM_API int tm_experts_down_accumulate(tm_device device, int qtype, const void* w_down_sh, const float* act_sh,
                                      const float* gate_inp_sh, const float* gate_sh, int64_t ffn_sh,
                                      const void* w_down,
                                      const float* act, const int32_t* ids, const float* weights, const float* h,
                                      float* x, const float* next_norm_w, float* xw, float* xss, int64_t n_tokens,
                                      int64_t top_k, int64_t n_experts, int64_t hidden, int64_t ffn,
                                      const uint8_t* act_groups_sh, const uint8_t* act_groups, uint8_t* xw_groups,
                                      void* stream);


/* int32 words of the scratch tm_router_experts_ffn needs (it may also serve tm_router_experts_gate_up: they share
 * its epoch word). */
static inline int64_t tm_router_experts_ffn_scratch_words(int64_t n_tokens, int64_t n_experts, int64_t hidden) {
  const int64_t own = 2 * (128 + 4 * (int64_t)TM_FFN_MAX_BLOCKS);
  const int64_t gate_up = tm_router_gate_up_scratch_words(n_tokens, n_experts, hidden);
  return own > gate_up ? own : gate_up;
}

/* The whole MoE FFN half of a layer: bitwise
 *   tm_router_experts_gate_up(x, norm_w, eps, h, w_router, ids, weights, qtype, w_gate_sh, w_up_sh, act_sh, ffn_sh,
 *                             gate_inp_sh, gate_sh, w_gate, w_up, act, n_tokens, n_experts, hidden, top_k,
 *                             normalize, ffn, scratch)
 * followed by
 *   tm_experts_down_accumulate(qtype, w_down_sh, act_sh, NULL, gate_sh, ffn_sh, w_down, act, ids, weights, h, x,
 *                              n_tokens, top_k, n_experts, hidden, ffn)
 * (every output of both: h, ids, weights, act_sh, gate_sh, act and x). w_down_sh [hidden, ffn_sh] and w_down
 * [n_experts, hidden, ffn] of qtype. scratch: int32 [tm_router_experts_ffn_scratch_words(n_tokens, n_experts,
 * hidden)], as tm_router_experts_gate_up's. When chosen (tm_set_ffn_one_launch or TORNADO_MOE_FFN_ONE_LAUNCH=1;
 * off by default, as it measured slower on the H200), CUDA runs a decode step (n_tokens = 1) of TM_Q8_0_TILED
 * weights with hidden and ffn_sh multiples of 256, ffn a multiple of 128, top_k <= 4 and n_experts <= 64 as ONE
 * persistent launch on a device with the copy engine's bulk copies (compute capability 9; one block per
 * multiprocessor, whose blocks wait for each other: the device must not be shared with other work that holds
 * multiprocessors, as under MPS limits) without xw; otherwise the two launches above. tm_router_experts_ffn_launches
 * says which. xw, xss and xw_groups: tm_router_experts_gate_up's (the shared expert's deferred norm). */
TM_API int tm_router_experts_ffn(tm_device device, float* x, const float* norm_w, float eps, float* h,
                                 const float* w_router, int32_t* ids, float* weights, int qtype,
                                 const void* w_gate_sh, const void* w_up_sh, const void* w_down_sh, float* act_sh,
                                 int64_t ffn_sh, const float* gate_inp_sh, float* gate_sh, const void* w_gate,
                                 const void* w_up, const void* w_down, float* act, int64_t n_tokens,
                                 int64_t n_experts, int64_t hidden, int64_t top_k, int normalize, int64_t ffn,
                                 int32_t* scratch, const float* xw, const float* xss, const uint8_t* xw_groups,
                                 void* stream);

/* Kernel launches tm_router_experts_ffn makes for these arguments on the current device of `device` (1: the
 * persistent launch; 2: the two launches), its buffers being 16-byte aligned as torch and the tiled upload make
 * them; deferred_norm: whether xw is given. The CPU's one call counts 1. Negative: an error (tm_last_error). */
TM_API int tm_router_experts_ffn_launches(tm_device device, int qtype, int64_t n_tokens, int64_t n_experts,
                                          int64_t top_k, int64_t hidden, int64_t ffn_sh, int64_t ffn,
                                          int deferred_norm);

/* Greedy: out[t] = argmax_v logits[t, v], ties to the lowest id; NaN never wins. */
TM_API int tm_argmax(tm_device device, const float* logits, int32_t* out, int64_t n_tokens, int64_t vocab,
                     void* stream);

/* Sampling for one row of logits [vocab]: p = softmax(logits / temperature); keep the top_k most probable
 * (top_k <= 0: all; ties to the lower id), then the smallest prefix of those, in descending p (ties: lower id
 * first), whose mass reaches top_p times the mass of the top-k survivors (top_p >= 1: all); draw u in [0, 1) from a counter-based generator of
 * (seed, step[0]) and return the first kept token, in that order, at which the cumulative kept mass exceeds
 * u * kept mass. Deterministic for a given (logits, seed, step). out[0] = token id. step is read from memory
 * (device memory for CUDA) so a captured graph samples anew every replay. */
TM_API int tm_sample(tm_device device, const float* logits, int32_t* out, int64_t vocab, float temperature,
                     float top_p, int64_t top_k, uint64_t seed, const int32_t* step, void* stream);

/* Device-side step update for captured graphs: pos[0] += delta; then, when log is not NULL and the new position
 * p is in [0, log_len), log[p] = token[0] (the token chosen for position p: a graph that holds several decode
 * steps leaves every step's token there, where the host reads them back once per replay). token may be NULL only
 * when log is. */
TM_API int tm_advance_position(tm_device device, int32_t* pos, int32_t delta, const int32_t* token, int32_t* log,
                               int64_t log_len, void* stream);

/* A greedy decode step's last two tasks in one launch: tm_argmax of the one row logits[vocab] into out[0], then
 * tm_advance_position(pos, delta, out, log, log_len). out, pos and log end as the two calls leave them. */
TM_API int tm_argmax_advance(tm_device device, const float* logits, int32_t* out, int64_t vocab, int32_t* pos,
                             int32_t delta, int32_t* log, int64_t log_len, void* stream);

/* ---- generic invocation (the Java route) ------------------------------------------------------------- */
/* Every kernel above is also reachable by index with its arguments packed as 64-bit words (pointers as
 * addresses, integers sign-extended, floats as the bits of a float32 in the low word). The signature string
 * has one letter per argument after `device` and before `stream`:
 *   'q' qtype (int), 'p' pointer (non-null), 'n' nullable pointer, 'i' int64, 'b' int flag, 'f' float32,
 *   'u' uint64. */
TM_API int tm_kernel_count(void);
TM_API const char* tm_kernel_name(int index);
TM_API const char* tm_kernel_signature(int index);
TM_API int tm_kernel_index(const char* name); /* -1 if unknown */
TM_API int tm_invoke(int index, tm_device device, const uint64_t* args, int n_args, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* TORNADO_MOE_H */
