//! Percentiles and timing helpers.

use serde::Serialize;

/// p50, p99, mean, min and max of a sample, in the sample's unit.
#[derive(Clone, Copy, Debug, Default, Serialize)]
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
        if xs.is_empty() {
            return Summary::default();
        }
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Summary {
            n: v.len(),
            p50: pct(50.0),
            p99: pct(99.0),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            max: v[v.len() - 1],
        }
    }
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
}
