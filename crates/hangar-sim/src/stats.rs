//! Summary statistics of latency samples.
//!
//! Percentiles use the nearest-rank rule of Dynamo's replay report — the
//! sample at rank `round((n − 1) · p / 100)` of the sorted values — so the
//! two reports read alike. Per-request figures are kept exactly; inter-token
//! gaps, of which a replay has millions, go into a [`LogHistogram`] whose
//! percentiles are within 0.05 % of the exact ones.

use serde::Serialize;

/// mean, min, max, percentiles and (population) standard deviation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct Stats {
    /// Number of samples.
    pub count: u64,
    /// Arithmetic mean.
    pub mean: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Median.
    pub p50: f64,
    /// 75th percentile.
    pub p75: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Population standard deviation.
    pub std: f64,
}

/// The percentiles every [`Stats`] reports, in field order.
const PERCENTILES: [f64; 5] = [50.0, 75.0, 90.0, 95.0, 99.0];

fn rank(n: u64, p: f64) -> u64 {
    ((n - 1) as f64 * p / 100.0).round() as u64
}

impl Stats {
    /// Exact statistics of `values`; all zero when empty.
    pub fn exact(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len() as u64;
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let [p50, p75, p90, p95, p99] = PERCENTILES.map(|p| values[rank(n, p) as usize]);
        Self {
            count: n,
            mean,
            min: values[0],
            max: values[values.len() - 1],
            p50,
            p75,
            p90,
            p95,
            p99,
            std: var.sqrt(),
        }
    }
}

/// A histogram with logarithmic buckets about 0.1 % wide, plus exact count, sum,
/// sum of squares, min and max. Memory is fixed whatever the sample count.
#[derive(Debug, Clone)]
pub struct LogHistogram {
    buckets: Vec<u64>,
    zeros: u64,
    count: u64,
    sum: f64,
    sum_sq: f64,
    min: f64,
    max: f64,
}

/// Samples below this are counted as zero (ms).
const FLOOR: f64 = 1e-6;
/// `1 / FLOOR`, so the hot path multiplies instead of dividing.
const INV_FLOOR: f64 = 1e6;
/// Mantissa bits kept in a bucket index: 2^10 buckets per power of two, so
/// a bucket spans at most 0.1 % of its values.
const MANTISSA_BITS: u32 = 10;

/// The bucket of a positive sample: its f64 exponent and top mantissa bits,
/// which order like the value itself (a logarithm without calling `ln`).
fn bucket_of(v: f64) -> usize {
    ((v * INV_FLOOR).to_bits() >> (52 - MANTISSA_BITS)) as usize - BASE
}

/// The bucket index of `FLOOR` itself (exponent of 1.0, mantissa 0).
const BASE: usize = (1023usize) << MANTISSA_BITS;

/// The middle of a bucket's range.
fn bucket_mid(i: usize) -> f64 {
    let lo = f64::from_bits(((i + BASE) as u64) << (52 - MANTISSA_BITS));
    let hi = f64::from_bits(((i + BASE + 1) as u64) << (52 - MANTISSA_BITS));
    FLOOR * (lo + hi) / 2.0
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self { buckets: Vec::new(), zeros: 0, count: 0, sum: 0.0, sum_sq: 0.0, min: f64::INFINITY, max: 0.0 }
    }
}

impl LogHistogram {
    /// Adds one non-negative sample.
    pub fn add(&mut self, v: f64) {
        self.add_many(v, 1);
    }

    /// Adds `n` samples of the non-negative value `v`: exactly what `n`
    /// calls of [`add`](Self::add) do, sums included, with the bucket found
    /// once. A replay's inter-token gaps come in such runs (a pass's decode
    /// tokens mostly share theirs).
    pub fn add_many(&mut self, v: f64, n: u64) {
        if n == 0 {
            return;
        }
        self.count += n;
        for _ in 0..n {
            // One at a time: the totals must round as repeated adds do.
            self.sum += v;
            self.sum_sq += v * v;
        }
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        if v < FLOOR {
            self.zeros += n;
            return;
        }
        let i = bucket_of(v);
        if self.buckets.len() <= i {
            self.buckets.resize(i + 1, 0);
        }
        self.buckets[i] += n;
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &LogHistogram) {
        self.count += other.count;
        self.sum += other.sum;
        self.sum_sq += other.sum_sq;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.zeros += other.zeros;
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
    }

    /// Summary statistics; percentiles are bucket midpoints clamped to the
    /// exact min and max.
    pub fn stats(&self) -> Stats {
        if self.count == 0 {
            return Stats::default();
        }
        let n = self.count;
        let mean = self.sum / n as f64;
        let var = (self.sum_sq / n as f64 - mean * mean).max(0.0);
        let [p50, p75, p90, p95, p99] = PERCENTILES.map(|p| self.value_at_rank(rank(n, p)));
        Stats { count: n, mean, min: self.min, max: self.max, p50, p75, p90, p95, p99, std: var.sqrt() }
    }

    fn value_at_rank(&self, r: u64) -> f64 {
        if r < self.zeros {
            return self.min;
        }
        let mut seen = self.zeros;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen > r {
                return bucket_mid(i).clamp(self.min, self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_stats_use_nearest_rank() {
        let s = Stats::exact((1..=101).map(f64::from).collect());
        assert_eq!((s.count, s.min, s.max, s.mean), (101, 1.0, 101.0, 51.0));
        assert_eq!((s.p50, s.p90, s.p99), (51.0, 91.0, 100.0));
        assert!((s.std - (850.0f64).sqrt()).abs() < 1e-9);
        assert_eq!(Stats::exact(vec![]), Stats::default());
    }

    #[test]
    fn histogram_percentiles_are_within_a_tenth_of_a_percent() {
        let values: Vec<f64> = (0..10_000).map(|i| 5.0 + (i as f64 * 0.37) % 50.0).collect();
        let mut h = LogHistogram::default();
        values.iter().for_each(|&v| h.add(v));
        h.add(0.0);
        let mut with_zero = values.clone();
        with_zero.push(0.0);
        let (a, e) = (h.stats(), Stats::exact(with_zero));
        for (x, y) in [(a.p50, e.p50), (a.p90, e.p90), (a.p99, e.p99)] {
            assert!((x - y).abs() / y < 1e-3, "{x} vs {y}");
        }
        assert!((a.mean - e.mean).abs() < 1e-9 && (a.std - e.std).abs() < 1e-6);
        assert_eq!((a.min, a.max), (e.min, e.max));
    }

    #[test]
    fn runs_of_a_value_add_up_as_single_samples_do() {
        let samples = [0.0, 3.7, 3.7, 3.7, 0.1, 12.25, 12.25, 3.7];
        let mut one_by_one = LogHistogram::default();
        samples.iter().for_each(|&v| one_by_one.add(v));
        let mut runs = LogHistogram::default();
        for (v, n) in [(0.0, 1), (3.7, 3), (0.1, 1), (12.25, 0), (12.25, 2), (3.7, 1)] {
            runs.add_many(v, n);
        }
        assert_eq!(runs.stats(), one_by_one.stats());
        assert_eq!(
            (runs.sum.to_bits(), runs.sum_sq.to_bits()),
            (one_by_one.sum.to_bits(), one_by_one.sum_sq.to_bits())
        );
        assert_eq!(runs.buckets, one_by_one.buckets);
    }
}
