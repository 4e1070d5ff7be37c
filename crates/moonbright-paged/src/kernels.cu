// The paged pool's table kernel, compiled at run time with NVRTC (paged/device.rs). One launch
// applies one step's Delta (paged/delta.rs) to the fixed device tables; paged/reference.rs is its
// host reference and must stay in step with this file.
//
// A step is one launch (a launch costs the host microseconds; a step has little device work),
// with three kinds of block:
//   1. table writes (op_blocks blocks): block table entries (one, or a cleared range of a row),
//      sequence lengths, batch rows;
//   2. copy-on-write page copies (COPY_BLOCKS blocks per copy);
//   3. the slot mapping, which reads what the table writes wrote.
// Each target is written at most once per step, so kinds 1 and 2 need no order. Kind 3 waits
// until every kind-1 block has signalled. Blocks take their role from a ticket (an atomic
// counter), not from blockIdx: a block that waits got its ticket after every block it waits for
// got theirs, so those are running and the wait ends whatever order the hardware starts blocks
// in. The last block to finish zeroes the counters for the next launch (stream order makes that
// visible to it), so no host call resets them.

#define OP_BLOCK 0u
#define OP_LEN 1u
#define OP_BATCH 2u
#define OP_CLEAR 3u
#define COPY_BLOCKS 4u

// Must match `StepArgs` in paged/device.rs (pointers are 8 bytes on both sides).
struct StepArgs {
    const unsigned int* ops;        // n_ops x {kind, index, value}
    const unsigned int* copies;     // n_copies x {src page, dst page}
    const unsigned int* runs;       // n_runs x {row, first position, count, first slot index}
    int* block_table;               // [max_seqs, max_pages_per_seq]
    int* seq_lens;                  // [max_seqs]
    int* batch_rows;                // [max_seqs]
    unsigned char* pages;
    long long* slot_mapping;        // [max_step_tokens]
    unsigned int* sync;             // {tickets, table blocks done, blocks done}
    unsigned long long page_bytes;
    unsigned int n_ops, n_copies, n_runs, explicit_tokens;
    unsigned int decode_rows, max_pages_per_seq, tokens_per_page, op_blocks;
    unsigned int copy_blocks, pad;
};
static_assert(sizeof(StepArgs) == 120, "StepArgs layout");

__device__ __forceinline__ void mb_table_write(const StepArgs& a, unsigned int i)
{
    unsigned int kind = a.ops[3 * i];
    unsigned int index = a.ops[3 * i + 1];
    int value = (int)a.ops[3 * i + 2];
    if (kind == OP_BLOCK) a.block_table[index] = value;
    else if (kind == OP_LEN) a.seq_lens[index] = value;
    else if (kind == OP_BATCH) a.batch_rows[index] = value;
    else if (kind == OP_CLEAR)
        for (int k = 0; k < value; k++) a.block_table[(unsigned long long)index + k] = -1;
}

__device__ __forceinline__ void mb_page_copy(const StepArgs& a, unsigned int b)
{
    unsigned int c = b / COPY_BLOCKS;
    if (c >= a.n_copies) return;
    unsigned int part = b % COPY_BLOCKS;
    const unsigned char* src = a.pages + (unsigned long long)a.copies[2 * c] * a.page_bytes;
    unsigned char* dst = a.pages + (unsigned long long)a.copies[2 * c + 1] * a.page_bytes;
    unsigned long long stride = (unsigned long long)COPY_BLOCKS * blockDim.x;
    unsigned long long first = (unsigned long long)part * blockDim.x + threadIdx.x;
    if (a.page_bytes % 16 == 0 && ((unsigned long long)a.pages % 16) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned long long k = first; k < a.page_bytes / 16; k += stride) d[k] = s[k];
    } else {
        for (unsigned long long k = first; k < a.page_bytes; k += stride) dst[k] = src[k];
    }
}

// Tables written by other blocks of this launch are read through L2 (__ldcg), never through a
// possibly stale L1 or the read-only path.
__device__ __forceinline__ long long mb_slot(const StepArgs& a, unsigned int row, unsigned int pos)
{
    unsigned int t = a.tokens_per_page;
    unsigned int col = pos / t;
    if (col >= a.max_pages_per_seq || row == 0xffffffffu) return -1;  // DEAD_ROW: truncated later
    int page = __ldcg(&a.block_table[(unsigned long long)row * a.max_pages_per_seq + col]);
    if (page < 0) return -1;
    return (long long)page * t + (pos % t);
}

// Slot i: below explicit_tokens, the thread finds its run by binary search (runs are in slot
// order); the next decode_rows threads take one decode token for batch row j, at the row's
// length, and then grow that length by one.
__device__ __forceinline__ void mb_slot_write(const StepArgs& a, unsigned int i)
{
    if (i < a.explicit_tokens) {
        unsigned int lo = 0, hi = a.n_runs - 1;
        while (lo < hi) {
            unsigned int mid = (lo + hi + 1) / 2;
            if (a.runs[4 * mid + 3] <= i) lo = mid; else hi = mid - 1;
        }
        unsigned int row = a.runs[4 * lo];
        unsigned int pos = a.runs[4 * lo + 1] + (i - a.runs[4 * lo + 3]);
        a.slot_mapping[i] = mb_slot(a, row, pos);
        return;
    }
    unsigned int j = i - a.explicit_tokens;
    if (j >= a.decode_rows) return;
    unsigned int row = (unsigned int)__ldcg(&a.batch_rows[j]);
    int pos = __ldcg(&a.seq_lens[row]);
    a.slot_mapping[i] = mb_slot(a, row, (unsigned int)pos);
    a.seq_lens[row] = pos + 1;
}

extern "C" __global__ void mb_paged_step(const StepArgs a)
{
    __shared__ unsigned int role;
    if (threadIdx.x == 0) role = atomicAdd(&a.sync[0], 1u);
    __syncthreads();
    const unsigned int b = role;
    if (b < a.op_blocks) {
        unsigned int i = b * blockDim.x + threadIdx.x;
        if (i < a.n_ops) mb_table_write(a, i);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&a.sync[1], 1u);
        }
    } else if (b < a.op_blocks + a.copy_blocks) {
        mb_page_copy(a, b - a.op_blocks);
    } else {
        if (a.op_blocks > 0) {
            if (threadIdx.x == 0) {
                while (atomicAdd(&a.sync[1], 0u) < a.op_blocks) {
#if __CUDA_ARCH__ >= 700
                    __nanosleep(100);
#endif
                }
                __threadfence();
            }
            __syncthreads();
        }
        mb_slot_write(a, (b - a.op_blocks - a.copy_blocks) * blockDim.x + threadIdx.x);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&a.sync[2], 1u) == gridDim.x - 1) {
            a.sync[0] = 0u;
            a.sync[1] = 0u;
            a.sync[2] = 0u;
        }
    }
}
