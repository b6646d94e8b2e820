"""The anti-aliased activation as a CUDA C++ kernel compiled at run time with NVRTC: the decoder's fastest form.

It computes what the Triton kernel (``triton_activation``, whose docstring states the sums) computes, in the
same order with the same roundings, so the two give the same bits (``tests/test_gpu.py``). What differs is how a
block shares its data. The Triton kernel reads the upsampler's and the decimator's shifted windows with one global
load per tap and sample, through a scratch row in the caches: most of its instructions are loads and their
address arithmetic, so it runs far below the memory bandwidth. Triton has no shifted view of a tensor in
registers or shared memory (Gluon's shared-memory slices must be aligned to their length), so this kernel is
written in CUDA C++. A block of ``THREADS`` threads takes ``OUT`` outputs of one row:

1. the window of ``x`` those outputs read, ``OUT + 12`` samples clamped into the row (the upsampler's replicate
   padding), into shared memory with coalesced loads;
2. each thread ``PER_THREAD`` consecutive oversampled positions of both phases, from a register window of the
   input read with vector loads; the sines are libdevice's without its branches (``sin_reduced``);
3. where the block reaches past a row's end, the decimator's replicate padding (the first or last oversampled
   sample) in place of the positions outside the row;
4. each thread ``PER_THREAD`` consecutive outputs from register windows of both phases, staged through shared
   memory so that the stores are coalesced.

It is the faster of the two (bench/RESULTS.md), except with fewer blocks than the GPU has multiprocessors, where
the Triton kernel's smaller blocks are faster: it runs those calls.

The kernel is built with ``torch.cuda._compile_kernel`` (torch's NVRTC wrapper, a private function) once per
device and decimator padding. Where that function is missing or NVRTC fails (``available``), the Triton kernel
runs instead; an input this kernel does not take (not fp32, more rows than a grid's second axis holds) goes to
the Triton kernel too.
"""

from __future__ import annotations

import logging

import torch

from auk_worker.model.vae.alias_free import RATIO, SNAKE_EPS, TAPS
from auk_worker.model.vae.kernels import triton_activation

log = logging.getLogger(__name__)

THREADS = 128  # threads a block
PER_THREAD = 8  # consecutive outputs (and oversampled positions of each phase) a thread computes
OUT = THREADS * PER_THREAD  # outputs a block
MAX_ROWS = 65_535  # rows run on the grid's second axis
INT32_MAX = 2**31 - 1  # sizes and strides go to the kernel as int

# Compiled with THREADS, PER (= PER_THREAD), LEFT (the decimator's left padding, odd) and EPS defined in front.
# Positions: output i reads oversampled sample m = 2i + k - LEFT at tap k, i.e. phase p = (k + LEFT) % 2 at input
# position j = i + d with d = (k + 12 - LEFT) / 2 - 6, d in LOW ... LOW + 6. Slot q of the block's shared rows is
# position j0 + q, j0 = first + LOW; the x slot q holds x[j0 - 3 + q].
SOURCE = r"""
#define OUT (THREADS * PER)
#define LOW ((12 - LEFT) / 2 - 6)
#define NPOS (OUT + 6)   // oversampled positions a block needs, each phase
#define NX (NPOS + 6)    // x samples they read
#define WIN (PER + 8)    // a thread's register window, a multiple of 4
#define SIN_FAST_LIMIT 105615.0f

// Triton's exp and division on fp32, so that alpha and 1 / (beta + eps) round as in the Triton kernel.
__device__ __forceinline__ float ex2_approx(float x) {
    float r;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float div_full(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// libdevice's sinf for |x| < SIN_FAST_LIMIT without its branches: the same reduction by pi/2 in three fmas and the
// same two polynomials, so the same bits. Callers redo larger and non-finite arguments with sinf.
__device__ __forceinline__ float sin_reduced(float x) {
    const float qf = rintf(x * 0.636619772f);
    const int q = (int)qf;
    float r = fmaf(qf, -1.57079625f, x);
    r = fmaf(qf, -7.54978942e-08f, r);
    r = fmaf(qf, -5.39030253e-15f, r);
    const bool even = (q & 1) == 0;  // sine polynomial, else cosine
    const float base = even ? r : 1.0f;
    const float r2 = r * r;
    float c = even ? __int_as_float(0xB94D4153) : fmaf(__int_as_float(0x37CBAC00), r2, __int_as_float(0xBAB607ED));
    c = fmaf(c, r2, even ? __int_as_float(0x3C0885E4) : __int_as_float(0x3D2AAABB));
    c = fmaf(c, r2, even ? __int_as_float(0xBE2AAAA8) : __int_as_float(0xBEFFFFFF));
    float s = fmaf(c, fmaf(r2, base, 0.0f), base);
    if (q & 2) s = fmaf(s, -1.0f, 0.0f);
    return s;
}

__device__ __forceinline__ float snake(float u, float inv_beta, float sine) {  // sine = sin(alpha * u)
    return u + inv_beta * (sine * sine);
}

template <int N>  // N consecutive floats from 16-byte aligned shared memory
__device__ __forceinline__ void load_window(const float* p, float* w) {
    const float4* v = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
        const float4 f = v[k];
        w[4 * k] = f.x; w[4 * k + 1] = f.y; w[4 * k + 2] = f.z; w[4 * k + 3] = f.w;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) alias_free_activation(
    const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ alpha_p,
    const float* __restrict__ beta_p, const float* __restrict__ up, const float* __restrict__ down,
    int t, int channels, int x_batch_stride, int x_channel_stride, int y_pad, int logscale)
{
    __shared__ __align__(16) float xs[OUT + 32];  // the x window; at the end the outputs, staged for the stores
    __shared__ __align__(16) float s0[OUT + 32];  // oversampled phase 0 (even samples)
    __shared__ __align__(16) float s1[OUT + 32];  // phase 1
    __shared__ float edge[2];
    const int tid = threadIdx.x;
    const int row = blockIdx.y;  // b * channels + c
    const int channel = row % channels;
    const int first = blockIdx.x * OUT;
    const int last = t - 1;
    const int j0 = first + LOW;
    const float* x_row = x + (long long)(row / channels) * x_batch_stride + (long long)channel * x_channel_stride;
    float* y_row = y + (long long)row * (y_pad + t);  // y_pad zeros, then the t outputs
    if (blockIdx.x == 0) {
        for (int q = tid; q < y_pad; q += THREADS) y_row[q] = 0.0f;
    }
    float alpha = alpha_p[channel], beta = beta_p[channel];
    if (logscale) {
        alpha = ex2_approx(alpha * 1.44269502f);
        beta = ex2_approx(beta * 1.44269502f);
    }
    const float inv_beta = div_full(1.0f, beta + EPS);
    float up_taps[2][6];  // phase p, term r: up[2r + 1 - p]
#pragma unroll
    for (int r = 0; r < 6; ++r) { up_taps[0][r] = up[2 * r + 1]; up_taps[1][r] = up[2 * r]; }

    for (int q = tid; q < NX; q += THREADS) xs[q] = x_row[min(max(j0 - 3 + q, 0), last)];
    __syncthreads();

    // s_p(j0 + q) = snake(2 * sum_r up_taps[p][r] * x[j0 + q + 2 + p - r]), x slot q + 5 + p - r
#pragma unroll 1
    for (int q0 = tid * PER; q0 < NPOS; q0 += OUT) {
        float w[WIN];
        load_window<WIN>(xs + q0, w);
        float u[2 * PER], arg[2 * PER], v[2 * PER];
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            float a = 0.0f, b = 0.0f;
#pragma unroll
            for (int r = 0; r < 6; ++r) {
                a += up_taps[0][r] * w[e + 5 - r];
                b += up_taps[1][r] * w[e + 6 - r];
            }
            u[e] = 2.0f * a;
            u[PER + e] = 2.0f * b;
        }
        bool large = false;
#pragma unroll
        for (int e = 0; e < 2 * PER; ++e) {
            arg[e] = u[e] * alpha;
            large |= !(fabsf(arg[e]) < SIN_FAST_LIMIT);
            v[e] = snake(u[e], inv_beta, sin_reduced(arg[e]));
        }
        if (large) {
#pragma unroll
            for (int e = 0; e < 2 * PER; ++e) v[e] = snake(u[e], inv_beta, sinf(arg[e]));
        }
#pragma unroll
        for (int e = 0; e < PER; e += 4) {
            reinterpret_cast<float4*>(s0)[(q0 + e) / 4] = make_float4(v[e], v[e + 1], v[e + 2], v[e + 3]);
            reinterpret_cast<float4*>(s1)[(q0 + e) / 4] =
                make_float4(v[PER + e], v[PER + e + 1], v[PER + e + 2], v[PER + e + 3]);
        }
    }
    __syncthreads();

    if (j0 < 0 || j0 + NPOS - 1 > last) {
        // The decimator's replicate padding: before the row the first oversampled sample (phase 0 at j = 0),
        // after it the last (phase 1 at j = t - 1), each from clamped reads as in the row.
        if (tid < 2) {
            const int j = tid == 0 ? 0 : last;
            float a = 0.0f;
#pragma unroll
            for (int r = 0; r < 6; ++r) {
                const float tap = tid == 0 ? up_taps[0][r] : up_taps[1][r];
                a += tap * x_row[min(max(j + 2 + tid - r, 0), last)];
            }
            const float u = 2.0f * a;
            edge[tid] = snake(u, inv_beta, sinf(u * alpha));
        }
        __syncthreads();
        for (int q = tid; q < NPOS; q += THREADS) {
            const int j = j0 + q;
            if (j < 0) { s0[q] = edge[0]; s1[q] = edge[0]; }
            else if (j > last) { s0[q] = edge[1]; s1[q] = edge[1]; }
        }
        __syncthreads();
    }

    // y[i] = sum_k down[k] * s_p(i + d), slot i - first + d - LOW, in tap order
    float down_taps[12];
#pragma unroll
    for (int k = 0; k < 12; ++k) down_taps[k] = down[k];
    const int q0 = tid * PER;
    float a[WIN], b[WIN];
    load_window<WIN>(s0 + q0, a);
    load_window<WIN>(s1 + q0, b);
    float o[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 12; ++k) {
            const int d = (k + 12 - LEFT) / 2 - 6;
            acc += down_taps[k] * ((k + LEFT) % 2 == 0 ? a[e + d - LOW] : b[e + d - LOW]);
        }
        o[e] = acc;
    }
#pragma unroll
    for (int e = 0; e < PER; e += 4)  // every read of xs came before the last barrier
        reinterpret_cast<float4*>(xs)[(q0 + e) / 4] = make_float4(o[e], o[e + 1], o[e + 2], o[e + 3]);
    __syncthreads();
    float* y_out = y_row + y_pad + first;
    const int n = min(OUT, t - first);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int q = tid + k * THREADS;
        if (q < n) y_out[q] = xs[q];
    }
}
"""

_kernels: dict[tuple[int, int], object] = {}  # (device index, decimator's left pad) -> compiled kernel


def available(device: torch.device) -> bool:
    """True where the kernel can be built: a CUDA device, with torch's NVRTC wrapper (checked by compiling)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    try:
        _kernel(device, TAPS - 1)  # the causal decimator's padding, the release decoder's
    except Exception as exc:  # noqa: BLE001 - NVRTC missing or failing: the Triton kernel runs instead
        log.warning("the CUDA activation kernel does not build on %s (%s); the Triton kernel runs", device, exc)
        return False
    return True


def _kernel(device: torch.device, left: int):
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, left)
    if key not in _kernels:
        defines = {"THREADS": THREADS, "PER": PER_THREAD, "LEFT": left, "EPS": f"{SNAKE_EPS!r}f"}
        source = "".join(f"#define {name} {value}\n" for name, value in defines.items()) + SOURCE
        with torch.cuda.device(index):  # the module is loaded into this device's context
            _kernels[key] = torch.cuda._compile_kernel(source, "alias_free_activation")
    return _kernels[key]


def fused_activation(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_taps: torch.Tensor,
    down_taps: torch.Tensor,
    logscale: bool,
    down_pad: tuple[int, int],
    left_pad: int = 0,
    *,
    min_blocks: int | None = None,
) -> torch.Tensor:  # [b, c, t] -> [b, c, left_pad + t]
    """``alias_free.polyphase_activation`` as one launch of this kernel (a ``PolyphaseFn``), or of the Triton
    kernel for a call this one does not take or that has fewer than ``min_blocks`` blocks (default: the device's
    multiprocessor count)."""
    b, c, t = x.shape
    blocks = -(-t // OUT) * b * c
    suits = (
        x.is_cuda and x.dtype == torch.float32
        and RATIO == 2 and TAPS == 12 and sum(down_pad) == TAPS - 1 and down_pad[0] % 2 == 1
        and 0 < t and 0 < b * c <= MAX_ROWS and left_pad >= 0
        and max(x.stride(0), x.stride(1), (left_pad + t) * b * c) <= INT32_MAX
    )
    if suits:
        if min_blocks is None:
            min_blocks = torch.cuda.get_device_properties(x.device).multi_processor_count
        suits = blocks >= min_blocks
    if not suits:
        return triton_activation.fused_activation(x, alpha, beta, up_taps, down_taps, logscale, down_pad, left_pad)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = x.new_empty((b, c, left_pad + t))
    kernel = _kernel(x.device, down_pad[0])
    kernel(
        grid=(-(-t // OUT), b * c, 1),
        block=(THREADS, 1, 1),
        args=[x, y, alpha.float().contiguous(), beta.float().contiguous(), up_taps.float().reshape(-1).contiguous(),
              down_taps.float().reshape(-1).contiguous(), t, c, x.stride(0), x.stride(1), left_pad, int(logscale)],
    )
    return y
