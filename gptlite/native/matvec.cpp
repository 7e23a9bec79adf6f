// gptlite's CPU decode kernels: a linear layer's product for a few rows of float32 activations, on a float32 or an
// int8 weight, streaming each weight from memory once. Built by gptlite/native/__init__.py for the CPU at hand
// (-march=native) and registered as torch operators:
//
//   torch.ops.gptlite.float_linear(x, weight, bias)        x (..., K) float32, weight (N, K) float32 -> (..., N)
//   torch.ops.gptlite.int8_linear(x, weight, scale, bias)  weight (N, K) int8, scale (N,) float32     -> (..., N)
//
//   y[m, n] = scale[n] * sum_k x[m, k] * weight[n, k] + bias[n]    (scale 1 for float32 weights)
//
// Why: decoding one token multiplies one row by every weight of the model, so it is bound by reading the weights
// from memory. PyTorch's int8 kernel (_weight_int8pack_mm) is compute-bound at one row; its float32 kernels read
// a layer's weight as several interleaved streams. Here each thread reads its contiguous share of the weight's rows
// once; at one activation row it cuts that share into kStreams parts and walks them side by side, so that a core
// has several sequential streams on their way from memory at once (a core's bandwidth is bound by how many lines
// it has in flight, not by the memory's). It asks for the bytes a page ahead of the ones it multiplies (a software
// prefetch: the hardware prefetchers stop at page boundaries), converts int8 to float32 in registers and multiplies
// in float32 (no rounding of activations to bfloat16). The vectors are GCC's vector
// extensions: -march=native lowers them to AVX-512, AVX2 or NEON, whatever the CPU has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
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

inline float total(Floats v) {
    float s = 0.0f;
    for (int i = 0; i < kLanes; i++) {
        s += v[i];
    }
    return s;
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
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == weight.size(0) && scale.is_contiguous() &&
                    scale.scalar_type() == at::kFloat,
                "gptlite int8_linear: scale must be a contiguous (N,) float32 tensor");
    const at::Tensor rows = x.contiguous();
    const int64_t N = weight.size(0);
    const int64_t K = weight.size(1);
    at::Tensor y = output_for(x, N);
    linear<int8_t>(rows.data_ptr<float>(), rows.numel() / K, weight.data_ptr<int8_t>(), N, K,
                   scale.data_ptr<float>(), bias_data(bias), y.data_ptr<float>());
    return y;
}

}  // namespace
}  // namespace gptlite

TORCH_LIBRARY(gptlite, m) {
    m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(gptlite, CPU, m) {
    m.impl("float_linear", &gptlite::float_linear);
    m.impl("int8_linear", &gptlite::int8_linear);
}
