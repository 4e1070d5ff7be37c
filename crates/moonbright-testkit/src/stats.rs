//! Sample summaries for the benchmarks and measurements, built on the one nearest-rank
//! percentile ([`quantile`], which lives with the replay's report in `moonbright-trace`).

pub use moonbright_trace::quantile;

/// p50, p99, mean, min and max of a sample, in the sample's unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// Summarises `xs` (nearest-rank percentiles); all zeroes when empty.
    pub fn of(xs: &[f64]) -> Summary {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let (Some(&min), Some(&max)) = (v.first(), v.last()) else {
            return Summary::default();
        };
        let pct = |q| quantile(&v, q).unwrap_or(0.0);
        Summary {
            n: v.len(),
            p50: pct(0.5),
            p99: pct(0.99),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min,
            max,
        }
    }
}

/// The median of `xs` (nearest rank: the lower middle of an even count); 0 when empty.
pub fn median<T: Copy + PartialOrd + Default>(xs: &[T]) -> T {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    quantile(&v, 0.5).unwrap_or_default()
}

/// Microseconds since `t`.
pub fn us_since(t: std::time::Instant) -> f64 {
    t.elapsed().as_nanos() as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&xs);
        assert_eq!((s.p50, s.p99, s.min, s.max), (50.0, 99.0, 1.0, 100.0));
        assert_eq!(Summary::of(&[7.0]).p99, 7.0);
        assert_eq!(Summary::of(&[]).n, 0);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3u64, 1, 2]), 2);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.0);
        assert_eq!(median::<u64>(&[]), 0);
    }
}
