// The paged pool's table kernels, compiled at run time with NVRTC (paged/device.rs). They apply
// one step's Delta (paged/delta.rs) to the fixed device tables; paged/reference.rs is their host
// reference and must stay in step with this file.

#define OP_BLOCK 0u
#define OP_LEN 1u
#define OP_BATCH 2u
#define COPY_BLOCKS 4u

// Step 1: table writes (blocks 0 .. op_blocks) and copy-on-write page copies (the blocks after,
// COPY_BLOCKS per copy). Each target is written at most once per step, so order is free.
extern "C" __global__ void mb_paged_apply(
    const unsigned int* __restrict__ ops, unsigned int n_ops,
    const unsigned int* __restrict__ copies, unsigned int n_copies,
    int* block_table, int* seq_lens, int* batch_rows,
    unsigned char* pages, unsigned long long page_bytes, unsigned int op_blocks)
{
    if (blockIdx.x < op_blocks) {
        unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i >= n_ops) return;
        unsigned int kind = ops[3 * i];
        unsigned int index = ops[3 * i + 1];
        int value = (int)ops[3 * i + 2];
        if (kind == OP_BLOCK) block_table[index] = value;
        else if (kind == OP_LEN) seq_lens[index] = value;
        else if (kind == OP_BATCH) batch_rows[index] = value;
        return;
    }
    unsigned int b = blockIdx.x - op_blocks;
    unsigned int c = b / COPY_BLOCKS;
    if (c >= n_copies) return;
    unsigned int part = b % COPY_BLOCKS;
    const unsigned char* src = pages + (unsigned long long)copies[2 * c] * page_bytes;
    unsigned char* dst = pages + (unsigned long long)copies[2 * c + 1] * page_bytes;
    unsigned long long stride = (unsigned long long)COPY_BLOCKS * blockDim.x;
    unsigned long long first = (unsigned long long)part * blockDim.x + threadIdx.x;
    if (page_bytes % 16 == 0 && ((unsigned long long)pages % 16) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (unsigned long long k = first; k < page_bytes / 16; k += stride) d[k] = s[k];
    } else {
        for (unsigned long long k = first; k < page_bytes; k += stride) dst[k] = src[k];
    }
}

__device__ __forceinline__ long long mb_slot(const int* block_table, unsigned int m,
                                             unsigned int t, unsigned int row, unsigned int pos)
{
    unsigned int col = pos / t;
    if (col >= m || row == 0xffffffffu) return -1;  // DEAD_ROW: truncated later in the step
    int page = block_table[(unsigned long long)row * m + col];
    if (page < 0) return -1;
    return (long long)page * t + (pos % t);
}

// Step 2: the slot mapping. Threads below explicit_tokens find their run by binary search (runs
// are in slot order); the next decode_rows threads take one decode token for batch row j, at
// the row's length, and then grow that length by one.
extern "C" __global__ void mb_paged_slots(
    const unsigned int* __restrict__ runs, unsigned int n_runs,
    unsigned int explicit_tokens, unsigned int decode_rows,
    const int* __restrict__ block_table, unsigned int max_pages_per_seq,
    unsigned int tokens_per_page, int* seq_lens, const int* __restrict__ batch_rows,
    long long* slot_mapping)
{
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < explicit_tokens) {
        unsigned int lo = 0, hi = n_runs - 1;
        while (lo < hi) {
            unsigned int mid = (lo + hi + 1) / 2;
            if (runs[4 * mid + 3] <= i) lo = mid; else hi = mid - 1;
        }
        unsigned int row = runs[4 * lo];
        unsigned int pos = runs[4 * lo + 1] + (i - runs[4 * lo + 3]);
        slot_mapping[i] = mb_slot(block_table, max_pages_per_seq, tokens_per_page, row, pos);
        return;
    }
    unsigned int j = i - explicit_tokens;
    if (j >= decode_rows) return;
    unsigned int row = (unsigned int)batch_rows[j];
    int pos = seq_lens[row];
    slot_mapping[i] = mb_slot(block_table, max_pages_per_seq, tokens_per_page, row, (unsigned int)pos);
    seq_lens[row] = pos + 1;
}
