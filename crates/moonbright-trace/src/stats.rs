//! Percentiles: the one nearest-rank quantile that the replay's report, the `moonbright`
//! command, the benchmarks and the tests use.

/// The `q`-quantile (0..=1) of samples sorted in ascending order, by nearest rank: the smallest
/// sample with at least `q` of them at or below it (the first for `q` = 0); `None` when empty.
pub fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.saturating_sub(1).min(sorted.len() - 1)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), Some(50));
        assert_eq!(quantile(&v, 0.99), Some(99));
        assert_eq!(quantile(&v, 1.0), Some(100));
        assert_eq!(quantile(&v, 0.0), Some(1));
        assert_eq!(quantile::<u64>(&[], 0.5), None);
    }
    #[test]
    fn quantiles_of_floats() {
        let v = [1.5, 2.5, 3.5];
        assert_eq!(quantile(&v, 0.5), Some(2.5));
        assert_eq!(quantile(&v, 0.99), Some(3.5));
    }
}
