//! Summary statistics of repeated measurements.

use serde::Serialize;

/// p50, p90 and min of a set of samples, with the samples themselves.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub p50: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

/// The nearest-rank percentile `p` (0..=100) of `sorted` (ascending): the smallest
/// sample with at least p% of the samples at or below it. `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let index = rank.clamp(1, sorted.len()) - 1;
    sorted.get(index).copied()
}

/// Summarises `samples`; `None` when there are none (or any is NaN).
pub fn summarize(samples: &[f64]) -> Option<Summary> {
    if samples.iter().any(|s| s.is_nan()) {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(Summary {
        p50: percentile(&sorted, 50.0)?,
        p90: percentile(&sorted, 90.0)?,
        min: *sorted.first()?,
        max: *sorted.last()?,
        samples: samples.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let sorted: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 50.0), Some(5.0));
        assert_eq!(percentile(&sorted, 90.0), Some(9.0));
        assert_eq!(percentile(&sorted, 100.0), Some(10.0));
        assert_eq!(percentile(&sorted, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 90.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn summary_sorts_but_keeps_sample_order() {
        let s = summarize(&[3.0, 1.0, 2.0]).expect("three samples");
        assert_eq!((s.p50, s.p90, s.min, s.max), (2.0, 3.0, 1.0, 3.0));
        assert_eq!(s.samples, vec![3.0, 1.0, 2.0]);
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[1.0, f64::NAN]).is_none());
    }
}
