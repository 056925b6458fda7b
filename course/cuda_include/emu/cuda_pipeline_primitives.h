// The CPU emulator's asynchronous copies into shared memory (CUDA's cuda_pipeline_primitives.h; on a GPU
// of compute capability 8.0 or later, cp.async):
//
//   __pipeline_memcpy_async(dst, src, size, zfill = 0)  copy size (4, 8 or 16) bytes from global src to
//                                                        shared dst, the last zfill of them as zeros
//   __pipeline_commit()                                  close the thread's current batch of copies
//   __pipeline_wait_prior(n)                             wait until at most the n latest batches are pending
//
// As on a GPU, a copy is the issuing thread's own: its bytes are certain to be in shared memory only
// when that thread has waited for its batch, and other threads may read them only after a barrier that
// follows the wait. Here the copy reads global memory when issued and writes shared memory when its
// thread waits; its write is race-checked both when issued (a GPU may write at any moment in between:
// overwriting a tile other threads still read is a race) and when it lands, reported at the line that
// issued it. A copy nobody waits for never lands: a read of its destination finds the emulator's NaN
// fill, so a missing wait shows as wrong values.
#pragma once

namespace mt {
struct AsyncCopy {
    char* dst;
    unsigned char bytes[16];
    int size, batch, line;
    const char* file;
};
struct AsyncQueue {
    unsigned long long block = 0;
    int committed = 0, pending = 0;
    AsyncCopy copies[64];  // in flight per thread (a pipeline of a few stages issues a handful per stage)
};
MT_NOSAN static inline AsyncQueue& async_queue(int line, const char* file) {
    static AsyncQueue queues[1024];
    const long long t = threadIdx.x + (long long)blockDim.x * (threadIdx.y + (long long)blockDim.y * threadIdx.z);
    const unsigned long long b = block_serial();
    if (t < 0 || t >= 1024) kernel_trap("__pipeline_*: a block of more than 1024 threads", line, file);
    AsyncQueue& q = queues[t];
    if (q.block != b) q.block = b, q.committed = 0, q.pending = 0;  // a new block: this slot's thread starts afresh
    return q;
}
MT_NOSAN static inline void async_land(AsyncQueue& q, int keep) {
    int kept = 0;
    for (int i = 0; i < q.pending; ++i) {
        AsyncCopy& c = q.copies[i];
        if (c.batch < q.committed - keep) {
            async_access(c.dst, c.size, c.size, 1, c.line, c.file);
            volatile unsigned char* d = (volatile unsigned char*)c.dst;
            for (int k = 0; k < c.size; ++k) d[k] = c.bytes[k];
        } else {
            q.copies[kept++] = c;
        }
    }
    q.pending = kept;
}
}  // namespace mt

MT_NOSAN static inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size, size_t zfill = 0, MT_SITE) {
    if (size != 4 && size != 8 && size != 16)
        mt::kernel_trap("__pipeline_memcpy_async with a size other than 4, 8 or 16 bytes", MT_SITE_ARGS);
    if (zfill > size) mt::kernel_trap("__pipeline_memcpy_async with zfill larger than size", MT_SITE_ARGS);
    mt::AsyncQueue& q = mt::async_queue(MT_SITE_ARGS);
    if (q.pending == 64) mt::kernel_trap("__pipeline_memcpy_async: more than 64 copies in flight in one thread", MT_SITE_ARGS);
    // The copy may write its destination at any moment until its thread waits for it: the write is checked
    // (bounds, and races with the reads of other threads) when issued, and again when it lands.
    mt::async_access(dst, (int)size, (unsigned)size, 1, MT_SITE_ARGS);
    mt::async_access(src, (int)(size - zfill), (unsigned)size, 0, MT_SITE_ARGS);
    mt::AsyncCopy& c = q.copies[q.pending++];
    c.dst = (char*)dst, c.size = (int)size, c.batch = q.committed, c.line = mt_line, c.file = mt_file;
    const volatile unsigned char* s = (const volatile unsigned char*)src;
    for (int k = 0; k < (int)size; ++k) c.bytes[k] = k < (int)(size - zfill) ? s[k] : 0;
}
MT_NOSAN static inline void __pipeline_commit(MT_SITE) { ++mt::async_queue(MT_SITE_ARGS).committed; }
MT_NOSAN static inline void __pipeline_wait_prior(size_t prior, MT_SITE) {
    mt::async_land(mt::async_queue(MT_SITE_ARGS), (int)prior);
}
