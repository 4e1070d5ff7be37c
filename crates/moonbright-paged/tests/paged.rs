//! The paged KV pool against models: after every step the tables read back from the pool's
//! memory must equal the host reference applied to the step's delta and the pool's own
//! metadata, and every token written through the slot mapping must read back through the block
//! table (which checks copy-on-write). Host backend always (proptest); CUDA backend when a GPU
//! is present (fixed seeds; skipped otherwise: counted, or a failure under
//! `MOONBRIGHT_REQUIRE_GPU=1`). Bad requests must change nothing.

use std::collections::HashMap;

use moonbright::{Allocator, BackendKind, Options, StreamHandle};
use moonbright_paged::reference::HostTables;
use moonbright_paged::{PagedConfig, PagedError, PagedPool, SeqId};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BPT: usize = 8; // bytes per token: one u64 token value

fn config() -> PagedConfig {
    PagedConfig {
        tokens_per_page: 4,
        bytes_per_token: BPT,
        max_pages: 96,
        max_seqs: 12,
        max_pages_per_seq: 10,
        max_step_tokens: 128,
    }
}

fn host_alloc() -> Allocator {
    Allocator::new(Options { cap_fraction: 1.0, ..Options::host(64 << 20, 64 << 10) }).unwrap()
}

/// A CUDA allocator and a stream, with the GPU (held to the test's end); `None` without a GPU
/// (see `moonbright::testing`).
fn cuda_alloc() -> Option<(moonbright::testing::Gpu, Allocator, StreamHandle)> {
    let gpu = moonbright::testing::gpu()?;
    let a = Allocator::new(Options {
        backend: BackendKind::Cuda,
        cap_bytes: Some(1 << 30),
        ..Options::default()
    })
    .unwrap();
    use moonbright::driver::prelude::*;
    let s = a.driver().create_stream().unwrap();
    Some((gpu, a, s))
}

#[derive(Clone, Debug)]
enum Op {
    Add(u32),
    Extend(usize, u32),
    Fork(usize),
    Truncate(usize, u32),
    Free(usize),
    Commit,
    Decode,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    op_strategy_scaled(1)
}

/// Requests with token counts `k` times those of [`op_strategy`] (for larger pages).
fn op_strategy_scaled(k: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..14 * k).prop_map(Op::Add),
        3 => (any::<usize>(), 0u32..9 * k).prop_map(|(i, n)| Op::Extend(i, n)),
        2 => any::<usize>().prop_map(Op::Fork),
        1 => (any::<usize>(), 0u32..40 * k).prop_map(|(i, n)| Op::Truncate(i, n)),
        2 => any::<usize>().prop_map(Op::Free),
        2 => Just(Op::Commit),
        4 => Just(Op::Decode),
    ]
}

fn random_ops(seed: u64, n: usize) -> Vec<Op> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| match r.gen_range(0..17) {
            0..=2 => Op::Add(r.gen_range(0..14)),
            3..=5 => Op::Extend(r.gen(), r.gen_range(0..9)),
            6..=7 => Op::Fork(r.gen()),
            8 => Op::Truncate(r.gen(), r.gen_range(0..40)),
            9..=10 => Op::Free(r.gen()),
            11..=12 => Op::Commit,
            _ => Op::Decode,
        })
        .collect()
}

/// The test's model: per live sequence, the value of each of its tokens.
struct Model {
    tokens: HashMap<SeqId, Vec<u64>>,
    order: Vec<SeqId>,
    freed: Vec<SeqId>,
    next_value: u64,
    reference: HostTables,
}

impl Model {
    fn fresh(&mut self, n: u32) -> Vec<u64> {
        (0..n)
            .map(|_| {
                self.next_value += 1;
                self.next_value
            })
            .collect()
    }
    fn pick(&self, i: usize) -> Option<SeqId> {
        if self.order.is_empty() {
            // Sometimes a freed one: its requests must be refused.
            return self.freed.get(i % self.freed.len().max(1)).copied();
        }
        if i % 7 == 0 && !self.freed.is_empty() {
            return Some(self.freed[i % self.freed.len()]);
        }
        Some(self.order[i % self.order.len()])
    }
}

/// Runs `ops` on `pool`, checking everything after every commit. Returns the commits made.
fn run(pool: &mut PagedPool<'_>, ops: &[Op]) -> usize {
    let c = pool.config().clone();
    let mut m = Model {
        tokens: HashMap::new(),
        order: Vec::new(),
        freed: Vec::new(),
        next_value: 0,
        reference: HostTables::new(c.max_seqs, c.max_pages_per_seq, c.tokens_per_page),
    };
    let mut commits = 0;
    for op in ops {
        let before = (pool.live_sequences(), pool.pages_in_use());
        let r: Result<(), PagedError> = match *op {
            Op::Add(n) => pool.add(n).map(|s| {
                let t = m.fresh(n);
                m.tokens.insert(s, t);
                m.order.push(s);
            }),
            Op::Extend(i, n) => match m.pick(i) {
                Some(s) => pool.extend(s, n).map(|_| {
                    let t = m.fresh(n);
                    m.tokens.get_mut(&s).unwrap().extend(t);
                }),
                None => Ok(()),
            },
            Op::Fork(i) => match m.pick(i) {
                Some(s) => pool.fork(s).map(|child| {
                    let t = m.tokens[&s].clone();
                    m.tokens.insert(child, t);
                    m.order.push(child);
                }),
                None => Ok(()),
            },
            Op::Truncate(i, n) => match m.pick(i) {
                Some(s) => {
                    pool.truncate(s, n).map(|_| m.tokens.get_mut(&s).unwrap().truncate(n as usize))
                }
                None => Ok(()),
            },
            Op::Free(i) => match m.pick(i) {
                Some(s) => pool.free(s).map(|_| {
                    m.tokens.remove(&s);
                    m.order.retain(|&x| x != s);
                    m.freed.push(s);
                }),
                None => Ok(()),
            },
            Op::Commit => {
                pool.commit_step().unwrap();
                Ok(())
            }
            Op::Decode => pool.decode_step().map(|_| ()).map(|_| {
                for &row in pool.batch() {
                    let s = pool.seq_at(row).unwrap();
                    m.next_value += 1;
                    let v = m.next_value;
                    m.tokens.get_mut(&s).unwrap().push(v);
                }
            }),
        };
        if let Err(e) = &r {
            // A refused request changes nothing.
            assert_eq!((pool.live_sequences(), pool.pages_in_use()), before, "{op:?}: {e}");
            assert!(
                !matches!(
                    e,
                    PagedError::Device(_) | PagedError::Poisoned(_) | PagedError::Alloc(_)
                ),
                "{e}"
            );
        }
        pool.check_invariants().unwrap_or_else(|e| panic!("after {op:?}: {e}"));
        if matches!(op, Op::Commit) || (matches!(op, Op::Decode) && r.is_ok()) {
            commits += 1;
            check_step(pool, &mut m);
        }
    }
    commits
}

fn check_step(pool: &PagedPool<'_>, m: &mut Model) {
    let c = pool.config().clone();
    let d = pool.last_delta().clone();
    m.reference.apply(&d);
    let got = pool.read_tables().unwrap();
    assert_eq!(got, m.reference, "device tables differ from the reference after {d:?}");
    // The tables agree with the pool's own metadata.
    let mm = c.max_pages_per_seq as usize;
    for row in 0..c.max_seqs {
        let r = row as usize;
        let line = &got.block_table[r * mm..(r + 1) * mm];
        match pool.seq_at(row) {
            Some(s) => {
                let pages = pool.pages(s).unwrap();
                for (k, &v) in line.iter().enumerate() {
                    assert_eq!(v, pages.get(k).map_or(-1, |&p| p as i32), "row {row} col {k}");
                }
                assert_eq!(got.seq_lens[r] as u32, pool.len(s).unwrap());
                assert_eq!(pool.len(s).unwrap() as usize, m.tokens[&s].len());
            }
            None => assert!(line.iter().all(|&v| v == -1), "free row {row}: {line:?}"),
        }
    }
    // Every page's holders, counted from the live sequences' page lists.
    let mut holders: HashMap<u32, u32> = HashMap::new();
    for row in 0..c.max_seqs {
        if let Some(s) = pool.seq_at(row) {
            for &p in pool.pages(s).unwrap() {
                *holders.entry(p).or_insert(0) += 1;
            }
        }
    }
    for p in 0..c.max_pages {
        let want = holders.get(&p).copied().unwrap_or(0);
        assert_eq!(pool.page_refs(p), want, "holders of page {p}");
    }
    let n = pool.batch().len();
    let batch: Vec<u32> = got.batch_rows[..n].iter().map(|&r| r as u32).collect();
    assert_eq!(batch, pool.batch());
    // Write this step's tokens through the slot mapping (as an attention kernel would).
    let mut slot_tokens = Vec::new();
    for run in &d.runs {
        for k in 0..run.len {
            slot_tokens.push((run.row, run.start + k));
        }
    }
    for j in 0..d.decode_rows as usize {
        let row = pool.batch()[j];
        let s = pool.seq_at(row).unwrap();
        slot_tokens.push((row, pool.len(s).unwrap() - 1));
    }
    assert_eq!(slot_tokens.len(), got.slot_mapping.len());
    let pb = c.page_bytes();
    let mut pages: HashMap<u32, Vec<u8>> = HashMap::new();
    for (&(row, pos), &slot) in slot_tokens.iter().zip(&got.slot_mapping) {
        if row == moonbright_paged::DEAD_ROW {
            assert_eq!(slot, -1);
            continue;
        }
        let Some(s) = pool.seq_at(row) else {
            assert_eq!(slot, -1, "a token of freed row {row} has a slot");
            continue;
        };
        let Some(&v) = m.tokens[&s].get(pos as usize) else {
            assert_eq!(slot, -1, "a truncated token of row {row} has a slot");
            continue;
        };
        let page = (slot / c.tokens_per_page as i64) as u32;
        assert_eq!(pool.pages(s).unwrap()[(pos / c.tokens_per_page) as usize], page);
        let buf = pages.entry(page).or_insert_with(|| pool.read_page(page).unwrap());
        let off = (slot % c.tokens_per_page as i64) as usize * BPT;
        buf[off..off + BPT].copy_from_slice(&v.to_le_bytes());
    }
    for (p, b) in &pages {
        pool.write_page(*p, b).unwrap();
    }
    // Every token of every live sequence reads back through its pages.
    for (&s, toks) in &m.tokens {
        let sp = pool.pages(s).unwrap();
        for (k, &page) in sp.iter().enumerate() {
            let bytes = pool.read_page(page).unwrap();
            for i in 0..c.tokens_per_page as usize {
                let pos = k * c.tokens_per_page as usize + i;
                if let Some(&v) = toks.get(pos) {
                    let got = u64::from_le_bytes(bytes[i * BPT..(i + 1) * BPT].try_into().unwrap());
                    assert_eq!(got, v, "seq {s} token {pos} (page {page}; {pb} bytes per page)");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn host_backend_matches_the_models(ops in proptest::collection::vec(op_strategy(), 1..120)) {
        let a = host_alloc();
        let mut pool = PagedPool::new(&a, config(), StreamHandle::DEFAULT).unwrap();
        run(&mut pool, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// Other page sizes: 1 token, a size that is not a power of two, and one above the pool's
    /// phase buckets (so that a decode step's bucket also holds rows not starting a page).
    #[test]
    fn host_backend_matches_the_models_other_page_sizes(
        (t, ops) in prop_oneof![Just(1u32), Just(3u32), Just(67u32)].prop_flat_map(|t| {
            let k = t.div_ceil(4);
            (Just(t), proptest::collection::vec(op_strategy_scaled(k), 1..120))
        })
    ) {
        let a = host_alloc();
        let cfg = PagedConfig {
            tokens_per_page: t,
            max_step_tokens: 128 * t.div_ceil(4),
            ..config()
        };
        let mut pool = PagedPool::new(&a, cfg, StreamHandle::DEFAULT).unwrap();
        run(&mut pool, &ops);
    }
}

#[test]
fn cuda_backend_matches_the_reference_after_every_step() {
    let Some((_gpu, a, s)) = cuda_alloc() else { return };
    for seed in 0..12 {
        let mut pool = match PagedPool::new(&a, config(), s) {
            Ok(p) => p,
            Err(e) => panic!("cannot create a paged pool on the GPU: {e}"),
        };
        assert!(pool.on_device());
        let commits = run(&mut pool, &random_ops(seed, 400));
        println!("seed {seed}: {commits} steps matched");
    }
    // A larger pool, decode-heavy, with arrivals and departures.
    let cfg = PagedConfig {
        tokens_per_page: 16,
        bytes_per_token: 64,
        max_pages: 40_000,
        max_seqs: 2048,
        max_pages_per_seq: 64,
        max_step_tokens: 2048 + 16384,
    };
    let mut pool = PagedPool::new(&a, cfg.clone(), s).unwrap();
    let mut r = ChaCha8Rng::seed_from_u64(99);
    let mut reference = HostTables::new(cfg.max_seqs, cfg.max_pages_per_seq, cfg.tokens_per_page);
    let mut live: Vec<SeqId> = Vec::new();
    for step in 0..200 {
        // Forks first: every live sequence's tokens are committed (see ForkOfUncommitted).
        if step % 10 == 3 && !live.is_empty() {
            let parent = live[r.gen_range(0..live.len())];
            live.push(pool.fork(parent).unwrap());
        }
        while live.len() < 1500 && r.gen_bool(0.9) {
            live.push(pool.add(r.gen_range(1..200)).unwrap());
            if live.len() % 50 == 0 {
                break;
            }
        }
        for _ in 0..r.gen_range(0..8) {
            if live.is_empty() {
                break;
            }
            let i = r.gen_range(0..live.len());
            let sq = live.swap_remove(i);
            pool.free(sq).unwrap();
        }
        pool.decode_step().unwrap();
        reference.apply(pool.last_delta());
        let got = pool.read_tables().unwrap();
        assert!(got == reference, "step {step}: device tables differ from the reference");
        for sq in live.iter_mut() {
            if pool.len(*sq).unwrap() as u64 >= cfg.max_seq_len() - 1 {
                pool.truncate(*sq, 10).unwrap();
            }
        }
    }
    println!("200 decode steps of up to 1500 sequences matched the reference");
}

fn bad_input_on(pool: &mut PagedPool<'_>) {
    let c = pool.config().clone();
    let a = pool.add(5).unwrap();
    let b = pool.add(3).unwrap();
    pool.commit_step().unwrap();
    let snapshot = |p: &PagedPool<'_>| {
        (p.live_sequences(), p.pages_in_use(), p.len(a).ok(), p.pages(a).map(|x| x.to_vec()).ok())
    };
    let quiet_commit = |p: &mut PagedPool<'_>| {
        let d = p.commit_step().unwrap();
        assert!(d.ops.is_empty() && d.runs.is_empty() && d.copies.is_empty(), "{d:?}");
    };
    let before = snapshot(pool);

    // Extending beyond a sequence's capacity.
    let e = pool.extend(a, c.max_seq_len() as u32).unwrap_err();
    assert!(matches!(e, PagedError::SequenceTooLong { .. }), "{e}");
    assert!(e.to_string().contains("cannot grow"), "{e}");
    // Beyond the pool's pages.
    let mut held = Vec::new();
    let err = loop {
        match pool.add(c.max_seq_len() as u32) {
            Ok(s) => held.push(s),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            err,
            PagedError::OutOfPages { .. }
                | PagedError::TooManySequences { .. }
                | PagedError::StepTooLarge { .. }
        ),
        "{err}"
    );
    for s in held {
        pool.free(s).unwrap();
    }
    pool.commit_step().unwrap();
    assert_eq!(snapshot(pool), before);
    quiet_commit(pool);

    // An unknown sequence.
    let e = pool.extend(SeqId(0xdead_0000_0000), 1).unwrap_err();
    assert!(matches!(e, PagedError::UnknownSequence(_)), "{e}");
    let e = pool.free(SeqId(c.max_seqs as u64 + 5)).unwrap_err();
    assert!(matches!(e, PagedError::UnknownSequence(_)), "{e}");
    // A freed one, a double free, a fork of a freed one.
    pool.free(b).unwrap();
    pool.commit_step().unwrap();
    let before = snapshot(pool);
    let e = pool.extend(b, 1).unwrap_err();
    assert!(matches!(e, PagedError::FreedSequence { op: "extend", .. }), "{e}");
    let e = pool.truncate(b, 0).unwrap_err();
    assert!(matches!(e, PagedError::FreedSequence { op: "truncate", .. }), "{e}");
    let e = pool.free(b).unwrap_err();
    assert!(matches!(e, PagedError::DoubleFree(_)), "{e}");
    let e = pool.fork(b).unwrap_err();
    assert!(matches!(e, PagedError::ForkOfFreed(_)), "{e}");
    pool.extend(a, 1).unwrap();
    let e = pool.fork(a).unwrap_err();
    assert!(matches!(e, PagedError::ForkOfUncommitted(_)), "{e}");
    pool.truncate(a, 5).unwrap();
    pool.commit_step().unwrap();
    // A row reused by a new sequence does not revive the old id.
    let c2 = pool.add(1).unwrap();
    assert_eq!(c2.row(), b.row());
    let e = pool.free(b).unwrap_err();
    assert!(matches!(e, PagedError::DoubleFree(_)), "{e}");
    pool.free(c2).unwrap();
    pool.commit_step().unwrap();
    // A truncation that lengthens.
    let e = pool.truncate(a, 6).unwrap_err();
    assert!(matches!(e, PagedError::BadTruncate { .. }), "{e}");
    assert_eq!(snapshot(pool), before);
    quiet_commit(pool);
    // Decode at capacity refuses the whole step and changes nothing.
    pool.extend(a, c.max_seq_len() as u32 - 5).unwrap();
    pool.commit_step().unwrap();
    let before = snapshot(pool);
    let e = pool.decode_step().unwrap_err();
    assert!(matches!(e, PagedError::SequenceTooLong { .. }), "{e}");
    assert_eq!(snapshot(pool), before);
    quiet_commit(pool);
    pool.check_invariants().unwrap();
}

#[test]
fn bad_input_is_refused_and_changes_nothing_host() {
    let a = host_alloc();
    let mut pool = PagedPool::new(&a, config(), StreamHandle::DEFAULT).unwrap();
    bad_input_on(&mut pool);
}

#[test]
fn bad_input_is_refused_and_changes_nothing_cuda() {
    let Some((_gpu, a, s)) = cuda_alloc() else { return };
    let mut pool = PagedPool::new(&a, config(), s).unwrap();
    bad_input_on(&mut pool);
}

/// A commit on a stream being captured into a CUDA graph is refused before anything changes;
/// after the capture the same step commits.
#[test]
fn commits_on_a_capturing_stream_are_refused() {
    let a = host_alloc();
    let s = {
        use moonbright::driver::prelude::*;
        a.driver().create_stream().unwrap()
    };
    let mut pool = PagedPool::new(&a, config(), s).unwrap();
    let x = pool.add(5).unwrap();
    pool.commit_step().unwrap();
    let y = pool.add(3).unwrap();
    let tables = pool.read_tables().unwrap();
    let host = a.driver().inner().as_host().unwrap();
    host.begin_capture(s);
    let refused = PagedError::StreamCapture { stream: s.0 };
    assert_eq!(pool.decode_step().unwrap_err().to_string(), refused.to_string());
    assert_eq!(pool.commit_step().unwrap_err().to_string(), refused.to_string());
    assert_eq!((pool.len(x).unwrap(), pool.len(y).unwrap()), (5, 3));
    host.end_capture(s);
    assert_eq!(pool.read_tables().unwrap(), tables, "nothing reached the tables");
    assert_eq!(pool.decode_step().unwrap().step_tokens(), 3 + 2);
    assert_eq!((pool.len(x).unwrap(), pool.len(y).unwrap()), (6, 4));
    pool.check_invariants().unwrap();
}

/// A pool that cannot be made (an injected driver failure at any call of pool creation, or
/// too little memory) gives back everything it took: tables, counters and page reservation.
#[test]
fn failed_creation_leaves_nothing_behind() {
    use moonbright::CallKind;
    let a = host_alloc();
    let kept = a.malloc(4096).unwrap(); // something allocated before stays as it was
    let base = (a.stats().allocated_bytes.current, a.stats().reserved_bytes.current);
    let mut failures = 0;
    for kind in
        [CallKind::Reserve, CallKind::Create, CallKind::Map, CallKind::SetAccess, CallKind::Copy]
    {
        for nth in 1..=6 {
            a.driver().fail_nth(kind, nth, None);
            match PagedPool::new(&a, config(), StreamHandle::DEFAULT) {
                Ok(pool) => drop(pool),
                Err(e) => {
                    failures += 1;
                    assert!(e.to_string().contains("injected failure"), "{kind:?} #{nth}: {e}");
                }
            }
            a.driver().clear_failures();
            a.flush().unwrap();
            a.check_invariants().unwrap();
            assert_eq!(a.stats().allocated_bytes.current, base.0, "{kind:?} #{nth}");
        }
    }
    assert!(failures >= 5, "only {failures} creations failed: the injections missed");
    // Out of memory: a block table larger than the cap.
    let big = PagedConfig { max_seqs: 4096, max_pages_per_seq: 4096, ..config() };
    let e = PagedPool::new(&a, big, StreamHandle::DEFAULT).unwrap_err();
    assert!(matches!(e, PagedError::Alloc(moonbright::Error::OutOfMemory { .. })), "{e}");
    assert_eq!(a.stats().allocated_bytes.current, base.0);
    // And the allocator goes on.
    PagedPool::new(&a, config(), StreamHandle::DEFAULT).unwrap();
    a.free(kept).unwrap();
}

#[test]
fn bad_configs_are_refused() {
    let a = host_alloc();
    for bad in [
        PagedConfig { tokens_per_page: 0, ..config() },
        PagedConfig { max_seqs: 0, ..config() },
        PagedConfig { max_seqs: 1 << 20, max_pages_per_seq: 1 << 12, ..config() },
    ] {
        let e = PagedPool::new(&a, bad, StreamHandle::DEFAULT).unwrap_err();
        assert!(matches!(e, PagedError::InvalidConfig(_)), "{e}");
    }
}

#[test]
fn pages_go_lowest_first_and_the_tail_is_released() {
    let a = host_alloc();
    let cfg = PagedConfig { bytes_per_token: 4096, max_pages: 256, ..config() };
    let mut pool = PagedPool::new(&a, cfg, StreamHandle::DEFAULT).unwrap();
    let s: Vec<SeqId> = (0..8)
        .map(|_| {
            let q = pool.add(40).unwrap();
            pool.commit_step().unwrap();
            q
        })
        .collect();
    assert_eq!(pool.pages(s[0]).unwrap(), &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    let grown = pool.committed_bytes();
    assert!(grown >= 80 * 16384);
    for &q in &s[1..] {
        pool.free(q).unwrap();
    }
    pool.commit_step().unwrap();
    let released = pool.shrink().unwrap();
    assert!(released > 0 && pool.committed_bytes() < grown, "{released}");
    let t = pool.add(4).unwrap();
    assert_eq!(pool.pages(t).unwrap(), &[10]);
    pool.check_invariants().unwrap();
}
