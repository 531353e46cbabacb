// CUDA kernels of the model with a plain C++ interface (raw pointers, a cudaStream_t passed as
// void*), so that no CUDA header reaches the C++ side. Built only in the GPU build
// (TILLER_HAVE_CUDA_KERNELS); callers fall back to ATen ops elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiller::model::cuda {

enum class DType { kBFloat16, kHalf, kFloat };

// Rotary embedding of x [tokens, heads, dim] (inner dim contiguous; token and head strides
// given) with HF tables cos, sin [tokens, dim] (contiguous), into out [tokens, heads, dim]
// (contiguous). Forward: out = x * cos + rotate_half(x) * sin. With `backward`, x is the output
// gradient and out receives the input gradient, the transpose: g * cos + rotate_half^T(g * sin).
// Math in fp32. All pointers of `dtype`.
void rope(DType dtype, const void* x, const void* cos, const void* sin, void* out, int64_t tokens, int64_t heads,
          int64_t dim, int64_t x_token_stride, int64_t x_head_stride, bool backward, void* stream);

// silu(gate) * up for the fused gate/up projection's output x [tokens, 2 * width] (gate then up
// in each row, row stride given in elements) into out [tokens, width] (contiguous). Math in fp32.
void swiglu_packed(DType dtype, const void* x, void* out, int64_t tokens, int64_t width, int64_t x_row_stride,
                   void* stream);
// The same for separate gate and up [tokens, width] (inner dim contiguous, row strides given) into
// out [tokens, width] (contiguous); and its backward for contiguous gate, up and output gradient
// grad: grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate) (contiguous). Math in fp32.
// With `partial` (kFp8TensorParts floats; twice that for the backward) the kernel also finds the
// tensor scale of what it writes (into `scale`, out's; `scale` grad_gate's and `scale_up`
// grad_up's), the one tensor_scale_fp8 finds (FP8 tensor-scaled training's scales without a pass
// of their own). Each scale a float of its own: cuBLASLt takes no scale at an offset of 4 bytes.
void swiglu(DType dtype, const void* gate, int64_t gate_stride, const void* up, int64_t up_stride, void* out,
            int64_t tokens, int64_t width, void* stream, float* partial = nullptr, float* scale = nullptr);
void swiglu_backward(DType dtype, const void* gate, const void* up, const void* grad, void* grad_gate, void* grad_up,
                     int64_t tokens, int64_t width, void* stream, float* partial = nullptr, float* scale = nullptr,
                     float* scale_up = nullptr);

// The residual add and the RMSNorm after it, for rows of width `width` (strides in elements):
// x = T(x + add) in place, then out = T(x * rsqrt(mean(x^2) + eps) * weight), math in fp32 (what
// `x + add` then ATen's rms_norm compute). Inference only.
void add_rms_norm(DType dtype, void* x, const void* add, const void* weight, void* out, int64_t tokens, int64_t width,
                  int64_t x_stride, int64_t add_stride, int64_t out_stride, float eps, void* stream);

// add_rms_norm for a tensor-scaled FP8 engine (engines.fp8_scaling: tensor): x = T(x + a) in place
// with a = T(add * add_scale[r]) (add_scale: the rows' scales of a tensor-scaled product, as
// scale_rows applies them; null: a = add), the normed row T(x * rstd * weight) as add_rms_norm
// computes it, then quantized as quantize_rows_fp8 quantizes it: codes into q [padded_rows,
// q_stride] (zeros past width and in the rows [rows, padded_rows), scale 1 there), scale[r].
void add_rms_norm_fp8(DType dtype, void* x, const void* add, const float* add_scale, const void* weight, int64_t rows,
                      int64_t padded_rows, int64_t width, int64_t x_stride, int64_t add_stride, void* q,
                      int64_t q_stride, float* scale, float eps, void* stream);
// silu(g) * u of a tensor-scaled fused gate/up product x [rows, 2 * width] (row stride x_stride)
// whose rows' scales x_scale[r] are still to apply: g = T(x_g * s), u = T(x_u * s) (scale_rows'
// rounding), a = T(silu(g) * u) (swiglu_packed's), each row of a quantized as quantize_rows_fp8
// quantizes it: codes into q [padded_rows, q_stride], scale[r] (1 for the padding rows).
// A row of a waits in shared memory: width * the element's bytes at most kSwigluFp8MaxBytes.
constexpr int64_t kSwigluFp8MaxBytes = 200 * 1024;
void swiglu_fp8(DType dtype, const void* x, int64_t x_stride, const float* x_scale, int64_t rows, int64_t padded_rows,
                int64_t width, void* q, int64_t q_stride, float* scale, void* stream);
// The rows' scales of a tensor-scaled FP8 product applied in place: y[r, j] = T(y[r, j] * scale[r]
// + bias[j]) (bias null: no sum; of `dtype`), the product and the sum rounded to fp32 each (no
// fused multiply-add), rows of stride y_stride.
void scale_rows(DType dtype, void* y, int64_t rows, int64_t n, int64_t y_stride, const float* scale, const void* bias,
                void* stream);

// FP8 (e4m3) quantization of activations x [rows, k] (row stride in elements of `dtype`) in
// `groups` groups of 128 features (groups * 128 >= k): for row r and group g, s = amax / 448 (1
// for a group of zeros), q[r * q_stride + j] = e4m3(x / s) as torch's float8_e4m3fn cast rounds it
// (nearest even, saturating at 448), zeros for the padding columns [k, groups * 128) and padding
// rows [rows, padded_rows) (scale 1), and scale[g * scale_stride + r] = s (group-major: the layout
// of cuBLASLt's 1x128 scales). q is byte storage. Math in fp32. At most 65,535 groups (8.4M
// features) a row.
void quantize_groups_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, int64_t groups, float* scale, int64_t scale_stride, void* stream);

// The same with one scale per row (the row-scaled FP8 GEMM): s = amax of row r over its k
// values / 448 (1 for zeros), q[r * q_stride + j] = e4m3(x / s), zeros for the columns [k,
// q_stride) and the rows [rows, padded_rows) (scale 1), scale[r] = s. q_stride a multiple of 4.
void quantize_rows_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                       void* q, int64_t q_stride, float* scale, void* stream);

// The same with one scale for the whole of x (per-tensor scaling: engines.fp8_scaling and
// roles.<r>.fp8_scaling tensor): s = amax of x's rows x k values / 448 (1 for zeros), codes as
// above (zeros past k and past rows), and *scale = s (device memory). `partial` holds
// kFp8TensorParts floats of scratch. In two steps, each on its own:
//   tensor_scale_fp8     s alone (the blocks' maxima into `partial`, then one block reduces them);
//   quantize_scaled_fp8  the codes with a given s (*scale, device memory; read, not written).
constexpr int64_t kFp8TensorParts = 1056;
void quantize_tensor_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, float* partial, float* scale, void* stream);
void tensor_scale_fp8(DType dtype, const void* x, int64_t rows, int64_t k, int64_t x_stride, float* partial,
                      float* scale, void* stream);
void quantize_scaled_fp8(DType dtype, const void* x, int64_t rows, int64_t padded_rows, int64_t k, int64_t x_stride,
                         void* q, int64_t q_stride, const float* scale, void* stream);
// *scale = the scale of the largest of partial[0 .. parts) (none: 1): tensor_scale_fp8's second
// pass, for kernels that find their outputs' maxima.
void fp8_scale_of_partials(const float* partial, int parts, float* scale, void* stream);

// FP8 quantization of x [rows, cols] by 128x128 tiles over the padded extents [padded_rows,
// padded_cols] (multiples of 128; values past rows or cols are zeros), for the FP8 training's
// GEMM operands (model/fp8.h):
//   kTile               one scale per tile: q [padded_rows, padded_cols] (x's layout),
//                       scale[tile_row * scale_stride + tile_col];
//   kTileTransposed     the same of x^T: q [padded_cols, padded_rows], scale[tile_col * scale_stride + tile_row]
//                       (what quantizing x^T by tiles gives: a tile's largest magnitude is its transpose's);
//   kColumnsTransposed  x^T in groups of 128 along x's rows (one scale per column of x and tile row):
//                       q [padded_cols, padded_rows], scale[tile_row * scale_stride + col] (the 1x128
//                       layout of quantize_groups_fp8 for x^T).
// Scales s = amax / 448 (1 for zeros), codes e4m3(x / s) as torch's cast rounds them. q's rows
// 8-byte aligned (q and q_stride); std::invalid_argument otherwise.
enum class Fp8Tiles { kTile = 0, kTileTransposed = 1, kColumnsTransposed = 2 };
void quantize_tiles_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                        int64_t padded_rows, int64_t padded_cols, Fp8Tiles mode, void* q, int64_t q_stride,
                        float* scale, int64_t scale_stride, void* stream);

// x^T's codes with a given scale for the whole of x (FP8 training's tensor scaling, the backward's
// transposed operands): q [padded_cols, padded_rows] = e4m3(x^T / *scale) (zeros past cols and
// rows), x [rows, cols] row-major: what quantize_scaled_fp8 gives x^T's contiguous copy, by the
// tile kernel. Padded extents whole tiles of 128, q's rows 8-byte aligned.
void quantize_scaled_transposed_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                                    int64_t padded_rows, int64_t padded_cols, void* q, int64_t q_stride,
                                    const float* scale, void* stream);
// Both layouts' codes with the given scale from one read of x: x^T's as
// quantize_scaled_transposed_fp8 writes them (q_t [padded_cols, padded_rows]) and x's as
// quantize_scaled_fp8 writes them (q [q_rows, q_cols], zeros past rows and cols; rows <= q_rows <=
// padded_rows, cols <= q_cols <= padded_cols, q_cols and q's row stride multiples of 8 bytes, 4
// for fp32, q aligned to them): the training's gy (dgrad and wgrad) and x (forward and wgrad).
void quantize_scaled_both_fp8(DType dtype, const void* x, int64_t rows, int64_t cols, int64_t x_stride,
                              int64_t padded_rows, int64_t padded_cols, void* q_t, int64_t q_t_stride, void* q,
                              int64_t q_rows, int64_t q_cols, int64_t q_stride, const float* scale, void* stream);

// One token per row of logits [rows, vocab] (row stride given, in elements of `dtype`) for the
// rows' parameters params [rows][3] (temperature, min_p, u): a temperature of 0 takes the first
// maximum; otherwise the first token whose cumulative mass passes u times the total, over
// softmax(logits / temperature) restricted to p >= min_p * p_max (min_p 0: every token) — the
// ATen sampler's inverse-CDF draw without top-k and top-p. Writes tokens [rows] (int64) and their
// log-probs under the whole softmax(logits / temperature) [rows] (fp32); math in fp32.
void sample_rows(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                 const float* params, int64_t* tokens, float* logprobs, void* stream);

// The LM head's per-row statistics of logits z [rows, vocab] (row stride in elements of
// `dtype`) under y = z * inv_temperature: logprobs[r] = y[targets[r]] - logsumexp(y) (NaN for a
// target outside [0, vocab)), and when `entropy` is given, entropy[r] = -sum softmax(y) log
// softmax(y). Outputs fp32 [rows]; math in fp32, no copy of the logits.
void logprob_rows(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                  const int64_t* targets, float inv_temperature, float* logprobs, float* entropy, void* stream);
// Their backward, in place: each row of z becomes d loss / d z = inv_temperature * (g (onehot(target)
// - p) - g_H p (log p + H)), with p = softmax(y), H its entropy, g = grad[r] and g_H =
// grad_entropy[r] (either may be null: zero), rounded to `dtype`.
void logprob_rows_backward(DType dtype, void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                           const int64_t* targets, float inv_temperature, const float* grad, const float* grad_entropy,
                           void* stream);

// algo.logprob_match = bitwise (model/batch_invariant.h): kernels whose result for a row depends
// on that row alone, in one fixed reduction order.
// RMSNorm of contiguous rows [rows, width] into out (contiguous): T(x * rsqrt(mean(x^2) + eps) *
// weight), the statistics in fp32 (invariant.cu).
void invariant_rms_norm(DType dtype, const void* x, const void* weight, void* out, int64_t rows, int64_t width,
                        float eps, void* stream);
// x = T(x + add) in place, then the RMSNorm above of the rounded x into out (contiguous): the
// same bits as the two steps apart (x rows and add rows at their strides, in elements).
void invariant_add_rms_norm(DType dtype, void* x, const void* add, const void* weight, void* out, int64_t rows,
                            int64_t width, int64_t x_stride, int64_t add_stride, float eps, void* stream);
// cos and sin of n fp32 values (contiguous), each times `scaling` when `scaled`, element by
// element (invariant.cu): the RoPE tables of the bitwise mode, computed where they are used.
void invariant_rope_tables(const float* freqs, float* cos_out, float* sin_out, int64_t n, float scaling, bool scaled,
                           void* stream);
// out[r] = T(x[r] . w + bias) for rows [rows, width] at row stride x_stride (elements), w [width]
// and bias (one element, or null) contiguous, out [rows]: the sum in fp32 in one order per row
// (invariant.cu). A value head's one-column product, which a GEMM would sum as the batch decides.
void invariant_row_dot(DType dtype, const void* x, int64_t x_stride, const void* w, const void* bias, void* out,
                       int64_t rows, int64_t width, void* stream);
// softmax of contiguous fp32 rows [rows, width] into out (contiguous, fp32) (invariant.cu).
void invariant_softmax(const float* x, float* out, int64_t rows, int64_t width, void* stream);
// log softmax(z / t)[target] per row of logits [rows, vocab] (row stride in elements), fp32
// [rows], t = temperatures[r] (per_row) or temperatures[0]; both device arrays. NaN for a target
// outside [0, vocab). With `entropy`, also each row's entropy of softmax(z / t) (not part of the
// invariance promise, but computed in the same pass). The row's log-sum-exp is sample_rows' own
// pass 1 (sampler.cu), so sample_rows reports the same bits for the token it draws at t (a
// temperature of 0 there counts as 1 here).
void invariant_logprobs(DType dtype, const void* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                        const int64_t* targets, const float* temperatures, bool per_row, float* logprobs,
                        float* entropy, void* stream);
// y [m, n] (contiguous) = x [m, k] (row stride x_stride elements) @ w [n, k]^T (contiguous), each
// output element the same K-ordered sum whatever m and n are: per (device, dtype, k) a reference
// cuBLASLt algorithm (split-K excluded, kept only if a probe finds its rows independent of m and
// its columns of n), and for each shape the heuristic's fastest algorithm that gives the
// reference's bits on the probe (invariant_gemm.cpp). Pointers and x_stride * the element size
// 16-byte aligned. `workspace`: invariant_gemm_workspace(...) bytes for the same shape, which
// also makes the choices on first use (a new K must not come first inside a CUDA graph capture).
// Throws std::runtime_error naming the cuBLAS status.
size_t invariant_gemm_workspace(DType dtype, int64_t m, int64_t n, int64_t k, int64_t x_stride, int device,
                                void* stream);
void invariant_gemm(DType dtype, const void* x, int64_t x_stride, const void* w, void* y, int64_t m, int64_t n,
                    int64_t k, void* workspace, size_t workspace_bytes, int device, void* stream);

}  // namespace tiller::model::cuda
