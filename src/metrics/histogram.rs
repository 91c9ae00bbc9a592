//! The histograms a response's path records into: fixed buckets counted
//! with relaxed atomic adds, rendered into `/metrics` after the exporter's
//! series.
//!
//! The exporter's histograms keep every sample with the time it was
//! recorded (`metrics-exporter-prometheus`' `AtomicBucketInstant`: a clock
//! read and a slot in a list of blocks per sample) until the upkeep thread
//! folds them into buckets every 5 s. A response recorded two (its size
//! and its push latency): two clock reads, a block allocated per 64
//! samples, and the upkeep's walk of them all, about 700 instructions a
//! response in `mcp-load --scenario eds` (BENCHMARKS, session 42). Here a
//! sample is a bucket found among at most 16 bounds and two adds: the
//! bucket's count and the sum, both in whole units (bytes, nanoseconds),
//! so no float is added atomically.
//!
//! A family's series are registered once (a collection's, when its
//! metrics are made) and shared, like the exporter's: every gateway in
//! one process (the integration tests run many) records into the same
//! series, as it does into the exporter's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// One histogram family: its name, help, bounds and series by label set.
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    /// The buckets' upper bounds (`le`), in whole units, ascending.
    bounds: &'static [u64],
    /// Whole units in one of the family's unit (nanoseconds in a second:
    /// 1e9; bytes: 1).
    per_unit: f64,
    series: Mutex<BTreeMap<LabelSet, Arc<Buckets>>>,
}

/// A series' labels, names and values, in the order they are written.
type LabelSet = Vec<(&'static str, String)>;

/// One series: a count per bound, one past the last bound (`+Inf`), and
/// the sum of what was recorded, in whole units.
#[derive(Debug)]
pub struct Buckets {
    bounds: &'static [u64],
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
}

impl Buckets {
    /// Counts `value` (whole units) in the first bucket whose bound it does
    /// not exceed, or in `+Inf`.
    #[inline]
    pub fn record(&self, value: u64) {
        let bucket = self.bounds.partition_point(|&bound| bound < value);
        if let Some(count) = self.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        self.sum.fetch_add(value, Ordering::Relaxed);
    }
}

impl Family {
    pub const fn new(name: &'static str, help: &'static str, bounds: &'static [u64], per_unit: f64) -> Self {
        Family {
            name,
            help,
            bounds,
            per_unit,
            series: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series of these labels (in this order), made at the first ask.
    pub fn series(&self, labels: &[(&'static str, &str)]) -> Arc<Buckets> {
        let key: LabelSet = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        let mut series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        series
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Buckets {
                    bounds: self.bounds,
                    counts: (0..=self.bounds.len()).map(|_| AtomicU64::new(0)).collect(),
                    sum: AtomicU64::new(0),
                })
            })
            .clone()
    }

    /// The family in Prometheus' text format (`# HELP`, `# TYPE`, then each
    /// series' cumulative buckets, sum and count), each series with
    /// `global` labels after its own; nothing when it has no series.
    pub fn render(&self, global: &[(&str, &str)], out: &mut String) {
        let series = self.series.lock().unwrap_or_else(PoisonError::into_inner);
        if series.is_empty() {
            return;
        }
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} histogram", self.name);
        for (labels, buckets) in series.iter() {
            let mut set = String::new();
            let pairs = labels
                .iter()
                .map(|(k, v)| (*k, v.as_str()))
                .chain(global.iter().copied());
            for (i, (key, value)) in pairs.enumerate() {
                if i > 0 {
                    set.push(',');
                }
                let _ = write!(set, "{key}=\"{}\"", escaped(value));
            }
            let comma = if set.is_empty() { "" } else { "," };
            let mut cumulative = 0u64;
            for (i, count) in buckets.counts.iter().enumerate() {
                cumulative += count.load(Ordering::Relaxed);
                match self.bounds.get(i) {
                    Some(&bound) => {
                        let le = bound as f64 / self.per_unit;
                        let _ = writeln!(out, "{}_bucket{{{set}{comma}le=\"{le}\"}} {cumulative}", self.name);
                    }
                    None => {
                        let _ = writeln!(out, "{}_bucket{{{set}{comma}le=\"+Inf\"}} {cumulative}", self.name);
                    }
                }
            }
            let sum = buckets.sum.load(Ordering::Relaxed) as f64 / self.per_unit;
            let braces = |s: &str| {
                if s.is_empty() {
                    String::new()
                } else {
                    format!("{{{s}}}")
                }
            };
            let _ = writeln!(out, "{}_sum{} {sum}", self.name, braces(&set));
            let _ = writeln!(out, "{}_count{} {cumulative}", self.name, braces(&set));
        }
    }
}

/// A label value as the text format writes it: `\`, `"` and newlines
/// escaped.
fn escaped(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '"', '\n']) {
        return value.into();
    }
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[u64] = &[10, 100, 1_000];

    /// A value counts in the first bucket whose bound it does not exceed
    /// (a bound is inclusive, as `le` says), past the last in `+Inf`; the
    /// rendering is cumulative, with the sum and count in the family's unit
    /// and the global labels after the series' own.
    #[test]
    fn values_count_in_the_first_bucket_they_do_not_exceed_and_render_cumulatively() {
        static FAMILY: Family = Family::new("t_seconds", "A test.", BOUNDS, 1e3);
        let series = FAMILY.series(&[("collection", "a\"b")]);
        for value in [0, 10, 11, 100, 1_000, 1_001, u64::from(u32::MAX)] {
            series.record(value);
        }
        // The same labels are the same series.
        FAMILY.series(&[("collection", "a\"b")]).record(5);
        let mut text = String::new();
        FAMILY.render(&[("demo", "true")], &mut text);
        let expected = "# HELP t_seconds A test.\n\
             # TYPE t_seconds histogram\n\
             t_seconds_bucket{collection=\"a\\\"b\",demo=\"true\",le=\"0.01\"} 3\n\
             t_seconds_bucket{collection=\"a\\\"b\",demo=\"true\",le=\"0.1\"} 5\n\
             t_seconds_bucket{collection=\"a\\\"b\",demo=\"true\",le=\"1\"} 6\n\
             t_seconds_bucket{collection=\"a\\\"b\",demo=\"true\",le=\"+Inf\"} 8\n\
             t_seconds_sum{collection=\"a\\\"b\",demo=\"true\"} 4294969.422\n\
             t_seconds_count{collection=\"a\\\"b\",demo=\"true\"} 8\n";
        assert_eq!(text, expected);
    }

    /// A family none recorded into renders nothing (no `# HELP` without a
    /// series); one without labels renders its lines without braces but
    /// `le`'s.
    #[test]
    fn an_empty_family_renders_nothing_and_one_without_labels_no_empty_braces() {
        static EMPTY: Family = Family::new("t_empty", "None.", BOUNDS, 1.0);
        let mut text = String::new();
        EMPTY.render(&[], &mut text);
        assert_eq!(text, "");
        static BARE: Family = Family::new("t_bytes", "Bare.", &[4], 1.0);
        BARE.series(&[]).record(3);
        BARE.render(&[], &mut text);
        assert_eq!(
            text,
            "# HELP t_bytes Bare.\n# TYPE t_bytes histogram\nt_bytes_bucket{le=\"4\"} 1\nt_bytes_bucket{le=\"+Inf\"} 1\n\
             t_bytes_sum 3\nt_bytes_count 1\n"
        );
    }
}
