/*
 * basic.c: the MoonBright C API in a few lines. Creates an allocator on the host backend (a CPU
 * model of the CUDA virtual-memory API, so no GPU is needed), allocates three sizes, frees them,
 * prints the statistics, and puts a tag's memory to sleep and wakes it. Exits non-zero on any
 * failure.
 *
 * Build (from crates/moonbright-capi, after `cargo build -p moonbright-capi`):
 *   cc -Iinclude examples/c/basic.c ../../target/debug/libmoonbright_capi.a -lpthread -ldl -lm -o basic
 */
#include <inttypes.h>
#include <stdio.h>

#include "moonbright.h"

#define CHECK(call)                                                                          \
    do {                                                                                     \
        int status_ = (call);                                                                \
        if (status_ != MB_OK) {                                                              \
            fprintf(stderr, "%s:%d: %s failed: %s (%d): %s\n", __FILE__, __LINE__, #call,    \
                    mb_status_string(status_), status_, mb_last_error());                    \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

#define EXPECT(cond)                                                                         \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);              \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

static void print_stat(const char *name, mb_stat s) {
    printf("  %-22s current %10" PRIu64 "  peak %10" PRIu64 "  allocated %10" PRIu64
           "  freed %10" PRIu64 "\n",
           name, s.current, s.peak, s.allocated, s.freed);
}

int main(void) {
    printf("MoonBright %s\n", mb_version());

    mb_options opts;
    mb_options_default(&opts);
    opts.backend = MB_BACKEND_HOST;
    opts.host_capacity = 256u << 20;
    opts.host_page_size = 64u << 10;

    mb_allocator *alloc = NULL;
    CHECK(mb_create(&opts, &alloc));
    EXPECT(alloc != NULL);

    const size_t sizes[3] = {100, 64u << 10, 3u << 20};
    uint64_t ptrs[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
        CHECK(mb_malloc(alloc, sizes[i], &ptrs[i]));
        EXPECT(ptrs[i] != 0 && ptrs[i] % 256 == 0);
        printf("malloc(%zu) = 0x%" PRIx64 "\n", sizes[i], ptrs[i]);
    }

    mb_stats stats;
    CHECK(mb_get_stats(alloc, &stats));
    EXPECT(stats.allocations.current == 3);
    EXPECT(stats.allocated_bytes.current == sizes[0] + sizes[1] + sizes[2]);

    for (int i = 0; i < 3; i++) CHECK(mb_free(alloc, ptrs[i]));

    /* The error paths report a status and a message. */
    EXPECT(mb_free(alloc, ptrs[0]) == MB_ERR_INVALID_POINTER);
    EXPECT(mb_last_error()[0] != '\0');
    uint64_t p = 0;
    EXPECT(mb_malloc(alloc, 0, &p) == MB_ERR_INVALID_ARGUMENT);
    EXPECT(mb_malloc(alloc, (size_t)1 << 40, &p) == MB_ERR_TOO_LARGE);
    EXPECT(mb_malloc(NULL, 16, &p) == MB_ERR_INVALID_ARGUMENT);

    uint64_t released = 0;
    CHECK(mb_flush(alloc));
    CHECK(mb_release_unused(alloc, &released));
    CHECK(mb_get_stats(alloc, &stats));
    EXPECT(stats.allocations.current == 0 && stats.reserved_bytes.current == 0);

    printf("released %" PRIu64 " bytes; statistics:\n", released);
    print_stat("allocated_bytes", stats.allocated_bytes);
    print_stat("reserved_bytes", stats.reserved_bytes);
    print_stat("active_bytes", stats.active_bytes);
    print_stat("rounding_waste_bytes", stats.rounding_waste_bytes);
    print_stat("mapped_bytes", stats.mapped_bytes);
    print_stat("allocations", stats.allocations);
    printf("  cache_hits %" PRIu64 ", num_ooms %" PRIu64 ", driver calls: create %" PRIu64
           ", map %" PRIu64 ", set_access %" PRIu64 ", unmap %" PRIu64 ", release %" PRIu64
           ", reserve %" PRIu64 "\n",
           stats.cache_hits, stats.num_ooms, stats.create_calls, stats.map_calls,
           stats.set_access_calls, stats.unmap_calls, stats.release_calls, stats.reserve_calls);

    /* Tags: what this thread allocates between mb_tag_begin and mb_tag_end carries the tag. A
     * sleeping tag's memory goes back to the driver, its bytes to host memory and its addresses
     * kept, until mb_wake maps it again where it was. */
    uint32_t previous = 0;
    uint64_t weights[2] = {0, 0};
    CHECK(mb_tag_begin("weights", &previous));
    for (int i = 0; i < 2; i++) CHECK(mb_malloc(alloc, 4u << 20, &weights[i]));
    CHECK(mb_tag_end(previous));
    mb_sleep_report slept;
    CHECK(mb_sleep(alloc, "weights", MB_BACKUP_HOST, &slept));
    CHECK(mb_get_stats(alloc, &stats));
    EXPECT(stats.asleep_bytes.current == slept.bytes && slept.backed_up == slept.bytes);
    EXPECT(mb_free(alloc, weights[0]) == MB_ERR_TAG_STATE);
    mb_wake_report woke;
    CHECK(mb_wake(alloc, "weights", &woke));
    EXPECT(woke.bytes == slept.bytes && woke.restored == slept.bytes);
    printf("tag \"weights\": slept %" PRIu64 " bytes (%" PRIu64 " given back to the driver), "
           "woke them at the same addresses\n",
           slept.bytes, slept.released);
    for (int i = 0; i < 2; i++) CHECK(mb_free(alloc, weights[i]));
    uint64_t host_freed = 0;
    CHECK(mb_release_host_memory(alloc, &host_freed));
    EXPECT(host_freed >= slept.bytes);

    CHECK(mb_destroy(alloc));

    /* Every option, by the keys of MOONBRIGHT_ALLOC_CONF: a bad one names itself. */
    mb_allocator *conf_alloc = NULL;
    CHECK(mb_create_conf("backend:host,host_capacity:64MiB,unmap_batch:8", &conf_alloc));
    CHECK(mb_destroy(conf_alloc));
    conf_alloc = NULL;
    EXPECT(mb_create_conf("backend:host,no_such_key:1", &conf_alloc) == MB_ERR_INVALID_ARGUMENT);
    EXPECT(conf_alloc == NULL);
    printf("bad conf: %s\n", mb_last_error());

    printf("ok\n");
    return 0;
}
