// The CPU emulator's cooperative groups: thread_block, tiled_partition<N> (N a power of 2, <= 32),
// coalesced_threads(), their sync / shfl / vote methods, and cg::reduce with cg::plus, less,
// greater, bit_and, bit_or, bit_xor (cooperative_groups/reduce.h). Built on the emulator's
// __syncthreads and warp primitives, so the race check and the deadlock reports apply.
// Grid-wide groups (this_grid, cooperative launches) are not supported on the CPU emulator.
#pragma once
#include <type_traits>

namespace cooperative_groups {
namespace details {
static inline unsigned block_rank() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
static inline unsigned block_size() { return blockDim.x * blockDim.y * blockDim.z; }
}  // namespace details

class thread_block {
  public:
    void sync(MT_SITE) const { __syncthreads(MT_SITE_ARGS); }
    unsigned long long thread_rank() const { return details::block_rank(); }
    unsigned long long size() const { return details::block_size(); }
    unsigned long long num_threads() const { return details::block_size(); }
    dim3 group_index() const { return dim3(blockIdx); }
    dim3 thread_index() const { return dim3(threadIdx); }
    dim3 group_dim() const { return blockDim; }
    dim3 dim_threads() const { return blockDim; }
};
static inline thread_block this_thread_block() { return thread_block(); }

template <unsigned N> class tile_base {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "tiled_partition<N>: N must be a power of 2, at most 32");

  protected:
    unsigned base_() const { return details::block_rank() % 32 / N * N; }

  public:
    unsigned mask() const { return N == 32 ? 0xffffffffu : (((1u << N) - 1) << base_()); }
    void sync(MT_SITE) const { __syncwarp(mask(), MT_SITE_ARGS); }
    unsigned long long thread_rank() const { return details::block_rank() % N; }
    unsigned long long size() const { return N; }
    unsigned long long num_threads() const { return N; }
    unsigned long long meta_group_rank() const { return details::block_rank() / N; }
    unsigned long long meta_group_size() const { return (details::block_size() + N - 1) / N; }
    template <class T> T shfl(T v, int src, MT_SITE) const { return __shfl_sync(mask(), v, src, N, MT_SITE_ARGS); }
    template <class T> T shfl_down(T v, unsigned d, MT_SITE) const { return __shfl_down_sync(mask(), v, d, N, MT_SITE_ARGS); }
    template <class T> T shfl_up(T v, unsigned d, MT_SITE) const { return __shfl_up_sync(mask(), v, d, N, MT_SITE_ARGS); }
    template <class T> T shfl_xor(T v, unsigned m, MT_SITE) const { return __shfl_xor_sync(mask(), v, m, N, MT_SITE_ARGS); }
    int any(int p, MT_SITE) const { return __any_sync(mask(), p, MT_SITE_ARGS); }
    int all(int p, MT_SITE) const { return __all_sync(mask(), p, MT_SITE_ARGS); }
    unsigned ballot(int p, MT_SITE) const { return __ballot_sync(mask(), p, MT_SITE_ARGS) >> base_(); }
    template <class T> unsigned match_any(T v, MT_SITE) const { return __match_any_sync(mask(), v, MT_SITE_ARGS) >> base_(); }
};

template <unsigned N, class Parent = void> class thread_block_tile : public tile_base<N> {
  public:
    thread_block_tile() = default;
    template <class Q> thread_block_tile(const thread_block_tile<N, Q>&) {}
};

template <unsigned N, class P> static inline thread_block_tile<N, P> tiled_partition(const P&) { return thread_block_tile<N, P>(); }

class coalesced_group {
    unsigned mask_;

  public:
    explicit coalesced_group(unsigned m) : mask_(m) {}
    void sync(MT_SITE) const { __syncwarp(mask_, MT_SITE_ARGS); }
    unsigned long long size() const { return __popc(mask_); }
    unsigned long long num_threads() const { return __popc(mask_); }
    unsigned long long thread_rank() const { return __popc(mask_ & ((1u << (details::block_rank() % 32)) - 1)); }
    unsigned lane_of(unsigned rank) const {
        unsigned m = mask_;
        for (unsigned i = 0; i < rank && m; ++i) m &= m - 1;
        return m ? __ffs(m) - 1 : 32;
    }
    template <class T> T shfl(T v, int rank, MT_SITE) const { return __shfl_sync(mask_, v, lane_of(rank), 32, MT_SITE_ARGS); }
    int any(int p, MT_SITE) const { return __any_sync(mask_, p, MT_SITE_ARGS); }
    int all(int p, MT_SITE) const { return __all_sync(mask_, p, MT_SITE_ARGS); }
    unsigned ballot(int p, MT_SITE) const {
        unsigned b = __ballot_sync(mask_, p, MT_SITE_ARGS), r = 0, k = 0;
        for (unsigned m = mask_; m; m &= m - 1, ++k)
            if (b & (m & -m)) r |= 1u << k;
        return r;
    }
};
static inline coalesced_group coalesced_threads(MT_SITE) { return coalesced_group(__activemask(MT_SITE_ARGS)); }

template <class G> static inline void sync(const G& g, MT_SITE) { g.sync(MT_SITE_ARGS); }

template <class T> struct plus { T operator()(const T& a, const T& b) const { return a + b; } };
template <class T> struct less { T operator()(const T& a, const T& b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(const T& a, const T& b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(const T& a, const T& b) const { return a & b; } };
template <class T> struct bit_or { T operator()(const T& a, const T& b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(const T& a, const T& b) const { return a ^ b; } };

// reduce over a tile: every thread gets the result (a butterfly of shfl_xor).
template <unsigned N, class P, class T, class Op>
static inline T reduce(const thread_block_tile<N, P>& g, T v, Op op, MT_SITE) {
    for (unsigned o = N / 2; o > 0; o /= 2) v = op(v, g.shfl_xor(v, o, MT_SITE_ARGS));
    return v;
}
// inclusive / exclusive scans over a tile (cooperative_groups/scan.h)
template <unsigned N, class P, class T, class Op>
static inline T inclusive_scan(const thread_block_tile<N, P>& g, T v, Op op, MT_SITE) {
    for (unsigned d = 1; d < N; d *= 2) {
        T u = g.shfl_up(v, d, MT_SITE_ARGS);
        if (g.thread_rank() >= d) v = op(v, u);
    }
    return v;
}
template <unsigned N, class P, class T> static inline T inclusive_scan(const thread_block_tile<N, P>& g, T v, MT_SITE) {
    return inclusive_scan(g, v, plus<T>(), MT_SITE_ARGS);
}
template <unsigned N, class P, class T, class Op>
static inline T exclusive_scan(const thread_block_tile<N, P>& g, T v, Op op, MT_SITE) {
    T inc = inclusive_scan(g, v, op, MT_SITE_ARGS);
    T prev = g.shfl_up(inc, 1, MT_SITE_ARGS);
    return g.thread_rank() == 0 ? T() : prev;
}
template <unsigned N, class P, class T> static inline T exclusive_scan(const thread_block_tile<N, P>& g, T v, MT_SITE) {
    return exclusive_scan(g, v, plus<T>(), MT_SITE_ARGS);
}
}  // namespace cooperative_groups
