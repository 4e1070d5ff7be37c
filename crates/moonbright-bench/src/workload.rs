//! The fragmentation stress as a deterministic function of a seed: `ops` operations,
//! sizes log-uniform in [min, max], each free picking a uniformly random live allocation (random
//! lifetimes), and live bytes held around `live_target`.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One operation of the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes as allocation `id`.
    Alloc { id: u32, size: u64 },
    /// Free allocation `id` (of `size` bytes).
    Free { id: u32, size: u64 },
}

/// The parameters of the stress.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct StressSpec {
    pub seed: u64,
    pub ops: usize,
    pub min: u64,
    pub max: u64,
    pub live_target: u64,
}

impl StressSpec {
    /// The benchmark's stress at `seed`: 20,000 operations, sizes log-uniform from 1 KiB to
    /// 512 MiB, about 60 GiB live.
    pub fn issue3(seed: u64) -> Self {
        StressSpec { seed, ops: 20_000, min: 1 << 10, max: 512 << 20, live_target: 60 << 30 }
    }
}

/// The sequence, and the peak of live requested bytes along it.
pub fn stress_ops(spec: &StressSpec) -> (Vec<Op>, u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let (lo, hi) = ((spec.min as f64).ln(), (spec.max as f64).ln());
    let mut live: Vec<(u32, u64)> = Vec::new();
    let (mut live_bytes, mut peak, mut next_id) = (0u64, 0u64, 0u32);
    let mut ops = Vec::with_capacity(spec.ops);
    while ops.len() < spec.ops {
        let below = live_bytes < spec.live_target;
        let alloc = live.is_empty() || rng.gen_bool(if below { 0.9 } else { 0.1 });
        if alloc {
            let size = (rng.gen_range(lo..hi).exp() as u64).clamp(spec.min, spec.max);
            ops.push(Op::Alloc { id: next_id, size });
            live.push((next_id, size));
            next_id += 1;
            live_bytes += size;
            peak = peak.max(live_bytes);
        } else {
            let (id, size) = live.swap_remove(rng.gen_range(0..live.len()));
            live_bytes -= size;
            ops.push(Op::Free { id, size });
        }
    }
    (ops, peak)
}

/// The sequence as CSV: `op,id,size` with op `a` (allocate) or `f` (free).
pub fn to_csv(ops: &[Op]) -> String {
    let mut s = String::from("op,id,size\n");
    for op in ops {
        match op {
            Op::Alloc { id, size } => s.push_str(&format!("a,{id},{size}\n")),
            Op::Free { id, size } => s.push_str(&format!("f,{id},{size}\n")),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_near_target() {
        let spec = StressSpec::issue3(7);
        let (a, pa) = stress_ops(&spec);
        let (b, pb) = stress_ops(&spec);
        assert_eq!(a, b);
        assert_eq!(pa, pb);
        assert_eq!(a.len(), 20_000);
        assert!(pa > 59 << 30 && pa < 64 << 30, "peak {pa}");
        let allocs = a.iter().filter(|o| matches!(o, Op::Alloc { .. })).count();
        assert!(allocs > 9_000, "{allocs} allocations");
        assert!(to_csv(&a[..2]).starts_with("op,id,size\na,0,"));
    }
}
