// mpipar's CUDA kernels, compiled by mpipar/gpu/cuda.py (cupy.RawModule, RAW_KERNEL_NAMES), once per
// type: T the type stored, A the type computed in.
//
// The layers' kernels, each direction of a layer one kernel, and the optimizers' weight decay.
// Attention's causal softmax and LayerNorm run a block of threads per row: a row is read from memory
// once (the passes after the first find it in the cache), where NumPy's steps make a pass over all the
// rows for each operation (seven for the softmax). Float16 is computed in float32; float32 and float64
// in their own type, in NumPy's order of operations (only the sums' order differs).
//
// Run on the CPU by tests/test_kernels_on_the_cpu.py (g++), on the GPU by tests/scripts/check_gpu.py.

#include <cuda_fp16.h>

// The largest of `value` over the block's threads, or its sum; every thread gets the result.
// `shared` holds one value per warp (32 at most).
template <typename A, bool take_max>
__device__ A block_reduce(A value, A* shared) {
    for (int offset = 16; offset > 0; offset /= 2) {
        A other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? max(value, other) : value + other;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
    __syncthreads();  // `shared` may still be read from the previous reduction
    if (lane == 0) shared[warp] = value;
    __syncthreads();
    value = lane < warps ? shared[lane] : (take_max ? shared[0] : A(0));
    for (int offset = 16; offset > 0; offset /= 2) {
        A other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? max(value, other) : value + other;
    }
    return value;
}

// One block per row of scores (..., t, t): row r is query position q = r % t, which sees keys 0..q.
// p[u] = exp(s[u] scale - m) / sum, m the row's largest s[u] scale over u <= q; p[u] = 0 for u > q.
template <typename T, typename A>
__global__ void causal_softmax(T* scores, const int t, const A scale) {
    __shared__ A shared[32];
    T* row = scores + (long long)blockIdx.x * t;
    const int last = blockIdx.x % t;
    A largest = A(row[0]) * scale;  // key 0 is in every row
    for (int u = threadIdx.x; u <= last; u += blockDim.x) largest = max(largest, A(row[u]) * scale);
    largest = block_reduce<A, true>(largest, shared);
    A sum = 0;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) sum += exp(A(row[u]) * scale - largest);
    sum = block_reduce<A, false>(sum, shared);
    for (int u = threadIdx.x; u < t; u += blockDim.x)
        row[u] = T(u <= last ? exp(A(row[u]) * scale - largest) / sum : A(0));
}

// d_scores <- (p dp - p sum_u(p dp)) scale, row by row, from d_scores = dp.
template <typename T, typename A>
__global__ void causal_softmax_backward(T* d_scores, const T* probs, const int t, const A scale) {
    __shared__ A shared[32];
    T* d_row = d_scores + (long long)blockIdx.x * t;
    const T* p_row = probs + (long long)blockIdx.x * t;
    const int last = blockIdx.x % t;
    A sum = 0;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) sum += A(p_row[u]) * A(d_row[u]);
    sum = block_reduce<A, false>(sum, shared);
    for (int u = threadIdx.x; u < t; u += blockDim.x) {
        const A p = A(p_row[u]);
        d_row[u] = T((p * A(d_row[u]) - p * sum) * scale);
    }
}

// LayerNorm, one block per row of dim values: mean m = sum x / dim, r = 1 / sqrt(sum (x - m)^2 / dim + eps),
// normed = (x - m) r, y = normed gain + shift (from normed before it is stored, in A).
template <typename T, typename A>
__global__ void layer_norm(const T* x, const T* gain, const T* shift, const int dim, const A inv, const A eps,
                           T* y, T* normed, T* rstd) {
    __shared__ A shared[32];
    const long long first = (long long)blockIdx.x * dim;
    A sum = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += A(x[first + i]);
    const A mean = block_reduce<A, false>(sum, shared) * inv;
    A squares = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const A centred = A(x[first + i]) - mean;
        squares += centred * centred;
    }
    const A r = A(1) / sqrt(block_reduce<A, false>(squares, shared) * inv + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const A n = (A(x[first + i]) - mean) * r;
        normed[first + i] = T(n);
        y[first + i] = T(n * A(gain[i]) + A(shift[i]));
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = T(r);
}

// LayerNorm's input gradient, one block per row: g = dy gain, dx = (g - mean(g) - normed mean(g normed)) r.
template <typename T, typename A>
__global__ void layer_norm_input_gradient(const T* dy, const T* gain, const T* normed, const T* rstd, const int dim,
                                          const A inv, T* dx) {
    __shared__ A shared[32];
    const long long first = (long long)blockIdx.x * dim;
    A sum_g = 0, sum_gn = 0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const A g = A(dy[first + i]) * A(gain[i]);
        sum_g += g;
        sum_gn += g * A(normed[first + i]);
    }
    const A mean_g = block_reduce<A, false>(sum_g, shared) * inv;
    const A mean_gn = block_reduce<A, false>(sum_gn, shared) * inv;
    const A r = A(rstd[blockIdx.x]);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const A g = A(dy[first + i]) * A(gain[i]) - mean_g;
        dx[first + i] = T((g - A(normed[first + i]) * mean_gn) * r);
    }
}

// Elementwise kernels: every thread takes elements a grid apart.
#define FIRST_ELEMENT (blockIdx.x * (long long)blockDim.x + threadIdx.x)
#define ELEMENT_STRIDE ((long long)gridDim.x * blockDim.x)

// Softmax cross-entropy (layers/losses.py), one block per row of `classes` logits z: m the row's
// largest, s = z - m, log_norm = log(sum exp(s)), log_probs = s - log_norm, s, log_norm and log_probs
// rounded to T as NumPy's steps round them (the exps and their sum stay in A: float16 rows sum in
// float32, where NumPy rounds each to float16); the row's loss -log_probs[target] in A (float32 at
// least, as the loss is summed), recomputed by thread 0 from the values it rounds to, so no thread
// waits for another's write.
template <typename T, typename A>
__global__ void cross_entropy(const T* logits, const long long* targets, const int classes, T* log_probs,
                              A* losses) {
    __shared__ A shared[32];
    const long long first = (long long)blockIdx.x * classes;
    A largest = A(logits[first]);
    for (int c = threadIdx.x; c < classes; c += blockDim.x) largest = max(largest, A(logits[first + c]));
    largest = block_reduce<A, true>(largest, shared);
    A sum = 0;
    for (int c = threadIdx.x; c < classes; c += blockDim.x) sum += exp(A(T(A(logits[first + c]) - largest)));
    const A log_norm = A(T(log(block_reduce<A, false>(sum, shared))));
    for (int c = threadIdx.x; c < classes; c += blockDim.x)
        log_probs[first + c] = T(A(T(A(logits[first + c]) - largest)) - log_norm);
    if (threadIdx.x == 0)
        losses[blockIdx.x] = -A(T(A(T(A(logits[first + targets[blockIdx.x]]) - largest)) - log_norm));
}

// Its backward, elementwise: grad = (exp(log_probs) - onehot(target)) factor, rounded as NumPy's steps
// round (`factor` is handed already rounded to T).
template <typename T, typename A>
__global__ void cross_entropy_backward(const T* log_probs, const long long* targets, const int classes,
                                       const A factor, T* grad, const long long n) {
    for (long long i = FIRST_ELEMENT; i < n; i += ELEMENT_STRIDE) {
        const long long row = i / classes;
        A e = A(T(exp(A(log_probs[i]))));
        if (i - row * classes == targets[row]) e = A(T(e - A(1)));
        grad[i] = T(e * factor);
    }
}

// Weight decay inside a flat piece's decay spans, every span in one launch: `table` holds the
// spans' starts (`count` of them), then the running count of decayed elements at each span's end,
// so the i-th decayed element lies in the first span whose running count exceeds i (a binary
// search over a few dozen). Coupled: g = g + p c; else (AdamW's) p = p - p c; each operation
// rounded to T, as CuPy's elementwise arithmetic in T rounds (`c` is handed already rounded to T).
template <typename T, typename A>
__global__ void decay_in_spans(T* p, T* g, const long long* table, const int count, const A c, const int coupled,
                               const long long n) {
    const long long* ends = table + count;
    for (long long i = FIRST_ELEMENT; i < n; i += ELEMENT_STRIDE) {
        int low = 0, high = count - 1;
        while (low < high) {
            const int middle = (low + high) / 2;
            if (ends[middle] > i) high = middle; else low = middle + 1;
        }
        const long long at = table[low] + i - (low > 0 ? ends[low - 1] : 0);
        const A decay = A(T(A(p[at]) * c));
        if (coupled) g[at] = T(A(g[at]) + decay); else p[at] = T(A(p[at]) - decay);
    }
}

// GELU as layers/activations.py computes it, step for step: -2u = x x a - b, times x, clipped;
// y = x / (exp(-2u) + 1). The backward follows _gelu_grad's steps (d is its dx, t its temporary).
template <typename T, typename A>
__global__ void gelu(const T* x, T* y, const long long n, const A a, const A b, const A limit) {
    for (long long i = FIRST_ELEMENT; i < n; i += ELEMENT_STRIDE) {
        const A v = A(x[i]);
        A u = v * v; u = u * a; u = u - b; u = u * v; u = fmin(fmax(u, -limit), limit);
        y[i] = T(v / (exp(u) + A(1)));
    }
}

template <typename T, typename A>
__global__ void gelu_grad(const T* x, const T* dy, T* dx, const long long n, const A a, const A b, const A limit,
                          const A h, const A k) {
    for (long long i = FIRST_ELEMENT; i < n; i += ELEMENT_STRIDE) {
        const A v = A(x[i]);
        A t = v * v; t = t * a; t = t - b; t = t * v; t = fmin(fmax(t, -limit), limit); t = exp(t);
        A d = t + A(1); t = t / d; d = h / d; t = t * d; t = t * v; t = t * b; d = d + t;
        t = t * v; t = t * v; t = t * k; d = d + t; d = d * b;
        dx[i] = T(d * A(dy[i]));
    }
}

// Dropout (mpipar/kernels.py's `dropped`): element e of the sample at global position samples[s] keeps its value
// when u >= p, u the top 53 bits of SplitMix64(samples[s] whole + first + e + stream) over 2^53, all
// in wrapping uint64 arithmetic as NumPy's; mask = 1 / (1 - p) or 0, rounded once from double to T.
// stream is stream_key(seed, layer, step), with the step read from device memory: a CUDA graph's
// replay of the kernel then draws the coins of the step it replays.
__device__ unsigned long long splitmix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__device__ unsigned long long stream_key(unsigned long long seed, unsigned long long layer, unsigned long long step) {
    const unsigned long long golden = 0x9E3779B97F4A7C15ULL;
    unsigned long long stream = splitmix64(golden + seed);
    stream = splitmix64(stream + golden + layer);
    return splitmix64(stream + golden + step);
}

template <typename T> __device__ T from_double(double value) { return T(value); }
template <> __device__ __half from_double<__half>(double value) { return __double2half(value); }

template <typename T, typename A>
__global__ void dropout(const T* x, T* y, T* mask, const unsigned long long* samples, const long long per_sample,
                        const unsigned long long whole, const unsigned long long first,
                        const unsigned long long seed, const unsigned long long layer,
                        const unsigned long long* step, const double p, const double scale, const long long n) {
    const unsigned long long stream = stream_key(seed, layer, step[0]);
    for (long long i = FIRST_ELEMENT; i < n; i += ELEMENT_STRIDE) {
        const long long sample = i / per_sample;
        const unsigned long long element = first + (unsigned long long)(i - sample * per_sample);
        const unsigned long long z = splitmix64(samples[sample] * whole + element + stream);
        const T kept = from_double<T>((double)(z >> 11) * (1.0 / 9007199254740992.0) >= p ? scale : 0.0);
        mask[i] = kept;
        y[i] = T(A(x[i]) * A(kept));  // exact in A, then rounded once: NumPy's x * mask
    }
}
