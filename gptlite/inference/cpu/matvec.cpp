// gptlite's CPU decode kernels: a linear layer's product for a few rows of float32 activations, on a float32 or an
// int8 weight, streaming each weight from memory once. Built by gptlite/inference/cpu/native.py for the CPU at hand
// (-march=native) and registered as torch operators:
//
//   torch.ops.gptlite.float_linear(x, weight, bias)        x (..., K) float32, weight (N, K) float32 -> (..., N)
//   torch.ops.gptlite.int8_linear(x, weight, scale, bias)  weight (N, K) int8, scale (N,) float32     -> (..., N)
//
//   y[m, n] = scale[n] * sum_k x[m, k] * weight[n, k] + bias[n]    (scale 1 for float32 weights)
//
//   int8_linear also takes a scale (N, G): each row's K inputs in G groups of K / G, each with its scale,
//   y[m, n] = sum_k x[m, k] * weight[n, k] * scale[n, k / (K / G)] + bias[n]    (q8_0's blocks, for G = K / 32)
//
//   torch.ops.gptlite.int8_dot_linear(x, weight, scale, bias)  weight (N, K) int8, scale (N,) or (N, G)  -> (..., N)
//   torch.ops.gptlite.int4_dot_linear(x, weight, scale, bias)  weight (N, K / 2) uint8, scale (N, G)    -> (..., N)
//
//   The same products with x first quantized to int8 per block of kBlock = 32 numbers (q8_0's rule), each block's
//   products with the weight's int8 codes, or int4 codes packed two a byte (a code q standing for q - 8), summed
//   exactly in int32 and then scaled (see "int8 x int8" below). K a multiple of kBlock, G's groups whole blocks.
//
//   torch.ops.gptlite.cached_attention(qkv, k_cache, v_cache, slot, span, visible, scale, n_head, cos, sin,
//                                      q_norm, k_norm, head_eps, window, slots)
//       qkv (B, 1, (H + 2 KV) D) float32, k_cache and v_cache (B, KV, L, D) -> (B, 1, H D)
//
//   A decode step's attention through a KV cache, in one call: the token's keys and values (qkv's last 2 KV D
//   numbers of each row) written into slot `slot` of the caches, then each of its H query heads attends over the
//   cache's slots [0, span) that visible (B, >= span) shows (all, where it is None), each key/value head serving
//   H / KV query heads: out = softmax(scale q . k) v. Before that, where they are given, each head's q and k are
//   normalized (RMSNorm over the head's D numbers times q_norm or k_norm (D), epsilon head_eps: Qwen3's; or over all
//   of a row's q and all of its k, the weights (H D) and (KV D): OLMo 2's) and then rotated (RoPE: the head's leading
//   R coordinates, R = cos's width, pairs (i, i + R/2) rotated by their angle, q' = q cos + rotate_half(q) sin, cos
//   and sin (B or 1, R) the row's position's, as the model's own RotaryPositions computes them). A window > 0 (Gemma
//   3's local layers) attends over the slots [slot - window + 1, slot] only. Where `slots` (B) int64 is given, rows
//   stand at lengths of their own (the server's rows, each a request of its own): row b's token goes to slot slots[b]
//   instead of `slot`, and it attends over slots [0, slots[b]] (its window's of them; span must exceed every one).
//
//   torch.ops.gptlite.block_step(x, norms, weights, scales, biases, k_cache, v_cache, slot, span, visible, scale,
//                                n_head, norm, eps, activation, residual_scale, cos, sin, q_norm, k_norm, head_eps,
//                                position, window, slots, input_bits)
//       x (B, 1, C) float32 -> (B, 1, C)
//
//   A block's decode step, in one call: x + s attn(norm(x)), then x + s ffn(norm(x)) (position "pre"; "post" puts
//   each norm on its branch's output, "both" one before and one after), the attention as cached_attention's, the
//   norms LayerNorm, RMSNorm or RMSNorm times 1 + weight (Gemma's), the feed-forward's activation GELU (tanh), squared
//   ReLU, SwiGLU or GeGLU, the matrices float32 or int8 with a scale per row, multiplied by float32 inputs, or int8
//   (a scale per row) or int4 (a scale per group) multiplied by inputs quantized to int8 where input_bits says 8 (see
//   block_step below).
//
//   torch.ops.gptlite.argmax(logits)     logits (B, V) float32 -> (B,) int64, each row's first largest (greedy's pick)
//
//   torch.ops.gptlite.constants()        -> {"multiple": kMultiple, "tile": kTile, "block": kBlock}: the input
//                                           widths (a multiple of) and row counts (a pass over a weight) this build
//                                           takes, and the integer kernels' activation blocks
//
// Why: decoding one token multiplies one row by every weight of the model, so it is bound by reading the weights
// from memory. PyTorch's int8 kernel (_weight_int8pack_mm) is compute-bound at one row; its float32 kernels read
// a layer's weight as several interleaved streams. Here each thread reads its contiguous share of the weight's rows
// once; at one activation row it cuts that share into kStreams parts and walks them side by side, so that a core
// has several sequential streams on their way from memory at once (a core's bandwidth is bound by how many lines
// it has in flight, not by the memory's). It asks for the bytes a page ahead of the ones it multiplies (a software
// prefetch: the hardware prefetchers stop at page boundaries), converts int8 to float32 in registers and multiplies
// in float32 (no rounding of activations to bfloat16). A decode step's attention is little arithmetic on a few
// hundred KB of cache; through PyTorch it took a dozen operator calls a layer (split, views, the cache writes, SDPA,
// the heads merged), about 80 us on the Intel Xeon, as long as the layer's 7 MB of qkv weights took to stream. A
// whole block's step in one call spares the module and operator calls between its matrices (the norms, the
// attention's call, the activation, the residual additions), each of which starts with the caches full of the last
// matrix's weights.
// The vectors are GCC's vector extensions: -march=native lowers them to AVX-512, AVX2 or NEON, whatever the CPU
// has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gptlite {
namespace {

// Floats in one vector: one register of the widest kind the CPU has (a wider vector than its registers would be
// split and passed through memory). K must be a multiple of 16, which each width divides.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;  // SSE, NEON
#endif
constexpr int kMultiple = 16;
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int8_t Bytes __attribute__((vector_size(kLanes)));

constexpr int64_t kLine = 64;     // bytes in a cache line
constexpr int64_t kAhead = 4096;  // how far ahead of the weight being multiplied its bytes are prefetched
constexpr int kTile = 8;          // activation rows multiplied by one pass over a weight row
constexpr int kStreams = 4;       // weight rows one activation row is multiplied into at once, each from its own part
constexpr int64_t kGrain = 16;    // weight rows a thread takes at least

inline Floats load(const float* p) {
    Floats v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// kLanes int8 weights as floats. GCC's own vector conversion (__builtin_convertvector) converts byte by byte here,
// so x86 gets the instructions that sign-extend and convert a whole register.
#if defined(__AVX512F__)
inline Floats load(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<Floats>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
}
#elif defined(__AVX2__)
inline Floats load(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<Floats>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
}
#else
inline Floats load(const int8_t* p) {
    Bytes b;
    std::memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, Floats);
}
#endif

// The sum of a vector's lanes, added pairwise (halves, then quarters, ...): log2(kLanes) additions deep, not
// kLanes - 1, which counts where the dot products are short (an attention head's 64 numbers).
inline float total(Floats v) {
    float lanes[kLanes];
    std::memcpy(lanes, &v, sizeof v);
    for (int width = kLanes / 2; width > 0; width /= 2) {
        for (int i = 0; i < width; i++) {
            lanes[i] += lanes[i + width];
        }
    }
    return lanes[0];
}

// Prefetches the lines of weight bytes [p, p + bytes) kAhead bytes ahead, into the second-level cache (locality 2:
// prefetcht1 on x86), not the first: a prefetch into the first level holds one of its few line-fill buffers until
// the line arrives, which on the Intel Xeon limited how many lines were on their way at once.
inline void prefetch_ahead(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t i = 0; i < bytes; i += kLine) {
        __builtin_prefetch(c + i + kAhead, 0, 2);
    }
}

// One activation row times one weight row: four accumulators, so that four multiply-adds are in flight.
template <typename W>
float dot(const float* x, const W* w, int64_t K) {
    Floats a0 = {};
    Floats a1 = {};
    Floats a2 = {};
    Floats a3 = {};
    int64_t k = 0;
    for (; k + 4 * kLanes <= K; k += 4 * kLanes) {
        prefetch_ahead(w + k, 4 * kLanes * sizeof(W));
        a0 += load(x + k) * load(w + k);
        a1 += load(x + k + kLanes) * load(w + k + kLanes);
        a2 += load(x + k + 2 * kLanes) * load(w + k + 2 * kLanes);
        a3 += load(x + k + 3 * kLanes) * load(w + k + 3 * kLanes);
    }
    for (; k < K; k += kLanes) {  // K is a multiple of kLanes (of kMultiple, checked)
        a0 += load(x + k) * load(w + k);
    }
    return total((a0 + a1) + (a2 + a3));
}

// One activation row times kStreams weight rows w[0..kStreams), each row a stream of its own; out[s] receives row
// w[s]'s sum. The streams' kStreams accumulators keep as many multiply-adds in flight as `dot`'s four.
template <typename W>
void dot_streams(const float* x, const W* const* w, int64_t K, float* const* out) {
    Floats acc[kStreams] = {};
    for (int64_t k = 0; k < K; k += kLanes) {
        const bool new_line = (k * static_cast<int64_t>(sizeof(W))) % kLine == 0;
        const Floats xk = load(x + k);
        for (int s = 0; s < kStreams; s++) {
            if (new_line) {
                prefetch_ahead(w[s] + k, kLine);
            }
            acc[s] += xk * load(w[s] + k);
        }
    }
    for (int s = 0; s < kStreams; s++) {
        *out[s] = total(acc[s]);
    }
}

// One activation row times weight rows [begin, end): the range cut into kStreams equal parts, walked side by side
// (`dot_streams`), and the rows left over one at a time.
template <typename W>
void dot_apart(const float* x, const W* w, int64_t begin, int64_t end, int64_t K, float* y) {
    const int64_t part = (end - begin) / kStreams;
    for (int64_t i = 0; i < part; i++) {
        const W* rows[kStreams];
        float* out[kStreams];
        for (int s = 0; s < kStreams; s++) {
            const int64_t n = begin + s * part + i;
            rows[s] = w + n * K;
            out[s] = y + n;
        }
        dot_streams(x, rows, K, out);
    }
    for (int64_t n = begin + kStreams * part; n < end; n++) {
        y[n] = dot(x, w + n * K, K);
    }
}

// T activation rows (x, each K long) times one weight row: each piece of the weight is loaded (and converted) once
// and multiplied into every row; out[t * stride] receives row t's sum.
template <typename W, int T>
void dot_tile(const float* x, const W* w, int64_t K, float* out, int64_t stride) {
    Floats acc[T] = {};
    for (int64_t k = 0; k < K; k += kLanes) {
        if ((k * static_cast<int64_t>(sizeof(W))) % kLine == 0) {
            prefetch_ahead(w + k, kLine);
        }
        const Floats wk = load(w + k);
        for (int t = 0; t < T; t++) {
            acc[t] += load(x + t * K + k) * wk;
        }
    }
    for (int t = 0; t < T; t++) {
        out[t * stride] = total(acc[t]);
    }
}

template <typename W>
void dot_rows(const float* x, int rows, const W* w, int64_t K, float* out, int64_t stride) {
    switch (rows) {
        case 1: return dot_tile<W, 1>(x, w, K, out, stride);
        case 2: return dot_tile<W, 2>(x, w, K, out, stride);
        case 3: return dot_tile<W, 3>(x, w, K, out, stride);
        case 4: return dot_tile<W, 4>(x, w, K, out, stride);
        case 5: return dot_tile<W, 5>(x, w, K, out, stride);
        case 6: return dot_tile<W, 6>(x, w, K, out, stride);
        case 7: return dot_tile<W, 7>(x, w, K, out, stride);
        default: return dot_tile<W, kTile>(x, w, K, out, stride);
    }
}

// y (M, N) = x (M, K) @ w (N, K)^T, times scale[n] where there is one, plus bias[n] where there is one. Each
// thread takes a contiguous range of weight rows. One activation row is multiplied into kStreams parts of the range
// side by side (`dot_apart`); several are multiplied into each weight row while it is in the cache, kTile rows at
// a time.
template <typename W>
void linear(const float* x, int64_t M, const W* w, int64_t N, int64_t K, const float* scale, const float* bias,
            float* y) {
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
        if (M == 1) {
            dot_apart(x, w, begin, end, K, y);
        } else {
            for (int64_t n = begin; n < end; n++) {
                for (int64_t m = 0; m < M; m += kTile) {
                    const int rows = static_cast<int>(M - m < kTile ? M - m : kTile);
                    dot_rows(x + m * K, rows, w + n * K, K, y + m * N + n, N);
                }
            }
        }
        for (int64_t n = begin; n < end; n++) {
            for (int64_t m = 0; m < M; m++) {
                float v = y[m * N + n];
                if (scale != nullptr) {
                    v *= scale[n];
                }
                if (bias != nullptr) {
                    v += bias[n];
                }
                y[m * N + n] = v;
            }
        }
    });
}

// T activation rows (x, rows K apart) times R int8 weight rows w[0..R), each row in groups of `group` consecutive
// weights with one scale each (scale[r][g], group g). out[r][t * stride] receives weight row r's sum for activation
// row t. R > 1 walks R rows side by side (one activation row, as `dot_streams`), T > 1 multiplies T activation rows
// into one weight row while it is in the cache (as `dot_tile`). With one activation row, each group's products are
// summed and the sum multiplied by the scale (one multiply-add per group); with several, each piece of the weight
// is multiplied by its scale once and then into every row. Group is the group's width where it is known when this
// is compiled (q8_0's 32: its loop unrolled), 0 where it is `group`.
template <int R, int T, int Group>
void dot_groups(const float* x, const int8_t* const* w, const float* const* scale, int64_t K, int64_t group,
                float* const* out, int64_t stride) {
    const int64_t width = Group > 0 ? Group : group;
    const int64_t groups = K / width;
    Floats acc[R][T] = {};
    for (int64_t g = 0; g < groups; g++) {
        const int64_t start = g * width;
        Floats part[R][T] = {};
        Floats s[R];
        for (int r = 0; r < R; r++) {
            s[r] = Floats{} + scale[r][g];
        }
        for (int64_t k = start; k < start + width; k += kLanes) {
            const bool new_line = k % kLine == 0;
            for (int r = 0; r < R; r++) {
                if (new_line) {
                    prefetch_ahead(w[r] + k, kLine);
                }
                if constexpr (T == 1) {
                    part[r][0] += load(x + k) * load(w[r] + k);
                } else {
                    const Floats wk = load(w[r] + k) * s[r];
                    for (int t = 0; t < T; t++) {
                        acc[r][t] += load(x + t * K + k) * wk;
                    }
                }
            }
        }
        if constexpr (T == 1) {
            for (int r = 0; r < R; r++) {
                acc[r][0] += part[r][0] * s[r];
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            out[r][t * stride] = total(acc[r][t]);
        }
    }
}

// `rows` (1 to kTile) activation rows times one int8 weight row in groups: dot_groups for that many rows.
template <int Group>
void dot_groups_rows(const float* x, int rows, const int8_t* w, const float* scale, int64_t K, int64_t group,
                     float* out, int64_t stride) {
    switch (rows) {
        case 1: return dot_groups<1, 1, Group>(x, &w, &scale, K, group, &out, stride);
        case 2: return dot_groups<1, 2, Group>(x, &w, &scale, K, group, &out, stride);
        case 3: return dot_groups<1, 3, Group>(x, &w, &scale, K, group, &out, stride);
        case 4: return dot_groups<1, 4, Group>(x, &w, &scale, K, group, &out, stride);
        case 5: return dot_groups<1, 5, Group>(x, &w, &scale, K, group, &out, stride);
        case 6: return dot_groups<1, 6, Group>(x, &w, &scale, K, group, &out, stride);
        case 7: return dot_groups<1, 7, Group>(x, &w, &scale, K, group, &out, stride);
        default: return dot_groups<1, kTile, Group>(x, &w, &scale, K, group, &out, stride);
    }
}

// y (M, N) = x (M, K) @ W^T plus bias[n] where there is one, W's row n being w[n, k] * scale[n, k / group]: the
// int8 weight in groups of `group` inputs, each with its own scale (scale is (N, K / group)). Cut between threads
// and walked as `linear` does. Group: dot_groups'.
template <int Group>
void linear_groups(const float* x, int64_t M, const int8_t* w, int64_t N, int64_t K, const float* scale,
                   int64_t group, const float* bias, float* y) {
    const int64_t groups = K / group;
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
        if (M == 1) {
            const int64_t part = (end - begin) / kStreams;
            for (int64_t i = 0; i < part; i++) {
                const int8_t* rows[kStreams];
                const float* scales[kStreams];
                float* out[kStreams];
                for (int s = 0; s < kStreams; s++) {
                    const int64_t n = begin + s * part + i;
                    rows[s] = w + n * K;
                    scales[s] = scale + n * groups;
                    out[s] = y + n;
                }
                dot_groups<kStreams, 1, Group>(x, rows, scales, K, group, out, 0);
            }
            for (int64_t n = begin + kStreams * part; n < end; n++) {
                dot_groups_rows<Group>(x, 1, w + n * K, scale + n * groups, K, group, y + n, 0);
            }
        } else {
            for (int64_t n = begin; n < end; n++) {
                for (int64_t m = 0; m < M; m += kTile) {
                    const int rows = static_cast<int>(M - m < kTile ? M - m : kTile);
                    dot_groups_rows<Group>(x + m * K, rows, w + n * K, scale + n * groups, K, group, y + m * N + n, N);
                }
            }
        }
        if (bias != nullptr) {
            for (int64_t n = begin; n < end; n++) {
                for (int64_t m = 0; m < M; m++) {
                    y[m * N + n] += bias[n];
                }
            }
        }
    });
}

void check_operands(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "gptlite linear: x must be a (..., K) float32 CPU tensor");
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
                "gptlite linear: weight must be a contiguous (N, K) CPU tensor");
    TORCH_CHECK(weight.size(1) == x.size(-1), "gptlite linear: x has ", x.size(-1), " columns, weight ",
                weight.size(1));
    TORCH_CHECK(weight.size(1) % kMultiple == 0, "gptlite linear: K = ", weight.size(1), " is not a multiple of ",
                kMultiple);
    if (bias.has_value()) {
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                        bias->scalar_type() == at::kFloat,
                    "gptlite linear: bias must be a contiguous (N,) float32 tensor");
    }
}

const float* bias_data(const std::optional<at::Tensor>& bias) {
    return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

// The output (..., N) for the input (..., K): the shapes are handled here, not by a few more operator calls in Python
// for every layer of every decode step.
at::Tensor output_for(const at::Tensor& x, int64_t N) {
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = N;
    return at::empty(sizes, x.options());
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    check_operands(x, weight, bias);
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "gptlite float_linear: weight must be float32");
    const at::Tensor rows = x.contiguous();
    const int64_t N = weight.size(0);
    const int64_t K = weight.size(1);
    at::Tensor y = output_for(x, N);
    linear<float>(rows.data_ptr<float>(), rows.numel() / K, weight.data_ptr<float>(), N, K, nullptr,
                  bias_data(bias), y.data_ptr<float>());
    return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
    check_operands(x, weight, bias);
    TORCH_CHECK(weight.scalar_type() == at::kChar, "gptlite int8_linear: weight must be int8");
    const int64_t N = weight.size(0);
    const int64_t K = weight.size(1);
    TORCH_CHECK((scale.dim() == 1 || scale.dim() == 2) && scale.size(0) == N && scale.is_contiguous() &&
                    scale.scalar_type() == at::kFloat,
                "gptlite int8_linear: scale must be a contiguous (N,) or (N, G) float32 tensor");
    const at::Tensor rows = x.contiguous();
    at::Tensor y = output_for(x, N);
    if (scale.dim() == 1) {  // one scale per row
        linear<int8_t>(rows.data_ptr<float>(), rows.numel() / K, weight.data_ptr<int8_t>(), N, K,
                       scale.data_ptr<float>(), bias_data(bias), y.data_ptr<float>());
        return y;
    }
    const int64_t groups = scale.size(1);
    TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % kMultiple == 0, "gptlite int8_linear: a scale (N, G) must cut a row's K inputs into G equal groups, "
                "each a multiple of ", kMultiple, " wide, not G = ", groups, " for K = ", K);
    const auto multiply = K / groups == 32 ? linear_groups<32> : linear_groups<0>;  // q8_0's blocks unrolled
    multiply(rows.data_ptr<float>(), rows.numel() / K, weight.data_ptr<int8_t>(), N, K, scale.data_ptr<float>(),
             K / groups, bias_data(bias), y.data_ptr<float>());
    return y;
}

// ---------------------------------------------------------------------------------------------
// int8 x int8: the activations quantized to int8 as llama.cpp's q8_0 quantizes them, multiplied by int8 or int4 codes
// in integer arithmetic
//
// Each activation row is cut into blocks of kBlock numbers, each block quantized with one scale (d = max |x| / 127,
// codes round(x / d) in [-127, 127], ties to even: what `torch.round(x / d)` gives, so that tests quantize the same
// way in torch). A block's products with a weight row's codes are summed exactly in int32, and the sum times the two
// scales added into float32. Per weight byte that is a fraction of an instruction (AVX-512 VNNI's vpdpbusd multiplies
// 32 byte pairs and adds them in fours into int32; AVX2's vpmaddubsw and vpmaddwd in two steps), where the float32
// kernels convert each weight and multiply-add it in float32: the product keeps up with memory at more rows, and an
// int4 weight (half the bytes) is unpacked with two instructions a block. Each output is computed by the same
// sequence of operations whatever the other rows of the call: a row's result does not depend on its batch.

constexpr int64_t kBlock = 32;  // activations quantized per block of this many numbers (q8_0's)

// x (M, K) float32 -> codes (M, K) int8 and scales (M, K / kBlock); sums (M, K / kBlock) the codes' sum per block
// (int4's weights are offset by 8, and this takes the offset out).
void quantize_blocks(const float* x, int64_t M, int64_t K, int8_t* codes, float* scales, int32_t* sums) {
    const int64_t blocks = K / kBlock;
    for (int64_t i = 0; i < M * blocks; i++) {
        const float* in = x + i * kBlock;
        float largest = 0.0f;
        for (int64_t k = 0; k < kBlock; k++) {
            largest = std::max(largest, std::fabs(in[k]));
        }
        const float d = largest / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock; k++) {
            const int32_t q = static_cast<int32_t>(std::nearbyint(in[k] * inverse));
            codes[i * kBlock + k] = static_cast<int8_t>(q);
            sum += q;
        }
        scales[i] = d;
        sums[i] = sum;
    }
}

// The quantized rows of one call.
struct QuantizedRows {
    std::vector<int8_t> codes;  // (M, K)
    std::vector<float> scales;  // (M, K / kBlock)
    std::vector<int32_t> sums;  // (M, K / kBlock)
};

QuantizedRows quantized(const float* x, int64_t M, int64_t K) {
    QuantizedRows rows;
    rows.codes.resize(M * K);
    rows.scales.resize(M * (K / kBlock));
    rows.sums.resize(M * (K / kBlock));
    quantize_blocks(x, M, K, rows.codes.data(), rows.scales.data(), rows.sums.data());
    return rows;
}

// A weight as the integer kernels read it: int8 codes (N, K), or int4 codes packed two to a byte (N, K / 2), each
// block of kBlock codes in 16 bytes, code j in the low nibble of byte j and code j + 16 in the high one (q4_0's
// order), a code q standing for q - 8; a scale per row (groups = 1) or per group of K / groups inputs.
struct IntWeight {
    const int8_t* codes = nullptr;
    const uint8_t* nibbles = nullptr;
    const float* scale = nullptr;
    int64_t groups = 1;
};

#if defined(__AVX2__)
// The 8 int32 sums of a block's 32 products of unsigned bytes u and signed bytes s, four adjacent products each.
inline __m256i block_products(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    // vpmaddubsw's pairs saturate at 32767; |u| <= 127 and |s| <= 127 (int8's codes; int4's u <= 15) stay below
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float lanes_total(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

// The exact sum of block b's products of weight row w and activation codes x (kBlock of each, x already at block b).
template <bool Int4>
inline int32_t block_sum_scalar(const int8_t* w8, const uint8_t* w4, int64_t b, const int8_t* x, int32_t x_sum) {
    int32_t sum = 0;
    if constexpr (Int4) {
        const uint8_t* bytes = w4 + b * (kBlock / 2);
        for (int64_t j = 0; j < kBlock / 2; j++) {
            sum += static_cast<int32_t>(bytes[j] & 0x0F) * x[j] + static_cast<int32_t>(bytes[j] >> 4) * x[j + 16];
        }
        return sum - 8 * x_sum;
    } else {
        const int8_t* codes = w8 + b * kBlock;
        for (int64_t j = 0; j < kBlock; j++) {
            sum += static_cast<int32_t>(codes[j]) * x[j];
        }
        return sum;
    }
}

// R weight rows (w[r], with their scales' row ws[r], or nullptr where the scale is per row) times T quantized
// activation rows (t = 0..T-1 of `rows`, from `first`); out[r][t * stride] receives the sum, before a per-row scale.
// R > 1 walks R weight rows side by side (one activation row: `dot_streams`' reason); T > 1 multiplies T activation
// rows into each block of one weight row while it is in the cache.
template <bool Int4, int R, int T>
void int_dot(const QuantizedRows& rows, int64_t first, int64_t K, const int8_t* const* w8, const uint8_t* const* w4,
             const float* const* ws, int64_t blocks_per_scale, float* const* out, int64_t stride) {
    const int64_t blocks = K / kBlock;
    const int8_t* x = rows.codes.data() + first * K;
    const float* xd = rows.scales.data() + first * blocks;
    const int32_t* xs = rows.sums.data() + first * blocks;
    constexpr int64_t kBlockBytes = Int4 ? kBlock / 2 : kBlock;
#if defined(__AVX2__)
    __m256 acc[R][T];
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            acc[r][t] = _mm256_setzero_ps();
        }
    }
    int64_t group = 0;  // the weight's scale's index: counted, not divided out of b at every block
    int64_t left = blocks_per_scale;
    for (int64_t b = 0; b < blocks; b++) {
        for (int r = 0; r < R; r++) {
            const char* bytes = Int4 ? reinterpret_cast<const char*>(w4[r]) : reinterpret_cast<const char*>(w8[r]);
            if ((b * kBlockBytes) % kLine == 0) {
                prefetch_ahead(bytes + b * kBlockBytes, kLine);
            }
            __m256i u;  // the weight's unsigned bytes: int4's codes, or int8's magnitudes
            __m256i w;
            if constexpr (Int4) {
                const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + b * kBlockBytes));
                const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                u = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
            } else {
                w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + b * kBlockBytes));
                u = _mm256_abs_epi8(w);
            }
            const float weight_scale = ws[r] != nullptr ? ws[r][group] : 1.0f;
            for (int t = 0; t < T; t++) {
                const __m256i xt = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + t * K + b * kBlock));
                __m256i sums;
                if constexpr (Int4) {
                    // the codes stand for q - 8: 8 times the block's activation sum taken out, an eighth per lane
                    sums = _mm256_sub_epi32(block_products(u, xt), _mm256_set1_epi32(xs[t * blocks + b]));
                } else {
                    sums = block_products(u, _mm256_sign_epi8(xt, w));  // |w| x, x negated where w < 0
                }
                const __m256 d = _mm256_set1_ps(xd[t * blocks + b] * weight_scale);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), d, acc[r][t]);
            }
        }
        if (--left == 0) {
            group++;
            left = blocks_per_scale;
        }
    }
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            out[r][t * stride] = lanes_total(acc[r][t]);
        }
    }
#else
    float acc[R][T] = {};
    for (int64_t b = 0; b < blocks; b++) {
        for (int r = 0; r < R; r++) {
            const float weight_scale = ws[r] != nullptr ? ws[r][b / blocks_per_scale] : 1.0f;
            for (int t = 0; t < T; t++) {
                const int32_t sum =
                    block_sum_scalar<Int4>(w8[r], w4[r], b, x + t * K + b * kBlock, Int4 ? xs[t * blocks + b] : 0);
                acc[r][t] += static_cast<float>(sum) * (xd[t * blocks + b] * weight_scale);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            out[r][t * stride] = acc[r][t];
        }
    }
#endif
}

// int_dot for `count` (1 to kTile) activation rows from `first` and weight row n.
template <bool Int4>
void int_dot_rows(const QuantizedRows& rows, int64_t first, int count, const IntWeight& weight, int64_t n,
                  int64_t K, float* out, int64_t stride) {
    const int8_t* w8 = weight.codes != nullptr ? weight.codes + n * K : nullptr;
    const uint8_t* w4 = weight.nibbles != nullptr ? weight.nibbles + n * (K / 2) : nullptr;
    const float* ws = weight.groups > 1 ? weight.scale + n * weight.groups : nullptr;
    const int64_t per_scale = K / kBlock / weight.groups;
    switch (count) {
        case 1: return int_dot<Int4, 1, 1>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 2: return int_dot<Int4, 1, 2>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 3: return int_dot<Int4, 1, 3>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 4: return int_dot<Int4, 1, 4>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 5: return int_dot<Int4, 1, 5>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 6: return int_dot<Int4, 1, 6>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        case 7: return int_dot<Int4, 1, 7>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
        default: return int_dot<Int4, 1, kTile>(rows, first, K, &w8, &w4, &ws, per_scale, &out, stride);
    }
}

// y (M, N) = the quantized rows x (M, K) times the integer weight (N, K), times its scales, plus bias where there is
// one. Each thread takes a contiguous range of weight rows; one activation row is multiplied into kStreams parts of
// the range side by side, several rows kTile at a time into each weight row (any M: a prompt's rows too, each weight
// row read from the cache again for every kTile of them).
template <bool Int4>
void int_linear(const QuantizedRows& rows, int64_t M, const IntWeight& weight, int64_t N, int64_t K,
                const float* bias, float* y) {
    const int64_t per_scale = K / kBlock / weight.groups;
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
        int64_t n = begin;
        if (M == 1) {
            const int64_t part = (end - begin) / kStreams;
            for (int64_t i = 0; i < part; i++) {
                const int8_t* w8[kStreams];
                const uint8_t* w4[kStreams];
                const float* ws[kStreams];
                float* out[kStreams];
                for (int s = 0; s < kStreams; s++) {
                    const int64_t row = begin + s * part + i;
                    w8[s] = weight.codes != nullptr ? weight.codes + row * K : nullptr;
                    w4[s] = weight.nibbles != nullptr ? weight.nibbles + row * (K / 2) : nullptr;
                    ws[s] = weight.groups > 1 ? weight.scale + row * weight.groups : nullptr;
                    out[s] = y + row;
                }
                int_dot<Int4, kStreams, 1>(rows, 0, K, w8, w4, ws, per_scale, out, 0);
            }
            n = begin + kStreams * part;
        }
        for (; n < end; n++) {
            for (int64_t m = 0; m < M; m += kTile) {
                const int count = static_cast<int>(M - m < kTile ? M - m : kTile);
                int_dot_rows<Int4>(rows, m, count, weight, n, K, y + m * N + n, N);
            }
        }
        for (int64_t row = begin; row < end; row++) {
            for (int64_t m = 0; m < M; m++) {
                float v = y[m * N + row];
                if (weight.groups == 1) {
                    v *= weight.scale[row];
                }
                if (bias != nullptr) {
                    v += bias[row];
                }
                y[m * N + row] = v;
            }
        }
    });
}

// x (M, K) float32 quantized (`quantized`) and multiplied by the integer weight: y (M, N).
void int_multiply(const float* x, int64_t M, const IntWeight& weight, int64_t N, int64_t K, const float* bias,
                  float* y) {
    const QuantizedRows rows = quantized(x, M, K);
    if (weight.nibbles != nullptr) {
        int_linear<true>(rows, M, weight, N, K, bias, y);
    } else {
        int_linear<false>(rows, M, weight, N, K, bias, y);
    }
}

// The weight's scale (N,) or (N, G), checked: G groups of K / G inputs, each a whole number of blocks.
int64_t int_scale_groups(const at::Tensor& scale, int64_t N, int64_t K, const char* op) {
    TORCH_CHECK((scale.dim() == 1 || scale.dim() == 2) && scale.size(0) == N && scale.is_contiguous() &&
                    scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
                op, ": scale must be a contiguous (N,) or (N, G) float32 CPU tensor, not ", scale.sizes());
    const int64_t groups = scale.dim() == 1 ? 1 : scale.size(1);
    TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % kBlock == 0, op, ": a scale (N, G) must cut a row's ",
                K, " inputs into G groups of a multiple of ", kBlock, ", not G = ", groups);
    return groups;
}

// torch.ops.gptlite.int8_dot_linear(x, weight, scale, bias): x (..., K) float32, weight (N, K) int8, scale (N,) or
// (N, G), K a multiple of kBlock -> (..., N), x quantized per block of kBlock (see above).
at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
    check_operands(x, weight, bias);
    TORCH_CHECK(weight.scalar_type() == at::kChar, "gptlite int8_dot_linear: weight must be int8");
    const int64_t N = weight.size(0);
    const int64_t K = weight.size(1);
    TORCH_CHECK(K % kBlock == 0, "gptlite int8_dot_linear: K = ", K, " is not a multiple of ", kBlock);
    IntWeight codes;
    codes.codes = weight.data_ptr<int8_t>();
    codes.groups = int_scale_groups(scale, N, K, "gptlite int8_dot_linear");
    codes.scale = scale.data_ptr<float>();
    const at::Tensor rows = x.contiguous();
    at::Tensor y = output_for(x, N);
    int_multiply(rows.data_ptr<float>(), rows.numel() / K, codes, N, K, bias_data(bias), y.data_ptr<float>());
    return y;
}

// torch.ops.gptlite.int4_dot_linear(x, weight, scale, bias): x (..., K) float32, weight (N, K / 2) uint8 (two
// codes a byte, IntWeight's order), scale (N, G) -> (..., N), x quantized per block of kBlock.
at::Tensor int4_dot_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "gptlite int4_dot_linear: x must be a (..., K) float32 CPU tensor");
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                    weight.device().is_cpu() && 2 * weight.size(1) == x.size(-1),
                "gptlite int4_dot_linear: weight must be a contiguous (N, K / 2) uint8 CPU tensor for x's K = ",
                x.size(-1), ", not ", weight.sizes());
    const int64_t N = weight.size(0);
    const int64_t K = x.size(-1);
    TORCH_CHECK(K % kBlock == 0, "gptlite int4_dot_linear: K = ", K, " is not a multiple of ", kBlock);
    if (bias.has_value()) {
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                        bias->scalar_type() == at::kFloat,
                    "gptlite int4_dot_linear: bias must be a contiguous (N,) float32 tensor");
    }
    IntWeight codes;
    codes.nibbles = weight.data_ptr<uint8_t>();
    codes.groups = int_scale_groups(scale, N, K, "gptlite int4_dot_linear");
    TORCH_CHECK(scale.dim() == 2, "gptlite int4_dot_linear: scale must be (N, G), one per group");
    codes.scale = scale.data_ptr<float>();
    const at::Tensor rows = x.contiguous();
    at::Tensor y = output_for(x, N);
    int_multiply(rows.data_ptr<float>(), rows.numel() / K, codes, N, K, bias_data(bias), y.data_ptr<float>());
    return y;
}

// a . b over D floats, D any length.
inline float dot_any(const float* a, const float* b, int64_t D) {
    Floats a0 = {};
    Floats a1 = {};
    int64_t d = 0;
    for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
        a0 += load(a + d) * load(b + d);
        a1 += load(a + d + kLanes) * load(b + d + kLanes);
    }
    for (; d + kLanes <= D; d += kLanes) {
        a0 += load(a + d) * load(b + d);
    }
    float sum = total(a0 + a1);
    for (; d < D; d++) {
        sum += a[d] * b[d];
    }
    return sum;
}

// e^x, lane by lane, for x <= 0 (scores less their largest): Cephes' expf. x = n ln2 + r with |r| <= ln2 / 2, e^r
// by its polynomial, times 2^n written into the exponent's bits. Lanes below -87 (e^x under the smallest normal
// float; a hidden key's -inf) give 0.
inline Floats exp_negative(Floats x) {
    typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
    const Ints hidden = x < -87.0f;
    x = hidden ? Floats{} - 87.0f : x;
    const Floats t = x * 1.44269504088896341f + 0.5f;  // n = floor(x / ln2 + 1/2)
    Ints n = __builtin_convertvector(t, Ints);           // rounded toward zero: one too high below zero
    n += __builtin_convertvector(n, Floats) > t;         // true is -1
    const Floats nf = __builtin_convertvector(n, Floats);
    const Floats r = x - nf * 0.693359375f - nf * -2.12194440e-4f;  // x - n ln2, ln2 in two parts
    Floats p = Floats{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const Floats er = p * r * r + r + 1.0f;
    const Ints bits = (n + 127) << 23;
    Floats two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return hidden ? Floats{} : er * two_n;
}

// out (D) = norm * sum_s p[s] v[s], v's rows `stride` floats apart; keys of weight 0 (hidden ones) are skipped.
void weighted_sum(const float* p, const float* v, int64_t stride, int64_t S, int64_t D, float norm, float* out) {
    int64_t d = 0;
    for (; d + 4 * kLanes <= D; d += 4 * kLanes) {  // four vectors of the output at a time, kept in registers
        Floats o[4] = {};
        for (int64_t s = 0; s < S; s++) {
            if (p[s] != 0.0f) {
                const float* row = v + s * stride + d;
                for (int i = 0; i < 4; i++) {
                    o[i] += p[s] * load(row + i * kLanes);
                }
            }
        }
        for (int i = 0; i < 4; i++) {
            o[i] *= norm;
        }
        std::memcpy(out + d, o, sizeof o);
    }
    for (; d + kLanes <= D; d += kLanes) {
        Floats o = {};
        for (int64_t s = 0; s < S; s++) {
            if (p[s] != 0.0f) {
                o += p[s] * load(v + s * stride + d);
            }
        }
        o *= norm;
        std::memcpy(out + d, &o, sizeof o);
    }
    for (; d < D; d++) {
        float o = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            if (p[s] != 0.0f) {
                o += p[s] * v[s * stride + d];
            }
        }
        out[d] = norm * o;
    }
}

// One query's attention over S keys and values (rows of D floats, consecutive), the ones `visible` shows (all where
// it is null). `scores` is scratch for S floats rounded up to a whole vector. Writes out (D); zeros where no key is
// visible (a decode step always sees its own key).
void attend(const float* q, const float* k, const float* v, const bool* visible, int64_t S, int64_t D, float scale,
            float* scores, float* out) {
    const float hide = -std::numeric_limits<float>::infinity();
    float highest = hide;
    for (int64_t s = 0; s < S; s++) {
        scores[s] = visible == nullptr || visible[s] ? scale * dot_any(q, k + s * D, D) : hide;
        highest = std::max(highest, scores[s]);
    }
    if (highest == hide) {
        std::fill(out, out + D, 0.0f);
        return;
    }
    const int64_t padded = (S + kLanes - 1) / kLanes * kLanes;
    std::fill(scores + S, scores + padded, hide);
    Floats sums = {};
    for (int64_t s = 0; s < padded; s += kLanes) {
        const Floats e = exp_negative(load(scores + s) - highest);
        std::memcpy(scores + s, &e, sizeof e);
        sums += e;
    }
    weighted_sum(scores, v, D, S, D, 1.0f / total(sums), out);
}

// An optional operand of `size` floats: its data, null for None; refused by name (for the operator `op`) unless it
// is a contiguous (size,) float32 CPU tensor.
const float* optional_data(const std::optional<at::Tensor>& tensor, int64_t size, const char* name,
                           const char* op = "gptlite block_step") {
    if (!tensor.has_value()) {
        return nullptr;
    }
    TORCH_CHECK(tensor->dim() == 1 && tensor->size(0) == size && tensor->is_contiguous() &&
                    tensor->scalar_type() == at::kFloat && tensor->device().is_cpu(),
                op, ": ", name, " must be a contiguous (", size, ",) float32 CPU tensor, not ", tensor->sizes());
    return tensor->data_ptr<float>();
}

// 1 / sqrt(mean(x^2) + eps) over x (n): RMSNorm's factor, of one head (Qwen3's q/k norms) or of all of a row's q
// or k (OLMo 2's).
float rms_reciprocal(const float* x, int64_t n, float eps) {
    float squares = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        squares += x[d] * x[d];
    }
    return 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
}

// A head's q or k before it attends: out (D) = x (D) normalized (times `reciprocal`, its norm's factor, and times
// `weight`, where a weight is given), then its leading R coordinates rotated by the angles whose cos and sin are (R)
// (where they are given; R even, <= D): out[i] = x[i] cos[i] - x[i + R/2] sin[i] and
// out[i + R/2] = x[i + R/2] cos[i + R/2] + x[i] sin[i + R/2] for i < R/2, rotate_half's pairing; the rest as they
// are.
void prepare_head(const float* x, int64_t D, const float* weight, float reciprocal, const float* cos,
                  const float* sin, int64_t R, float* out) {
    if (weight != nullptr) {
        for (int64_t d = 0; d < D; d++) {
            out[d] = x[d] * reciprocal * weight[d];
        }
    } else {
        std::memcpy(out, x, D * sizeof(float));
    }
    if (cos == nullptr) {
        return;
    }
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        const float first = out[i];
        const float second = out[i + half];
        out[i] = first * cos[i] + -second * sin[i];
        out[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

// The q/k norms' factor of each of a row's n heads (heads (n, D)), into factors (n): RMSNorm's of each head where
// the norm's weight is one head's (D numbers), or of all n heads together where it spans them (n D: OLMo 2's).
void head_factors(const float* heads, int64_t n, int64_t D, bool whole, float eps, float* factors) {
    const float all = whole ? rms_reciprocal(heads, n * D, eps) : 0.0f;
    for (int64_t h = 0; h < n; h++) {
        factors[h] = whole ? all : rms_reciprocal(heads + h * D, D, eps);
    }
}

// A row's angles, cos or sin (B or 1, R) float32, rows contiguous: its data and the stride between rows (0 for one
// row that every row shares); null for None.
const float* angles_of(const std::optional<at::Tensor>& angles, int64_t B, int64_t R, int64_t D, const char* name,
                       int64_t* stride) {
    *stride = 0;
    if (!angles.has_value()) {
        return nullptr;
    }
    TORCH_CHECK(angles->dim() == 2 && (angles->size(0) == B || angles->size(0) == 1) && angles->size(1) == R &&
                    R % 2 == 0 && R <= D && angles->stride(1) == 1 && angles->scalar_type() == at::kFloat &&
                    angles->device().is_cpu(),
                "gptlite cached_attention: ", name, " must be a (", B, " or 1, R) float32 CPU tensor, R even and at ",
                "most the head's ", D, ", rows contiguous, not ", angles->sizes());
    *stride = angles->size(0) == 1 ? 0 : angles->stride(0);
    return angles->data_ptr<float>();
}

at::Tensor cached_attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t slot,
                            int64_t span, const std::optional<at::Tensor>& visible, double scale, int64_t n_head,
                            const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                            const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                            double head_eps, int64_t window, const std::optional<at::Tensor>& slots) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && k_cache.scalar_type() == at::kFloat &&
                    v_cache.scalar_type() == at::kFloat && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                "gptlite cached_attention: k_cache and v_cache must be contiguous (B, KV, L, D) float32 CPU tensors");
    const int64_t B = k_cache.size(0);
    const int64_t KV = k_cache.size(1);
    const int64_t L = k_cache.size(2);
    const int64_t D = k_cache.size(3);
    const int64_t H = n_head;
    const int64_t width = (H + 2 * KV) * D;
    TORCH_CHECK(qkv.dim() == 3 && qkv.size(0) == B && qkv.size(1) == 1 && qkv.size(2) == width &&
                    qkv.is_contiguous() && qkv.scalar_type() == at::kFloat && qkv.device().is_cpu(),
                "gptlite cached_attention: qkv must be a contiguous (", B, ", 1, ", width, ") float32 CPU tensor, ",
                "not ", qkv.sizes());
    TORCH_CHECK(H > 0 && H % KV == 0, "gptlite cached_attention: ", H, " query heads for ", KV, " key/value heads");
    TORCH_CHECK(0 <= slot && slot < span && span <= L, "gptlite cached_attention: slot ", slot, " and span ", span,
                " in a cache of ", L);
    const bool* shown = nullptr;
    int64_t shown_stride = 0;
    if (visible.has_value()) {
        TORCH_CHECK(visible->dim() == 2 && visible->size(0) == B && visible->size(1) >= span &&
                        visible->stride(1) == 1 && visible->scalar_type() == at::kBool,
                    "gptlite cached_attention: visible must be a (B, >= span) bool tensor, rows contiguous");
        shown = visible->data_ptr<bool>();
        shown_stride = visible->stride(0);
    }
    const int64_t* row_slots = nullptr;
    if (slots.has_value()) {
        TORCH_CHECK(slots->dim() == 1 && slots->size(0) == B && slots->is_contiguous() &&
                        slots->scalar_type() == at::kLong && slots->device().is_cpu(),
                    "gptlite cached_attention: slots must be a contiguous (", B, ",) int64 CPU tensor, not ",
                    slots->sizes());
        row_slots = slots->data_ptr<int64_t>();
        for (int64_t b = 0; b < B; b++) {
            TORCH_CHECK(0 <= row_slots[b] && row_slots[b] < span, "gptlite cached_attention: row ", b, "'s slot ",
                        row_slots[b], " is outside the span ", span);
        }
    }
    // row b's token goes to slot_of(b) and it attends over slots [0, slot_of(b)] (rows at their own lengths), or
    // every row's to `slot`, attending over [0, span)
    const auto slot_of = [&](int64_t b) { return row_slots == nullptr ? slot : row_slots[b]; };
    const auto span_of = [&](int64_t b) { return row_slots == nullptr ? span : row_slots[b] + 1; };
    TORCH_CHECK(cos.has_value() == sin.has_value(), "gptlite cached_attention: cos and sin go together");
    const int64_t R = cos.has_value() ? cos->size(-1) : 0;
    int64_t cos_stride = 0;
    int64_t sin_stride = 0;
    const float* cosines = angles_of(cos, B, R, D, "cos", &cos_stride);
    const float* sines = angles_of(sin, B, R, D, "sin", &sin_stride);
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "gptlite cached_attention: q_norm and k_norm go together");
    // a q/k norm's weight is one head's (D: Qwen3's, each head normalized alone) or all heads' (H D or KV D: OLMo
    // 2's, the row's q or k normalized as one); with one head, the two are the same
    const bool q_whole = q_norm.has_value() && q_norm->dim() == 1 && q_norm->size(0) == H * D;
    const bool k_whole = k_norm.has_value() && k_norm->dim() == 1 && k_norm->size(0) == KV * D;
    const float* q_weight = optional_data(q_norm, q_whole ? H * D : D, "q_norm", "gptlite cached_attention");
    const float* k_weight = optional_data(k_norm, k_whole ? KV * D : D, "k_norm", "gptlite cached_attention");
    const bool prepared = cosines != nullptr || q_weight != nullptr;  // whether q and k change before they attend
    const float eps = static_cast<float>(head_eps);
    const float* in = qkv.data_ptr<float>();
    float* keys = k_cache.data_ptr<float>();
    float* values = v_cache.data_ptr<float>();
    std::vector<float> factors(std::max(H, KV), 1.0f);  // each head's norm factor, of the row at hand
    for (int64_t b = 0; b < B; b++) {  // the token's keys (normalized and rotated) and values into the slot
        const float* row = in + b * width;
        if (k_weight != nullptr) {
            head_factors(row + H * D, KV, D, k_whole, eps, factors.data());
        }
        for (int64_t g = 0; g < KV; g++) {
            float* key = keys + ((b * KV + g) * L + slot_of(b)) * D;
            if (prepared) {
                const float* weight = k_weight == nullptr ? nullptr : k_weight + (k_whole ? g * D : 0);
                prepare_head(row + (H + g) * D, D, weight, factors[g], cosines + b * cos_stride,
                             sines + b * sin_stride, R, key);
            } else {
                std::memcpy(key, row + (H + g) * D, D * sizeof(float));
            }
            std::memcpy(values + ((b * KV + g) * L + slot_of(b)) * D, row + (H + KV + g) * D, D * sizeof(float));
        }
    }
    // the queries: qkv's own numbers, or each head's normalized and rotated into `queries` (B, H, D)
    std::vector<float> queries(prepared ? B * H * D : 0);
    for (int64_t b = 0; prepared && b < B; b++) {
        const float* row = in + b * width;
        if (q_weight != nullptr) {
            head_factors(row, H, D, q_whole, eps, factors.data());
        }
        for (int64_t h = 0; h < H; h++) {
            const float* weight = q_weight == nullptr ? nullptr : q_weight + (q_whole ? h * D : 0);
            prepare_head(row + h * D, D, weight, factors[h], cosines + b * cos_stride, sines + b * sin_stride, R,
                         queries.data() + (b * H + h) * D);
        }
    }
    // a sliding window (Gemma 3's local layers) sees the slots [slot - window + 1, slot]: a row's slots are its
    // positions plus its padding, so a slot's distance back is its position's
    TORCH_CHECK(window >= 0, "gptlite cached_attention: window ", window, " must be >= 0 (0: none)");
    const auto first_of = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, slot_of(b) - window + 1) : 0; };
    const auto last_of = [&](int64_t b) { return window > 0 ? slot_of(b) + 1 : span_of(b); };  // one past the last
    at::Tensor out = at::empty({B, 1, H * D}, qkv.options());
    float* outs = out.data_ptr<float>();
    const int64_t group = H / KV;
    const int64_t most = window > 0 ? std::min(window, span) : span;  // the most slots a row attends to
    const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, most * D));  // short spans: one thread
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> scores((most + kLanes - 1) / kLanes * kLanes);
        for (int64_t i = begin; i < end; i++) {
            const int64_t b = i / H;
            const int64_t h = i % H;
            const int64_t g = h / group;
            const int64_t first = first_of(b);
            const int64_t seen = last_of(b) - first;  // the slots this row attends to
            const float* query = prepared ? queries.data() + i * D : in + b * width + h * D;
            attend(query, keys + ((b * KV + g) * L + first) * D, values + ((b * KV + g) * L + first) * D,
                   shown == nullptr ? nullptr : shown + b * shown_stride + first, seen, D, static_cast<float>(scale),
                   scores.data(), outs + i * D);
        }
    });
    return out;
}

// ---------------------------------------------------------------------------------------------
// A decode step of a whole pre-norm block

// How a block normalizes, and the activation of its feed-forward: named by gptlite.model, chosen once per call (each
// activation's loop is compiled on its own), never per number.
enum class Norm { kLayer, kRms, kRmsUnitOffset };
enum class Activation { kGeluTanh, kReluSquared, kSiluGate, kGeluGate };
// Where a block's norms stand: before each branch (GPT-2, Llama), on each branch's output (OLMo 2), or both (Gemma)
enum class Position { kPre, kPost, kBoth };

Norm norm_named(c10::string_view name) {
    if (name == "layernorm") {
        return Norm::kLayer;
    }
    if (name == "rmsnorm_unit_offset") {
        return Norm::kRmsUnitOffset;
    }
    TORCH_CHECK(name == "rmsnorm", "gptlite block_step: norm must be layernorm, rmsnorm or rmsnorm_unit_offset, not ",
                name);
    return Norm::kRms;
}

Position position_named(c10::string_view name) {
    if (name == "pre") {
        return Position::kPre;
    }
    if (name == "post") {
        return Position::kPost;
    }
    TORCH_CHECK(name == "both", "gptlite block_step: position must be pre, post or both, not ", name);
    return Position::kBoth;
}

Activation activation_named(c10::string_view name) {
    if (name == "gelu_tanh") {
        return Activation::kGeluTanh;
    }
    if (name == "relu_squared") {
        return Activation::kReluSquared;
    }
    if (name == "silu_gate") {
        return Activation::kSiluGate;
    }
    TORCH_CHECK(name == "gelu_gate", "gptlite block_step: activation must be gelu_tanh, relu_squared, silu_gate or ",
                "gelu_gate, not ", name);
    return Activation::kGeluGate;
}

bool gated(Activation activation) {
    return activation == Activation::kSiluGate || activation == Activation::kGeluGate;
}

// out (C) = the norm of x (C), times weight, plus bias (either may be null): LayerNorm's (x - mean) / sqrt(variance
// + eps), the variance the biased one, or RMSNorm's x / sqrt(mean(x^2) + eps), times 1 + weight for Gemma's unit
// offset. C is a multiple of kLanes; out may be x.
void normalize(const float* x, int64_t C, Norm norm, float eps, const float* weight, const float* bias, float* out) {
    float mean = 0.0f;
    if (norm == Norm::kLayer) {
        Floats sum = {};
        for (int64_t c = 0; c < C; c += kLanes) {
            sum += load(x + c);
        }
        mean = total(sum) / static_cast<float>(C);
    }
    Floats squares = {};
    for (int64_t c = 0; c < C; c += kLanes) {
        const Floats centred = load(x + c) - mean;
        squares += centred * centred;
    }
    const float reciprocal = 1.0f / std::sqrt(total(squares) / static_cast<float>(C) + eps);
    for (int64_t c = 0; c < C; c += kLanes) {
        Floats y = (load(x + c) - mean) * reciprocal;
        if (weight != nullptr && norm == Norm::kRmsUnitOffset) {
            y *= 1.0f + load(weight + c);
        } else if (weight != nullptr) {
            y *= load(weight + c);
        }
        if (bias != nullptr) {
            y += load(bias + c);
        }
        std::memcpy(out + c, &y, sizeof y);
    }
}

// 1 / (1 + e^-v), lane by lane, through e^-|v| (`exp_negative`), which never overflows.
inline Floats sigmoid(Floats v) {
    const Floats e = exp_negative(v < 0.0f ? v : -v);
    const Floats one = Floats{} + 1.0f;
    return v < 0.0f ? e / (one + e) : one / (one + e);
}

// GELU's tanh approximation, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), as x sigmoid(2u): the
// same number, since 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u).
inline Floats gelu_tanh(Floats x) {
    const Floats u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x * sigmoid(2.0f * u);
}

template <Activation A>
inline Floats activate(Floats x) {
    if constexpr (A == Activation::kGeluTanh || A == Activation::kGeluGate) {
        return gelu_tanh(x);
    } else if constexpr (A == Activation::kReluSquared) {
        const Floats relu = x < 0.0f ? Floats{} : x;
        return relu * relu;
    } else {
        return x * sigmoid(x);  // SiLU
    }
}

// The feed-forward's activation of B rows of fc output h into out (B, F): act(h) for rows h (F), or, gated
// (SwiGLU, GeGLU: fc's first F rows the gate's, the last F the value's), act(gate) * value for rows h = [gate |
// value] (2F). F is a multiple of kLanes.
template <Activation A>
void activate_rows(const float* h, int64_t B, int64_t F, float* out) {
    constexpr bool kGated = A == Activation::kSiluGate || A == Activation::kGeluGate;
    const int64_t width = kGated ? 2 * F : F;
    for (int64_t b = 0; b < B; b++) {
        const float* row = h + b * width;
        for (int64_t f = 0; f < F; f += kLanes) {
            Floats y = activate<A>(load(row + f));
            if constexpr (kGated) {
                y *= load(row + F + f);
            }
            std::memcpy(out + b * F + f, &y, sizeof y);
        }
    }
}

// `activate_rows` compiled for each activation, the one named chosen once per call.
void activate_all(Activation activation, const float* h, int64_t B, int64_t F, float* out) {
    switch (activation) {
        case Activation::kGeluTanh: return activate_rows<Activation::kGeluTanh>(h, B, F, out);
        case Activation::kReluSquared: return activate_rows<Activation::kReluSquared>(h, B, F, out);
        case Activation::kSiluGate: return activate_rows<Activation::kSiluGate>(h, B, F, out);
        case Activation::kGeluGate: return activate_rows<Activation::kGeluGate>(h, B, F, out);
    }
}

// stream (n) += alpha * branch (n)
void add_scaled(float* stream, const float* branch, int64_t n, float alpha) {
    for (int64_t i = 0; i < n; i++) {
        stream[i] += alpha * branch[i];
    }
}

// One of the block's four matrices: a contiguous (rows, columns) weight, float32, or int8 with one float32 scale per
// row, whose input width the kernels take, multiplied by float32 activations; or int8 codes (a scale per row) or int4
// codes (IntWeight's, a scale per group) multiplied by activations quantized to int8 (`int_multiply`).
struct Matrix {
    const float* floats = nullptr;  // the float32 weight, or
    const int8_t* codes = nullptr;  // the int8 one
    const float* scale = nullptr;   // and its scales (rows,)
    IntWeight integer;              // or the codes int_multiply takes, where `quantized_inputs`
    bool quantized_inputs = false;
    int64_t rows = 0;
    int64_t columns = 0;
};

// The matrix `weight` of int_multiply's: int8 codes (rows, columns) with a scale per row, or int4 codes
// (rows, columns / 2) uint8 with a scale per group (rows, G).
Matrix integer_matrix_of(const at::Tensor& weight, const std::optional<at::Tensor>& scale, int64_t rows,
                         int64_t columns, const char* name) {
    const bool int4 = weight.scalar_type() == at::kByte;
    const int64_t width = int4 ? columns / 2 : columns;
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == rows && weight.size(1) == width && weight.is_contiguous() &&
                    weight.device().is_cpu() && (int4 || weight.scalar_type() == at::kChar) && scale.has_value(),
                "gptlite block_step: ", name, " with int8 inputs must be contiguous (", rows, ", ", width,
                ") int8 codes or (", rows, ", ", columns / 2, ") int4 ones, with their scales, not ", weight.sizes());
    TORCH_CHECK(columns % kBlock == 0, "gptlite block_step: ", name, " has ", columns,
                " columns, not a multiple of ", kBlock, " (int8 inputs)");
    Matrix matrix;
    matrix.rows = rows;
    matrix.columns = columns;
    matrix.quantized_inputs = true;
    matrix.integer.codes = int4 ? nullptr : weight.data_ptr<int8_t>();
    matrix.integer.nibbles = int4 ? weight.data_ptr<uint8_t>() : nullptr;
    matrix.integer.groups = int_scale_groups(*scale, rows, columns, "gptlite block_step");
    matrix.integer.scale = scale->data_ptr<float>();
    return matrix;
}

Matrix matrix_of(const at::Tensor& weight, const std::optional<at::Tensor>& scale, int64_t rows, int64_t columns,
                 const char* name) {
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == rows && weight.size(1) == columns && weight.is_contiguous() &&
                    weight.device().is_cpu(),
                "gptlite block_step: ", name, " must be a contiguous (", rows, ", ", columns,
                ") CPU tensor, not ", weight.sizes());
    TORCH_CHECK(columns % kMultiple == 0, "gptlite block_step: ", name, " has ", columns,
                " columns, not a multiple of ", kMultiple);
    Matrix matrix;
    matrix.rows = rows;
    matrix.columns = columns;
    if (weight.scalar_type() == at::kFloat) {
        TORCH_CHECK(!scale.has_value(), "gptlite block_step: ", name, " is float32 and takes no scale");
        matrix.floats = weight.data_ptr<float>();
        return matrix;
    }
    TORCH_CHECK(weight.scalar_type() == at::kChar && scale.has_value(), "gptlite block_step: ", name,
                " must be float32, or int8 with a scale per row");
    std::string what = std::string(name) + "'s scale";
    matrix.codes = weight.data_ptr<int8_t>();
    matrix.scale = optional_data(scale, rows, what.c_str());
    return matrix;
}

// y (M, rows) = x (M, columns) times the matrix, plus bias where there is one.
void multiply(const Matrix& matrix, const float* x, int64_t M, const float* bias, float* y) {
    if (matrix.quantized_inputs) {
        int_multiply(x, M, matrix.integer, matrix.rows, matrix.columns, bias, y);
    } else if (matrix.floats != nullptr) {
        linear<float>(x, M, matrix.floats, matrix.rows, matrix.columns, nullptr, bias, y);
    } else {
        linear<int8_t>(x, M, matrix.codes, matrix.rows, matrix.columns, matrix.scale, bias, y);
    }
}

// The norms of one branch of a block: the one before it and the one on its output, each null where the block's
// position has none there, and each norm's weight and bias (null where it has none).
struct BranchNorms {
    bool before = false;
    bool after = false;
    const float* before_weight = nullptr;
    const float* before_bias = nullptr;
    const float* after_weight = nullptr;
    const float* after_bias = nullptr;
};

// norms holds a block's norm tensors (weight, bias) in its modules' order: the attention's, the feed-forward's, and
// for both positions the attention's post-norm's and the feed-forward's post-norm's. For the post position the first
// two stand on the branches' outputs (OLMo 2's attn_norm and ffn_norm).
BranchNorms branch_norms(const c10::List<std::optional<at::Tensor>>& norms, Position position, int branch, int64_t C,
                         const char* name) {
    BranchNorms out;
    const std::string own = std::string("the ") + name + " norm's ";
    const std::string post = std::string("the ") + name + " post-norm's ";
    const float* weight = optional_data(norms.get(2 * branch), C, (own + "weight").c_str());
    const float* bias = optional_data(norms.get(2 * branch + 1), C, (own + "bias").c_str());
    if (position == Position::kPost) {
        out.after = true;
        out.after_weight = weight;
        out.after_bias = bias;
        return out;
    }
    out.before = true;
    out.before_weight = weight;
    out.before_bias = bias;
    if (position == Position::kBoth) {
        out.after = true;
        out.after_weight = optional_data(norms.get(4 + 2 * branch), C, (post + "weight").c_str());
        out.after_bias = optional_data(norms.get(4 + 2 * branch + 1), C, (post + "bias").c_str());
    }
    return out;
}

// A block's decode step, x (B, 1, C) -> (B, 1, C), in one call. For the pre-norm position (GPT-2, Llama):
//
//   x = x + residual_scale * out_proj(attention(qkv(norm(x))))      attention through the KV cache (cached_attention)
//   x = x + residual_scale * down(act(fc(norm(x))))
//
// for the post position (OLMo 2) each norm on its branch's output instead, x + s norm(out_proj(attention(qkv(x)))),
// and for both (Gemma) one before and one after, x + s post_norm(out_proj(attention(qkv(norm(x))))).
//
// norms: `branch_norms`' (4 tensors, or 8 for both positions); weights: qkv (Q, C), the attention's out_proj
// (C, H D), fc (F or 2F, C), the feed-forward's out_proj (C, F), each float32, or int8 with its scales (one per row)
// in `scales` (None for a float32 one); biases: theirs, in that order, each None where the layer has none; cos, sin,
// q_norm, k_norm, head_eps and window: the attention's rotation, q/k norms and sliding window (cached_attention's);
// input_bits: for each matrix, 32 (float32 inputs) or 8 (its inputs quantized to int8 and multiplied by int8 codes
// with a scale per row or int4 codes (rows, columns / 2) uint8 with a scale per group, as int8_dot_linear and
// int4_dot_linear do), or empty for 32 each. What gptlite.model's Block, PostNormBlock and SandwichBlock compute with
// their attention and feed-forward, without the module and operator calls between the matrices.
at::Tensor block_step(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& norms, at::TensorList weights,
                      const c10::List<std::optional<at::Tensor>>& scales,
                      const c10::List<std::optional<at::Tensor>>& biases, at::Tensor& k_cache, at::Tensor& v_cache,
                      int64_t slot, int64_t span, const std::optional<at::Tensor>& visible, double scale,
                      int64_t n_head, c10::string_view norm_name, double eps, c10::string_view activation_name,
                      double residual_scale, const std::optional<at::Tensor>& cos,
                      const std::optional<at::Tensor>& sin, const std::optional<at::Tensor>& q_norm,
                      const std::optional<at::Tensor>& k_norm, double head_eps, c10::string_view position_name,
                      int64_t window, const std::optional<at::Tensor>& slots, at::IntArrayRef input_bits) {
    TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "gptlite block_step: x must be a (B, 1, C) float32 CPU tensor, not ", x.sizes());
    TORCH_CHECK(input_bits.empty() || input_bits.size() == 4, "gptlite block_step: 4 input_bits (or none), not ",
                input_bits.size());
    for (const int64_t bits : input_bits) {
        TORCH_CHECK(bits == 32 || bits == 8, "gptlite block_step: a matrix's input_bits are 32 (float32) or 8 (int8), "
                    "not ", bits);
    }
    const Position position = position_named(position_name);
    const size_t norm_tensors = position == Position::kBoth ? 8 : 4;
    TORCH_CHECK(norms.size() == norm_tensors && weights.size() == 4 && scales.size() == 4 && biases.size() == 4,
                "gptlite block_step: ", norm_tensors, " norm tensors, 4 weights, 4 scales and 4 biases, not ",
                norms.size(), ", ", weights.size(), ", ", scales.size(), " and ", biases.size());
    const Norm norm = norm_named(norm_name);
    const Activation activation = activation_named(activation_name);
    const int64_t B = x.size(0);
    const int64_t C = x.size(2);
    const int64_t Q = weights[0].size(0);
    // an int4 weight's columns are its bytes' count times two
    const auto columns_of = [&](int i) { return weights[i].size(1) * (weights[i].scalar_type() == at::kByte ? 2 : 1); };
    const int64_t HD = columns_of(1);
    const int64_t F = columns_of(3);
    const int64_t FC = gated(activation) ? 2 * F : F;  // fc's rows
    const auto block_matrix = [&](int i, int64_t rows, int64_t columns, const char* name) {
        if (!input_bits.empty() && input_bits[i] == 8) {
            return integer_matrix_of(weights[i], scales.get(i), rows, columns, name);
        }
        return matrix_of(weights[i], scales.get(i), rows, columns, name);
    };
    const Matrix qkv_weight = block_matrix(0, Q, C, "the qkv weight");
    const Matrix attn_weight = block_matrix(1, C, HD, "the attention's out_proj weight");
    const Matrix fc_weight = block_matrix(2, FC, C, "the fc weight");
    const Matrix ffn_weight = block_matrix(3, C, F, "the feed-forward's out_proj weight");
    const BranchNorms attn_norms = branch_norms(norms, position, 0, C, "attention");
    const BranchNorms ffn_norms = branch_norms(norms, position, 1, C, "feed-forward");
    const float* qkv_bias = optional_data(biases.get(0), Q, "the qkv bias");
    const float* attn_bias = optional_data(biases.get(1), C, "the attention's out_proj bias");
    const float* fc_bias = optional_data(biases.get(2), FC, "the fc bias");
    const float* ffn_bias = optional_data(biases.get(3), C, "the feed-forward's out_proj bias");
    const float alpha = static_cast<float>(residual_scale);
    const float epsilon = static_cast<float>(eps);

    const at::Tensor rows = x.contiguous();
    at::Tensor out = at::empty({B, 1, C}, x.options());  // the residual stream
    float* stream = out.data_ptr<float>();
    std::memcpy(stream, rows.data_ptr<float>(), B * C * sizeof(float));  // not at::clone: no trip through ATen's copy
    std::vector<float> normed(B * C);
    std::vector<float> branch(B * C);

    // a branch's input: the stream itself, or its norm (rows of C)
    auto branch_input = [&](const BranchNorms& around) -> const float* {
        if (!around.before) {
            return stream;
        }
        for (int64_t b = 0; b < B; b++) {
            normalize(stream + b * C, C, norm, epsilon, around.before_weight, around.before_bias,
                      normed.data() + b * C);
        }
        return normed.data();
    };
    // the branch's output (rows of C in `branch`), normalized where a norm stands after it, added to the stream
    auto add_branch = [&](const BranchNorms& around) {
        for (int64_t b = 0; around.after && b < B; b++) {
            normalize(branch.data() + b * C, C, norm, epsilon, around.after_weight, around.after_bias,
                      branch.data() + b * C);
        }
        add_scaled(stream, branch.data(), B * C, alpha);
    };

    at::Tensor qkv = at::empty({B, 1, Q}, x.options());
    multiply(qkv_weight, branch_input(attn_norms), B, qkv_bias, qkv.data_ptr<float>());
    const at::Tensor heads = cached_attention(qkv, k_cache, v_cache, slot, span, visible, scale, n_head, cos, sin,
                                              q_norm, k_norm, head_eps, window, slots);  // (B, 1, H D)
    TORCH_CHECK(heads.size(2) == HD, "gptlite block_step: the attention's out_proj takes ", HD, " inputs, its ",
                n_head, " heads give ", heads.size(2));
    multiply(attn_weight, heads.data_ptr<float>(), B, attn_bias, branch.data());
    add_branch(attn_norms);

    std::vector<float> hidden(B * FC);
    std::vector<float> activated(B * F);
    multiply(fc_weight, branch_input(ffn_norms), B, fc_bias, hidden.data());
    activate_all(activation, hidden.data(), B, F, activated.data());
    multiply(ffn_weight, activated.data(), B, ffn_bias, branch.data());
    add_branch(ffn_norms);
    return out;
}

// ---------------------------------------------------------------------------------------------
// Greedy decoding's pick

// The index of the first largest of x[0..V), a NaN counting as the largest (the first NaN's index, as torch.max's):
// one vectorized pass for the largest (and whether there is a NaN), then a scan for its first place. PyTorch's max
// with indices, which keeps an index beside every lane, reads a vocabulary's logits far slower than a plain
// reduction does.
int64_t first_largest(const float* x, int64_t V) {
    typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
    const float lowest = -std::numeric_limits<float>::infinity();
    Floats best = Floats{} + lowest;
    Ints unordered = {};
    int64_t v = 0;
    for (; v + kLanes <= V; v += kLanes) {
        const Floats e = load(x + v);
        unordered |= e != e;
        best = e > best ? e : best;
    }
    float largest = lowest;
    float lanes[kLanes];
    std::memcpy(lanes, &best, sizeof best);
    int32_t nan_lanes[kLanes];
    std::memcpy(nan_lanes, &unordered, sizeof unordered);
    bool nan = false;
    for (int i = 0; i < kLanes; i++) {
        largest = std::max(largest, lanes[i]);
        nan = nan || nan_lanes[i] != 0;
    }
    for (; v < V; v++) {
        largest = std::max(largest, x[v]);
        nan = nan || std::isnan(x[v]);
    }
    for (int64_t i = 0; i < V; i++) {
        if (nan ? std::isnan(x[i]) : x[i] == largest) {
            return i;
        }
    }
    return 0;  // V = 0 is refused before; every number -inf has its first at 0, which the scan found
}

// torch.ops.gptlite.argmax(logits): logits (B, V) float32 -> (B,) int64, each row's first largest.
at::Tensor argmax(const at::Tensor& logits) {
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat &&
                    logits.device().is_cpu(),
                "gptlite argmax: logits must be a (B, V > 0) float32 CPU tensor, not ", logits.sizes());
    const at::Tensor rows = logits.contiguous();
    const int64_t B = rows.size(0);
    const int64_t V = rows.size(1);
    at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
    int64_t* picks = out.data_ptr<int64_t>();
    const float* x = rows.data_ptr<float>();
    for (int64_t b = 0; b < B; b++) {
        picks[b] = first_largest(x + b * V, V);
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// The library's own constants

// torch.ops.gptlite.constants(): {"multiple": kMultiple, "tile": kTile, "block": kBlock}, read by
// gptlite.inference.cpu.native once the library is loaded, so that Python asks this build what widths and row counts
// it takes rather than copying them.
c10::Dict<std::string, int64_t> constants() {
    c10::Dict<std::string, int64_t> reported;
    reported.insert("multiple", kMultiple);
    reported.insert("tile", kTile);
    reported.insert("block", kBlock);
    return reported;
}

}  // namespace
}  // namespace gptlite

TORCH_LIBRARY(gptlite, m) {
    m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
    m.def(
        "cached_attention(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, int slot, int span, Tensor? visible, "
        "float scale, int n_head, Tensor? cos=None, Tensor? sin=None, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float head_eps=0.0, int window=0, Tensor? slots=None) -> Tensor");
    m.def(
        "block_step(Tensor x, Tensor?[] norms, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int slot, int span, Tensor? visible, float scale, int n_head, "
        "str norm, float eps, str activation, float residual_scale, Tensor? cos=None, Tensor? sin=None, "
        "Tensor? q_norm=None, Tensor? k_norm=None, float head_eps=0.0, str position=\"pre\", int window=0, "
        "Tensor? slots=None, int[] input_bits=[]) -> Tensor");
    m.def("int8_dot_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
    m.def("int4_dot_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
    m.def("argmax(Tensor logits) -> Tensor");
    m.def("constants() -> Dict(str, int)", &gptlite::constants);  // no tensor to dispatch on: one kernel for all
}

TORCH_LIBRARY_IMPL(gptlite, CPU, m) {
    m.impl("float_linear", &gptlite::float_linear);
    m.impl("int8_linear", &gptlite::int8_linear);
    m.impl("cached_attention", &gptlite::cached_attention);
    m.impl("block_step", &gptlite::block_step);
    m.impl("int8_dot_linear", &gptlite::int8_dot_linear);
    m.impl("int4_dot_linear", &gptlite::int4_dot_linear);
    m.impl("argmax", &gptlite::argmax);
}
