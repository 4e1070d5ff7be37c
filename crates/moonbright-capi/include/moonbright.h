/*
 * moonbright.h: the C API of MoonBright, a GPU memory allocator on the CUDA virtual-memory API.
 *
 * Generated from crates/moonbright-capi/src/ by cbindgen; do not edit by hand.
 */

#ifndef MOONBRIGHT_H
#define MOONBRIGHT_H

#include <stdint.h>
#include <stddef.h>

/**
 * Success.
 */
#define MB_OK 0

/**
 * A NULL pointer argument, a size of 0, or a bad option value (the last error names it).
 */
#define MB_ERR_INVALID_ARGUMENT 1

/**
 * Not enough free memory under the cap (or no virtual address space left); freeing memory or a
 * larger cap may help.
 */
#define MB_ERR_OUT_OF_MEMORY 2

/**
 * A request larger than the cap: it can never succeed with this allocator.
 */
#define MB_ERR_TOO_LARGE 3

/**
 * A free of a pointer this allocator did not return, of one freed already, or of an address
 * inside an allocation.
 */
#define MB_ERR_INVALID_POINTER 4

/**
 * A driver call failed; the allocator's state is as it was before the request.
 */
#define MB_ERR_DRIVER 5

/**
 * No backend could be opened (no CUDA driver or device, say).
 */
#define MB_ERR_NO_BACKEND 6

/**
 * A bug in MoonBright (a caught panic); the last error says where.
 */
#define MB_ERR_INTERNAL 7

/**
 * A stream-ordered request on a stream being captured into a CUDA graph (refused).
 */
#define MB_ERR_STREAM_CAPTURE 8

/**
 * The paged KV pool (`mb_paged_*`): an unknown sequence id (never handed out by this pool).
 */
#define MB_ERR_UNKNOWN_SEQUENCE 9

/**
 * A request on a freed sequence: a double free, a fork of a freed sequence, an extend of one.
 */
#define MB_ERR_FREED_SEQUENCE 10

/**
 * A capacity would be exceeded: a sequence's length, the pool's pages, the block table's rows,
 * or the step's slot mapping.
 */
#define MB_ERR_CAPACITY 11

/**
 * A request that is invalid as asked (a truncation that lengthens, a fork of tokens added
 * this step before the commit).
 */
#define MB_ERR_INVALID_REQUEST 12

/**
 * Memory could not be shared with, or taken from, another process (`mb_ipc_*`).
 */
#define MB_ERR_IPC 13

/**
 * A tag not in the state the call needs: an allocation into it or a free of its memory while
 * it sleeps, a sleep of a tag that is not awake (or whose memory was exported, or one of whose
 * requests is mapping on another thread), a wake of one awake (`mb_sleep`, `mb_wake`).
 */
#define MB_ERR_TAG_STATE 14

/**
 * `mb_options.backend`: CUDA when a GPU is present, the host backend otherwise.
 */
#define MB_BACKEND_AUTO 0

/**
 * `mb_options.backend`: the CUDA driver.
 */
#define MB_BACKEND_CUDA 1

/**
 * `mb_options.backend`: the host backend, a CPU model of the CUDA virtual-memory API (for tests).
 */
#define MB_BACKEND_HOST 2

/**
 * `mb_sleep`'s `backup`: the tag's bytes are dropped; after `mb_wake` its memory holds
 * whatever the new pages held.
 */
#define MB_BACKUP_DISCARD 0

/**
 * `mb_sleep`'s `backup`: the tag's bytes are copied to pinned host memory, and back at
 * `mb_wake`.
 */
#define MB_BACKUP_HOST 1

/**
 * An allocator (opaque). Made by `mb_create`, destroyed by `mb_destroy`. Any number of threads
 * may call `mb_malloc`, `mb_free` and the other functions on one allocator at once; only
 * `mb_destroy` must not overlap any other call on it.
 */
typedef struct mb_allocator mb_allocator;

/**
 * A paged KV pool (opaque). Made by `mb_paged_create`, destroyed by `mb_paged_destroy`, which
 * must come before `mb_destroy` of its allocator. One thread at a time may call it.
 */
typedef struct mb_paged mb_paged;

/**
 * Options of an allocator. Fill with `mb_options_default`, then change what you need. A field
 * of 0 means its default everywhere (except `backend` and `device`, where 0 is itself a value).
 */
typedef struct mb_options {
  /**
   * Which backend: `MB_BACKEND_AUTO` (0), `MB_BACKEND_CUDA` (1) or `MB_BACKEND_HOST` (2).
   */
  int backend;
  /**
   * CUDA device ordinal.
   */
  int32_t device;
  /**
   * Cap on physical bytes held; 0: 95% of the device's total memory.
   */
  uint64_t cap_bytes;
  /**
   * Host backend: page size in bytes, a power of two from 4096 to 1 GiB; 0: 2 MiB.
   */
  uint64_t host_page_size;
  /**
   * Host backend: bytes of simulated device memory; 0: 64 GiB.
   */
  uint64_t host_capacity;
  /**
   * Largest physical chunk in bytes, a power of two; 0: 64 MiB.
   */
  uint64_t max_chunk_bytes;
  /**
   * Retired ranges that trigger an unmap batch; 0: 256.
   */
  uint64_t unmap_batch_ranges;
} mb_options;

/**
 * One statistic: its current value, its peak, and its cumulative increases and decreases.
 */
typedef struct mb_stat {
  /**
   * Now.
   */
  uint64_t current;
  /**
   * Highest `current` since the allocator was created.
   */
  uint64_t peak;
  /**
   * Sum of all increases.
   */
  uint64_t allocated;
  /**
   * Sum of all decreases.
   */
  uint64_t freed;
} mb_stat;

/**
 * A snapshot of an allocator's statistics (`mb_get_stats`).
 */
typedef struct mb_stats {
  /**
   * Bytes of live allocations, as requested.
   */
  struct mb_stat allocated_bytes;
  /**
   * Bytes of physical memory held.
   */
  struct mb_stat reserved_bytes;
  /**
   * Bytes of live allocations after rounding (to 256 B below a page, to pages above).
   */
  struct mb_stat active_bytes;
  /**
   * Rounded minus requested bytes of live allocations.
   */
  struct mb_stat rounding_waste_bytes;
  /**
   * Virtual bytes mapped (live, cached and retired ranges).
   */
  struct mb_stat mapped_bytes;
  /**
   * Live allocations.
   */
  struct mb_stat allocations;
  /**
   * Allocations served by a cached range without any driver call.
   */
  uint64_t cache_hits;
  /**
   * Cached ranges broken up to reuse their pages elsewhere.
   */
  uint64_t cached_ranges_stolen;
  /**
   * Chunks released and recreated smaller under pressure.
   */
  uint64_t chunk_splits;
  /**
   * Unmap batches flushed.
   */
  uint64_t unmap_batches;
  /**
   * Requests refused for lack of memory.
   */
  uint64_t num_ooms;
  /**
   * Driver errors met outside a request, recovered by retrying later.
   */
  uint64_t deferred_errors;
  /**
   * `cuMemMap` calls.
   */
  uint64_t map_calls;
  /**
   * `cuMemUnmap` calls.
   */
  uint64_t unmap_calls;
  /**
   * `cuMemSetAccess` calls.
   */
  uint64_t set_access_calls;
  /**
   * `cuMemCreate` calls.
   */
  uint64_t create_calls;
  /**
   * `cuMemRelease` calls.
   */
  uint64_t release_calls;
  /**
   * `cuMemAddressReserve` calls.
   */
  uint64_t reserve_calls;
  /**
   * Bytes of pages committed to growable allocations.
   */
  struct mb_stat growable_committed_bytes;
  /**
   * Resizes of growable allocations that mapped or gave back pages (none copies).
   */
  uint64_t growable_resizes;
  /**
   * Bytes of ranges whose tag is asleep (`mb_sleep`): unmapped, their memory given back,
   * their addresses kept. Their allocations still count in `allocated_bytes` and
   * `active_bytes`, not in `reserved_bytes`.
   */
  struct mb_stat asleep_bytes;
} mb_stats;

/**
 * The shape of a paged pool.
 */
typedef struct mb_paged_config {
  /**
   * Tokens per page (16, say).
   */
  uint32_t tokens_per_page;
  /**
   * KV bytes per token.
   */
  uint64_t bytes_per_token;
  /**
   * Capacity of the pool in pages.
   */
  uint32_t max_pages;
  /**
   * Rows of the block table (sequences alive at once).
   */
  uint32_t max_seqs;
  /**
   * Columns of the block table (pages per sequence).
   */
  uint32_t max_pages_per_seq;
  /**
   * Length of the slot mapping (tokens per step).
   */
  uint32_t max_step_tokens;
} mb_paged_config;

/**
 * Device addresses of a pool's tables and pages; fixed for the pool's life (so CUDA graphs
 * may capture kernels that read them).
 */
typedef struct mb_paged_tables {
  /**
   * int32 `[max_seqs][max_pages_per_seq]`, -1 where no page.
   */
  uint64_t block_table;
  /**
   * int32 `[max_seqs]`: tokens per row.
   */
  uint64_t seq_lens;
  /**
   * int32 `[max_seqs]`: the batch's rows, in decode-token order.
   */
  uint64_t batch_rows;
  /**
   * int64 `[max_step_tokens]`: the last step's slot per token (-1: skip).
   */
  uint64_t slot_mapping;
  /**
   * Page 0 of the KV pages; page `p` is at `pages + p * tokens_per_page * bytes_per_token`.
   */
  uint64_t pages;
} mb_paged_tables;

/**
 * The sizes of a growable allocation, in bytes (`mb_get_growable_info`).
 */
typedef struct mb_growable_info {
  /**
   * Its address, fixed for its life.
   */
  uint64_t base;
  /**
   * Addresses reserved: the most it can grow to.
   */
  uint64_t capacity;
  /**
   * The size of the last resize.
   */
  uint64_t size;
  /**
   * Bytes backed by physical pages.
   */
  uint64_t committed;
} mb_growable_info;

/**
 * What `mb_sleep` did.
 */
typedef struct mb_sleep_report {
  /**
   * Bytes of mapped ranges taken out of service: the tag's allocations, rounded to pages,
   * with the sub-page arenas that hold its small ones.
   */
  uint64_t bytes;
  /**
   * Of them, device memory given back to the driver (less than `bytes` where a chunk's
   * earlier mapping still waited for other work: that chunk stays in the allocator's pool).
   */
  uint64_t released;
  /**
   * Bytes copied to host memory (0 with `MB_BACKUP_DISCARD`).
   */
  uint64_t backed_up;
  /**
   * Seconds the call took.
   */
  double seconds;
} mb_sleep_report;

/**
 * What `mb_wake` did.
 */
typedef struct mb_wake_report {
  /**
   * Bytes mapped again.
   */
  uint64_t bytes;
  /**
   * Of them, bytes of newly created chunks (the rest came from memory the allocator held).
   */
  uint64_t created;
  /**
   * Bytes copied back from host memory.
   */
  uint64_t restored;
  /**
   * Seconds the call took.
   */
  double seconds;
} mb_wake_report;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * Fills `*out` with the default options: the auto backend on device 0, and every other field at
 * its default value (written out, so a caller can read it). Does nothing when `out` is NULL.
 *
 * # Safety
 * `out` is NULL or valid for a write of an `mb_options`.
 */
void mb_options_default(struct mb_options *out);

/**
 * Creates an allocator with `*opts` (NULL: the defaults) and stores it in `*out`. Nothing is
 * reserved from the device until the first `mb_malloc`.
 *
 * Returns `MB_ERR_INVALID_ARGUMENT` for a NULL `out` or a bad option (the last error names it),
 * `MB_ERR_NO_BACKEND` when the backend cannot be opened, `MB_ERR_DRIVER` when a driver call fails.
 *
 * # Safety
 * `opts` is NULL or points to a valid `mb_options`; `out` is NULL or valid for a write of a
 * pointer.
 */
int mb_create(const struct mb_options *opts, struct mb_allocator **out);

/**
 * Creates an allocator with the options a configuration string names and stores it in `*out`:
 * `key:value` pairs separated by commas, the keys and syntax of `MOONBRIGHT_ALLOC_CONF`
 * (`"backend:host,cap:12GiB,unmap_batch:32"`), over the defaults. NULL or "" gives the
 * defaults. Every option MoonBright has is reachable this way, including those added after
 * `mb_options` was laid out, so a program compiled against this header keeps working as
 * options are added. The environment variable itself is not read.
 *
 * Returns `MB_ERR_INVALID_ARGUMENT` for a NULL `out`, a string that is not UTF-8, an unknown
 * key, an item that is not `key:value` or a bad value (the last error names the key and what
 * it allows); `MB_ERR_NO_BACKEND` and `MB_ERR_DRIVER` as `mb_create`. `*out` is untouched on
 * failure.
 *
 * # Safety
 * `conf` is NULL or a NUL-terminated string; `out` is NULL or valid for a write of a pointer.
 */
int mb_create_conf(const char *conf, struct mb_allocator **out);

/**
 * Destroys an allocator, giving all its memory back to the driver. Allocations still live are
 * freed with it (a count of them is printed to stderr). NULL is accepted and does nothing. No
 * other call may use the handle during or after this one.
 *
 * # Safety
 * `alloc` is NULL or a handle from `mb_create` not yet destroyed, which no other call uses now
 * or later.
 */
int mb_destroy(struct mb_allocator *alloc);

/**
 * Allocates `size` bytes of device memory and stores its device address in `*out_ptr`. The
 * address is aligned to at least 256 bytes, and to the page from a page up.
 *
 * Returns `MB_ERR_INVALID_ARGUMENT` for NULL arguments or a size of 0, `MB_ERR_TOO_LARGE` for a
 * size over the cap, `MB_ERR_OUT_OF_MEMORY` when not enough memory is free, `MB_ERR_DRIVER` when
 * a driver call fails.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write.
 */
int mb_malloc(struct mb_allocator *alloc, size_t size, uint64_t *out_ptr);

/**
 * Allocates `size` bytes for use on `stream` (a `CUstream`, NULL for the default stream), as
 * `cudaMallocAsync`: the memory may come from frees queued on `stream`, or from frees on other
 * streams that have completed. No driver call on the common path.
 *
 * Returns what `mb_malloc` returns, and `MB_ERR_STREAM_CAPTURE` while `stream` is being captured
 * into a CUDA graph.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write;
 * `stream` is NULL or a live stream of the allocator's device.
 */
int mb_malloc_async(struct mb_allocator *alloc, size_t size, void *stream, uint64_t *out_ptr);

/**
 * Frees an allocation in `stream`'s order, as `cudaFreeAsync`: work queued on `stream` before
 * this call may still use it; later work on `stream` may reuse it at once, other streams once an
 * event recorded here has completed. Never waits for the device.
 *
 * Returns what `mb_free` returns, and `MB_ERR_STREAM_CAPTURE` while `stream` is being captured.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `stream` is NULL or a live stream.
 */
int mb_free_async(struct mb_allocator *alloc, uint64_t ptr, void *stream);

/**
 * Notes that work queued on `stream` (a `CUstream`, NULL for the default stream) uses the
 * allocation at `ptr`, made for another stream: PyTorch's `Tensor.record_stream`. Its
 * `mb_free_async` then also records an event on `stream`, and no stream (the freeing one
 * included) reuses the memory until every such event has completed. No driver call here;
 * `stream` must still exist when the allocation is freed. `mb_free` ignores these uses.
 *
 * Returns `MB_ERR_INVALID_POINTER` for a pointer that is not the start of a live allocation,
 * `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or a growable allocation; nothing changes then.
 * The `mb_free_async` that follows returns `MB_ERR_STREAM_CAPTURE`, and frees nothing, while
 * `stream` is being captured into a CUDA graph.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_record_stream(struct mb_allocator *alloc, uint64_t ptr, void *stream);

/**
 * Makes the capture in progress on `stream` (begun with `cuStreamBeginCapture`) allocate into
 * the graph pool `(pool_hi, pool_lo)`, a pair the caller picks: until
 * `mb_end_graph_capture(stream)`, `mb_malloc_async` on a stream of that capture serves the
 * request from the pool, and the memory stays the pool's (its frees give it back to the pool)
 * until `mb_release_graph_pool` is called once for each capture begun into the pool. A block
 * freed during the capture is reused in it only on the stream that freed it; after it, by
 * later captures into the pool, whose graphs must then not run concurrently with this one's.
 * `mb_free_async` of other memory on a stream of the capture is done at its end.
 *
 * Returns `MB_ERR_STREAM_CAPTURE` if `stream` is not being captured or its capture was begun
 * already, `MB_ERR_DRIVER` if the capture query fails; nothing changes then.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_begin_graph_capture(struct mb_allocator *alloc,
                           void *stream,
                           uint64_t pool_hi,
                           uint64_t pool_lo);

/**
 * Announces that a CUDA graph capture is about to begin on one of the allocator's device's
 * streams (call it before `cuStreamBeginCapture`). With option `captures_announced:true`,
 * streams are checked for a capture (`cuStreamIsCapturing`) only between this and the matching
 * `mb_capture_finished`. Returns `MB_ERR_INVALID_ARGUMENT` for a NULL handle.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_capture_starting(struct mb_allocator *alloc);

/**
 * Announces that a capture announced with `mb_capture_starting` has ended (after
 * `cuStreamEndCapture`) or failed to begin. Extra calls are ignored. Returns
 * `MB_ERR_INVALID_ARGUMENT` for a NULL handle.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_capture_finished(struct mb_allocator *alloc);

/**
 * Ends the capture begun on `stream` by `mb_begin_graph_capture`, after `cuStreamEndCapture`.
 * Returns `MB_ERR_STREAM_CAPTURE` if none was begun there.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_end_graph_capture(struct mb_allocator *alloc, void *stream);

/**
 * Notes that a graph of pool `(pool_hi, pool_lo)` was launched on `stream`: the pool's memory
 * is reused by nothing else before the work queued there at its release has completed. Once a
 * stream is enough.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_graph_replayed(struct mb_allocator *alloc, uint64_t pool_hi, uint64_t pool_lo, void *stream);

/**
 * One graph of pool `(pool_hi, pool_lo)` is destroyed. With the last, the pool's free memory
 * goes back to other allocations, after the streams its graphs were launched on; its live
 * blocks follow as they are freed. Returns `MB_ERR_STREAM_CAPTURE` for a pool with no graph.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_release_graph_pool(struct mb_allocator *alloc, uint64_t pool_hi, uint64_t pool_lo);

/**
 * Routes the calling thread's requests outside captures into graph pool `(pool_hi, pool_lo)`
 * until `mb_end_allocate_to_pool` (PyTorch's `beginAllocateCurrentThreadToPool`, which
 * CUDA-graph trees use for warm-up runs): `mb_malloc_async` and `mb_malloc` on this thread
 * take a block the pool holds free (one freed before the route began, on any stream; one freed
 * during it, on its freeing stream only) or new memory, which stays the pool's. The caller
 * orders the route after the work of the pool's graphs (PyTorch's trees synchronise first).
 * The route is one more user of the pool: call `mb_release_graph_pool` after ending it.
 * Returns `MB_ERR_STREAM_CAPTURE` if this thread is routed already.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_begin_allocate_to_pool(struct mb_allocator *alloc, uint64_t pool_hi, uint64_t pool_lo);

/**
 * Ends the calling thread's route into a graph pool. Returns `MB_ERR_STREAM_CAPTURE` if it
 * had none.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_end_allocate_to_pool(struct mb_allocator *alloc);

/**
 * The live blocks of graph pool `(pool_hi, pool_lo)` (handed out and not freed back): their
 * count in `*count`, and the first `cap` of their addresses, in address order, in `ptrs`
 * (NULL when `cap` is 0, to ask for the count). A pool's state to set back later with
 * `mb_set_graph_pool_live`. An unknown pool has none.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `ptrs` is NULL or valid for writes of
 * `cap` values; `count` is NULL or valid for a write.
 */
int mb_graph_pool_live(struct mb_allocator *alloc,
                       uint64_t pool_hi,
                       uint64_t pool_lo,
                       uint64_t *ptrs,
                       size_t cap,
                       size_t *count);

/**
 * Makes the `n` addresses at `keep` the live set of graph pool `(pool_hi, pool_lo)`, as
 * PyTorch's `setCheckpointPoolState` sets back a state `mb_graph_pool_live` read: blocks among
 * them that the pool holds free count as allocated again at the same addresses, and the
 * pool's other live blocks go back to it as freed on `stream`. Each block is then freed once,
 * as any other. Returns `MB_ERR_STREAM_CAPTURE`, with nothing changed, while a capture into
 * the pool is in progress, for a pool with no graph, or for an address that is not a block of
 * the pool.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `keep` is NULL (only with `n` 0) or valid
 * for reads of `n` values.
 */
int mb_set_graph_pool_live(struct mb_allocator *alloc,
                           uint64_t pool_hi,
                           uint64_t pool_lo,
                           const uint64_t *keep,
                           size_t n,
                           void *stream);

/**
 * Frees an allocation made by `mb_malloc` on this allocator. No device work may still use it.
 *
 * Returns `MB_ERR_INVALID_POINTER` for an address this allocator did not return, one freed
 * already, or one inside an allocation; `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc`.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_free(struct mb_allocator *alloc, uint64_t ptr);

/**
 * Gives every physical page no allocation uses back to the driver, without waiting: the memory
 * of frees whose stream work may still be running stays held (`mb_empty_cache` waits for it).
 * Stores the bytes released in `*out_bytes` unless it is NULL.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_release_unused(struct mb_allocator *alloc, uint64_t *out_bytes);

/**
 * Waits on the calling thread for the stream work of every pending free, then gives every
 * physical page no allocation uses back to the driver, as `torch.cuda.empty_cache` does under
 * PyTorch's own allocator. No kernel waits. A failed wait is reported (its error code) after
 * the release, which still gives back what is free; `*out_bytes` is then not written. Stores
 * the bytes released in `*out_bytes` unless it is NULL.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_empty_cache(struct mb_allocator *alloc, uint64_t *out_bytes);

/**
 * Unmaps every retired range now rather than at the next unmap batch.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_flush(struct mb_allocator *alloc);

/**
 * Stores a snapshot of the allocator's statistics in `*out`.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out` is NULL or valid for a write of an
 * `mb_stats`.
 */
int mb_get_stats(struct mb_allocator *alloc, struct mb_stats *out);

/**
 * Stores the cap on physical bytes the allocator may hold in `*out_bytes`.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_get_cap(struct mb_allocator *alloc, uint64_t *out_bytes);

/**
 * Sets the cap on physical bytes the allocator may hold to `bytes` (rounded down to a page,
 * limited to the device's memory) and stores the cap set in `*out_bytes` unless it is NULL.
 * Lowering it below what is held releases every page no allocation uses; past that, live
 * allocations keep their memory, and the held memory serves requests but does not grow until
 * it is back under the cap.
 *
 * A cap below one page is 0: every request fails with `MB_ERR_TOO_LARGE` until it is raised.
 * Returns `MB_ERR_DRIVER` when releasing unused memory fails (the cap is set).
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_set_cap(struct mb_allocator *alloc, uint64_t bytes, uint64_t *out_bytes);

/**
 * Grants device `peer` access to all of this allocator's memory, mapped now and later, so that
 * kernels and copies on `peer` reach it directly: needed for copies between GPUs in one process,
 * since `cudaDeviceEnablePeerAccess` does not cover virtual-memory mappings. Enabling a peer
 * twice, or a CUDA allocator's own device, does nothing (the host backend, device 0 of 8
 * modelled devices, refuses 0 as a peer). Each later mapping's set access names
 * every peer, and costs more for it; enable only the devices that use this memory.
 *
 * Returns `MB_ERR_DRIVER` when `peer` cannot reach this device peer to peer or a driver call
 * fails; no peer is added then, and allocations keep working.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_enable_peer_access(struct mb_allocator *alloc, int peer);

/**
 * Stores the page size (the mapping granularity) in bytes in `*out_bytes`.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_get_page_size(struct mb_allocator *alloc, uint64_t *out_bytes);

/**
 * The message of the last failed call on this thread, or "" when the last call succeeded. Every
 * call except `mb_last_error`, `mb_status_string` and `mb_version` clears it first. The string
 * is valid until the next such call on this thread; copy it to keep it. Never NULL.
 */
const char *mb_last_error(void);

/**
 * A short static description of a status code ("ok", "out of memory", ...); "unknown status"
 * for a code that is none of them. Never NULL.
 */
const char *mb_status_string(int status);

/**
 * MoonBright's version, as "MAJOR.MINOR.PATCH". Static; never NULL.
 */
const char *mb_version(void);

/**
 * Creates a paged pool of shape `*cfg` on `alloc`, updated on `stream` (a `CUstream`, NULL
 * for the default stream), and stores it in `*out`. On the CUDA backend this compiles the
 * table kernels with NVRTC (libnvrtc must be loadable).
 *
 * # Safety
 * `alloc` is NULL or a live handle, which must outlive the pool; `cfg` is NULL or valid;
 * `out` is NULL or valid for a write.
 */
int mb_paged_create(struct mb_allocator *alloc,
                    const struct mb_paged_config *cfg,
                    void *stream,
                    struct mb_paged **out);

/**
 * Destroys a pool: its tables and pages go back to the allocator in its stream's order. NULL
 * does nothing.
 *
 * # Safety
 * `p` is NULL or a live handle that no other call uses now or later.
 */
int mb_paged_destroy(struct mb_paged *p);

/**
 * Adds a sequence of `prompt_len` tokens (they get slots this step); its id goes to `*out_seq`.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_seq` is NULL or valid for a write.
 */
int mb_paged_add(struct mb_paged *p, uint32_t prompt_len, uint64_t *out_seq);

/**
 * Adds `n` tokens to sequence `seq` (they get slots this step).
 *
 * # Safety
 * `p` is NULL or a live handle.
 */
int mb_paged_extend(struct mb_paged *p, uint64_t seq, uint32_t n);

/**
 * Forks `parent`: the child shares its pages (copy-on-write); its id goes to `*out_child`.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_child` is NULL or valid for a write.
 */
int mb_paged_fork(struct mb_paged *p, uint64_t parent, uint64_t *out_child);

/**
 * Shortens `seq` to `new_len` tokens.
 *
 * # Safety
 * `p` is NULL or a live handle.
 */
int mb_paged_truncate(struct mb_paged *p, uint64_t seq, uint32_t new_len);

/**
 * Frees `seq`.
 *
 * # Safety
 * `p` is NULL or a live handle.
 */
int mb_paged_free(struct mb_paged *p, uint64_t seq);

/**
 * Commits the step: launches the kernels that update the tables on the pool's stream (no host
 * synchronisation). Stores the step's slot-mapping length in `*out_tokens` unless NULL.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_tokens` is NULL or valid for a write.
 */
int mb_paged_commit(struct mb_paged *p, uint32_t *out_tokens);

/**
 * Extends every live sequence by one token and commits the step (decode tokens come after
 * the explicit ones in the slot mapping, in `batch_rows` order).
 *
 * # Safety
 * As for `mb_paged_commit`.
 */
int mb_paged_decode_step(struct mb_paged *p, uint32_t *out_tokens);

/**
 * Stores the block-table row of live sequence `seq` in `*out_row`.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_row` is NULL or valid for a write.
 */
int mb_paged_row(struct mb_paged *p, uint64_t seq, uint32_t *out_row);

/**
 * Stores the token count of live sequence `seq` in `*out_len`.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_len` is NULL or valid for a write.
 */
int mb_paged_len(struct mb_paged *p, uint64_t seq, uint32_t *out_len);

/**
 * Stores the device addresses of the tables and pages in `*out`.
 *
 * # Safety
 * `p` is NULL or a live handle; `out` is NULL or valid for a write.
 */
int mb_paged_get_tables(struct mb_paged *p, struct mb_paged_tables *out);

/**
 * Gives back committed pool memory above the highest page in use; the bytes released go to
 * `*out_bytes` unless NULL.
 *
 * # Safety
 * `p` is NULL or a live handle; `out_bytes` is NULL or valid for a write.
 */
int mb_paged_shrink(struct mb_paged *p, uint64_t *out_bytes);

/**
 * Reserves `capacity` bytes of addresses (rounded up to pages) for a growable allocation and
 * stores its address, which never changes, in `*out_ptr`. No physical memory is used until it
 * grows. `mb_free` or `mb_free_async` releases it.
 *
 * Returns `MB_ERR_INVALID_ARGUMENT` for NULL arguments or a capacity of 0,
 * `MB_ERR_OUT_OF_MEMORY` when the address space cannot hold it, `MB_ERR_DRIVER` when the
 * reservation fails.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_ptr` is NULL or valid for a write.
 */
int mb_reserve_growable(struct mb_allocator *alloc, size_t capacity, uint64_t *out_ptr);

/**
 * Resizes the growable allocation at `ptr` to `len` bytes in `stream`'s order (a `CUstream`,
 * NULL for the default stream), in place: growing maps pages at its end, none while the pages
 * already committed hold `len`; shrinking gives back whole chunks beyond `len`, reusable by other
 * streams once the work queued on `stream` before this call has completed. Nothing is copied.
 *
 * Returns `MB_ERR_TOO_LARGE` beyond its capacity, `MB_ERR_INVALID_POINTER` for a pointer that
 * is not a live growable allocation, `MB_ERR_OUT_OF_MEMORY` when not enough memory is free,
 * `MB_ERR_STREAM_CAPTURE` while `stream` is being captured, `MB_ERR_DRIVER` when a driver call
 * fails. On failure nothing changes.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `stream` is NULL or a live stream.
 */
int mb_resize_async(struct mb_allocator *alloc, uint64_t ptr, size_t len, void *stream);

/**
 * `mb_resize_async` for a caller that orders device work itself (as `mb_free`): what a shrink
 * gives back is reusable at once.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_resize(struct mb_allocator *alloc, uint64_t ptr, size_t len);

/**
 * Stores the sizes of the growable allocation at `ptr` in `*out`.
 *
 * Returns `MB_ERR_INVALID_POINTER` for a pointer that is not a live growable allocation.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out` is NULL or valid for a write.
 */
int mb_get_growable_info(struct mb_allocator *alloc, uint64_t ptr, struct mb_growable_info *out);

/**
 * Sends the live allocation at `ptr` over `socket_fd`, a connected Unix socket, to a process
 * that calls `mb_ipc_recv`: its chunks travel as file descriptors (`SCM_RIGHTS`). The
 * allocation must stay live until the receiver has closed its import (`mb_ipc_close`).
 *
 * Returns `MB_ERR_INVALID_POINTER` for a pointer that is not a live allocation, `MB_ERR_IPC`
 * when sharing is off (option `ipc`) or the socket fails, `MB_ERR_DRIVER` when an export
 * fails. The allocation is unchanged either way.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; a non-negative `socket_fd` is an open
 * descriptor.
 */
int mb_ipc_send(struct mb_allocator *alloc, uint64_t ptr, int socket_fd);

/**
 * Receives an allocation `mb_ipc_send` sent over `socket_fd` and maps it on this allocator's
 * device at addresses of its own; stores its address in `*out_ptr` and its size in
 * `*out_size`. The memory is not this allocator's: `mb_ipc_close` unmaps it.
 *
 * Returns `MB_ERR_IPC` for a malformed message, a closed socket, or an export from another
 * backend; `MB_ERR_DRIVER` when importing or mapping fails (nothing stays mapped).
 *
 * Trust: the socket is the caller's, and whoever holds its other end decides what arrives.
 * The message is checked for form (sizes, counts, no more descriptors than it announces,
 * every one closed on error), not for origin: what is mapped is whatever memory the
 * sender's descriptors name, which the sender can read and write. Receive only from a peer
 * trusted with that memory (check it, e.g. with `SO_PEERCRED`, on a socket others can
 * reach); see docs/security.md. A blocking socket's own receive time-out (`SO_RCVTIMEO`)
 * holds; a non-blocking socket is waited on.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; a non-negative `socket_fd` is an open
 * descriptor; `out_ptr` and `out_size` are NULL or valid for a write.
 */
int mb_ipc_recv(struct mb_allocator *alloc, int socket_fd, uint64_t *out_ptr, uint64_t *out_size);

/**
 * Unmaps memory `mb_ipc_recv` mapped. The unmap is immediate: work that uses it must have
 * completed. Returns `MB_ERR_IPC` for an address that is not an import.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`.
 */
int mb_ipc_close(struct mb_allocator *alloc, uint64_t ptr);

/**
 * Makes `tag` the calling thread's tag: what `mb_malloc` and the other allocating calls of
 * this thread allocate, on every allocator, carries it until `mb_tag_end`. Stores in
 * `*out_previous` the tag in effect before (0: none), to give to `mb_tag_end`. Tags nest:
 * end them in the reverse order of their begins. Names are process-wide: one name is one tag
 * on every allocator.
 *
 * Returns `MB_ERR_INVALID_ARGUMENT` for a NULL argument or a name that is empty, longer than
 * 256 bytes or not UTF-8; the thread's tag is unchanged then.
 *
 * # Safety
 * `tag` is NULL or a NUL-terminated string; `out_previous` is NULL or valid for a write.
 */
int mb_tag_begin(const char *tag, uint32_t *out_previous);

/**
 * Ends the tag a `mb_tag_begin` of this thread began: `previous` is what that call stored in
 * `*out_previous`, and becomes the thread's tag again. A value no `mb_tag_begin` stored is
 * refused (`MB_ERR_INVALID_ARGUMENT`), the thread's tag unchanged.
 */
int mb_tag_end(uint32_t previous);

/**
 * Puts every allocation of `alloc` tagged `tag` to sleep: after the work queued on their
 * streams (events, never a device-wide synchronisation: the streams of `mb_malloc_async` and
 * `mb_record_stream`; memory from `mb_malloc` has none, and no work may use it any more, as
 * for `mb_free`), their bytes are copied to pinned host memory (`backup` `MB_BACKUP_HOST`) or
 * dropped (`MB_BACKUP_DISCARD`), and their memory is unmapped and given back to the driver. Their addresses stay reserved: pointers and CUDA
 * graphs that hold them are valid again after `mb_wake`. Until then, allocating with the tag
 * and freeing its allocations return `MB_ERR_TAG_STATE`; other tags and untagged memory are
 * untouched. A tag with no allocation sleeps at no cost (and its allocations are refused).
 * Stores what was done in `*out` unless it is NULL.
 *
 * Returns `MB_ERR_TAG_STATE` for a tag that is not awake (asleep already, or being put to
 * sleep or woken on another thread), one of whose requests is mapping on another thread, or
 * some of whose memory was exported to another process (`mb_ipc_send`);
 * `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or `tag`, a bad name (as `mb_tag_begin`) or an
 * unknown `backup`; `MB_ERR_DRIVER` when a wait or a copy fails. After any failure the tag is
 * as it was.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `tag` is NULL or a NUL-terminated string;
 * `out` is NULL or valid for a write of an `mb_sleep_report`.
 */
int mb_sleep(struct mb_allocator *alloc,
             const char *tag,
             int backup,
             struct mb_sleep_report *out);

/**
 * Wakes `tag` on `alloc`: maps its memory again at the same addresses, from memory the
 * allocator holds free and new chunks, and copies its bytes back if `mb_sleep` kept them;
 * returns once they are in place. Stores what was done in `*out` unless it is NULL.
 *
 * All or nothing: returns `MB_ERR_OUT_OF_MEMORY` when the memory cannot be had (the cap, the
 * device) and `MB_ERR_DRIVER` when a driver call fails, with the tag still asleep and its bytes
 * kept (free memory and call again); `MB_ERR_TAG_STATE` for a tag that is not asleep;
 * `MB_ERR_INVALID_ARGUMENT` for a NULL `alloc` or `tag` or a bad name.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `tag` is NULL or a NUL-terminated string;
 * `out` is NULL or valid for a write of an `mb_wake_report`.
 */
int mb_wake(struct mb_allocator *alloc, const char *tag, struct mb_wake_report *out);

/**
 * Stores in `*out_bytes` the bytes of pinned host memory `alloc` holds for sleeps: the bytes
 * of tags asleep with `MB_BACKUP_HOST`, and spare pieces kept for the next sleep.
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_get_host_memory(struct mb_allocator *alloc, uint64_t *out_bytes);

/**
 * Gives the spare pinned host memory of `alloc` back to the system (what tags asleep hold
 * stays), and stores the bytes freed in `*out_bytes` unless it is NULL. Returns
 * `MB_ERR_DRIVER` when freeing a piece fails (`*out_bytes` is not written then).
 *
 * # Safety
 * `alloc` is NULL or a live handle from `mb_create`; `out_bytes` is NULL or valid for a write.
 */
int mb_release_host_memory(struct mb_allocator *alloc, uint64_t *out_bytes);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* MOONBRIGHT_H */
