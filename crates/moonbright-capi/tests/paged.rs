//! The paged pool's C API on the host backend: a decode loop whose tables read back right, and
//! every bad request refused with its status, its message, and no change.

use std::ffi::CStr;
use std::ptr;

use moonbright_capi::*;

fn last_error() -> String {
    // SAFETY: `mb_last_error` returns a valid NUL-terminated string, never NULL.
    unsafe { CStr::from_ptr(mb_last_error()) }.to_str().unwrap().to_owned()
}

fn config() -> mb_paged_config {
    mb_paged_config {
        tokens_per_page: 4,
        bytes_per_token: 16,
        max_pages: 32,
        max_seqs: 4,
        max_pages_per_seq: 6,
        max_step_tokens: 64,
    }
}

#[test]
fn decode_loop_and_bad_requests() {
    // SAFETY: every pointer passed is NULL where the test means it, else a live local or a
    // live handle; the table addresses are host memory on the host backend, read while the
    // pool lives.
    unsafe {
        let mut o = mb_options::default();
        mb_options_default(&mut o);
        o.backend = MB_BACKEND_HOST;
        o.host_capacity = 64 << 20;
        o.host_page_size = 64 << 10;
        let mut a = ptr::null_mut();
        assert_eq!(mb_create(&o, &mut a), MB_OK, "{}", last_error());
        let mut p = ptr::null_mut();
        let cfg = config();
        assert_eq!(mb_paged_create(a, &cfg, ptr::null_mut(), &mut p), MB_OK, "{}", last_error());
        let mut s0 = 0u64;
        let mut s1 = 0u64;
        assert_eq!(mb_paged_add(p, 5, &mut s0), MB_OK);
        assert_eq!(mb_paged_add(p, 3, &mut s1), MB_OK);
        let mut tokens = 0u32;
        assert_eq!(mb_paged_commit(p, &mut tokens), MB_OK);
        assert_eq!(tokens, 8);
        assert_eq!(mb_paged_decode_step(p, &mut tokens), MB_OK);
        assert_eq!(tokens, 2);
        let mut t = mb_paged_tables::default();
        assert_eq!(mb_paged_get_tables(p, &mut t), MB_OK);
        let m = cfg.max_pages_per_seq as usize;
        let bt = std::slice::from_raw_parts(t.block_table as *const i32, 4 * m);
        let lens = std::slice::from_raw_parts(t.seq_lens as *const i32, 4);
        let slots = std::slice::from_raw_parts(t.slot_mapping as *const i64, 2);
        assert_eq!(&bt[..m], &[0, 1, -1, -1, -1, -1]);
        assert_eq!(&bt[m..2 * m], &[2, -1, -1, -1, -1, -1]);
        assert_eq!(&lens[..2], &[6, 4]);
        assert_eq!(slots, &[5, 11]); // token 5 of seq 0 (page 1), token 3 of seq 1 (page 2)
        let mut fork = 0u64;
        assert_eq!(mb_paged_fork(p, s1, &mut fork), MB_OK);
        let mut row = 0u32;
        assert_eq!(mb_paged_row(p, fork, &mut row), MB_OK);
        assert_eq!(row, 2);

        // Bad requests: status, message, and nothing changed.
        let mut len = 0u32;
        assert_eq!(mb_paged_extend(p, s0, 1000), MB_ERR_CAPACITY);
        assert!(last_error().contains("cannot grow"), "{}", last_error());
        assert_eq!(mb_paged_len(p, s0, &mut len), MB_OK);
        assert_eq!(len, 6);
        assert_eq!(mb_paged_extend(p, 0xdead << 32, 1), MB_ERR_UNKNOWN_SEQUENCE);
        assert_eq!(mb_paged_free(p, s1), MB_OK);
        assert_eq!(mb_paged_free(p, s1), MB_ERR_FREED_SEQUENCE);
        assert!(last_error().contains("double free"), "{}", last_error());
        assert_eq!(mb_paged_fork(p, s1, &mut fork), MB_ERR_FREED_SEQUENCE);
        assert_eq!(mb_paged_extend(p, s1, 1), MB_ERR_FREED_SEQUENCE);
        assert_eq!(mb_paged_truncate(p, s0, 7), MB_ERR_INVALID_REQUEST);
        assert_eq!(mb_paged_len(p, s0, &mut len), MB_OK);
        assert_eq!(len, 6);
        assert_eq!(mb_paged_add(p, 1, ptr::null_mut()), MB_ERR_INVALID_ARGUMENT);
        assert_eq!(mb_paged_add(ptr::null_mut(), 1, &mut s1), MB_ERR_INVALID_ARGUMENT);
        let mut bad = config();
        bad.tokens_per_page = 0;
        let mut q = ptr::null_mut();
        assert_eq!(mb_paged_create(a, &bad, ptr::null_mut(), &mut q), MB_ERR_INVALID_ARGUMENT);
        assert!(q.is_null());
        assert_eq!(mb_paged_commit(p, ptr::null_mut()), MB_OK);
        let mut released = 0u64;
        assert_eq!(mb_paged_shrink(p, &mut released), MB_OK);
        assert_eq!(
            CStr::from_ptr(mb_status_string(MB_ERR_CAPACITY)).to_str().unwrap(),
            "capacity exceeded"
        );
        assert_eq!(mb_paged_destroy(p), MB_OK);
        assert_eq!(mb_destroy(a), MB_OK);
    }
}
