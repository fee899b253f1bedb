//! The timing harness of the workspace's benchmarks (`cargo bench -p amp-kernels`, `cargo bench --bench
//! optimizer_step`): cases are timed interleaved, A, B, C, ... in every round, so that load from other
//! processes on a shared machine falls on all of them alike, and each case reports the median of its
//! rounds. Warm-up rounds (pages faulted in, caches filled) are timed but not kept.

use std::time::Instant;

/// Interleaved timings of a fixed list of cases.
#[derive(Clone, Debug)]
pub struct Interleaved {
    seconds: Vec<Vec<f64>>,
    warmup_rounds: usize,
    rounds_started: usize,
}

impl Interleaved {
    /// A harness for `cases` cases that discards its first `warmup_rounds` rounds.
    pub fn new(cases: usize, warmup_rounds: usize) -> Self {
        Interleaved { seconds: vec![Vec::new(); cases], warmup_rounds, rounds_started: 0 }
    }

    /// Starts a round: time each case once with [`Round::time`], in the same order every round.
    pub fn round(&mut self) -> Round<'_> {
        self.rounds_started += 1;
        let keep = self.rounds_started > self.warmup_rounds;
        Round { harness: self, next_case: 0, keep }
    }

    /// The kept times of case `case`, in seconds.
    pub fn seconds(&self, case: usize) -> &[f64] {
        &self.seconds[case]
    }

    /// The median of case `case`, in seconds (NaN before any kept round).
    pub fn median_s(&self, case: usize) -> f64 {
        median(&self.seconds[case])
    }

    /// The fastest round of case `case`, in seconds.
    pub fn min_s(&self, case: usize) -> f64 {
        self.seconds[case].iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// One round of an [`Interleaved`] harness.
#[derive(Debug)]
pub struct Round<'a> {
    harness: &'a mut Interleaved,
    next_case: usize,
    keep: bool,
}

impl Round<'_> {
    /// Times `f` as the round's next case; returns what `f` returns.
    pub fn time<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let out = f();
        let seconds = start.elapsed().as_secs_f64();
        if self.keep {
            self.harness.seconds[self.next_case].push(seconds);
        }
        self.next_case += 1;
        out
    }

    /// Times `f` as the round's next case, unless `f` returns a time of its own in seconds, which is
    /// kept instead: a case that runs in another process times itself there, leaving the round trip out.
    pub fn time_unless_reported(&mut self, f: impl FnOnce() -> Option<f64>) {
        let start = Instant::now();
        let reported = f();
        let seconds = reported.unwrap_or_else(|| start.elapsed().as_secs_f64());
        if self.keep {
            self.harness.seconds[self.next_case].push(seconds);
        }
        self.next_case += 1;
    }

    /// Skips the round's next case (a slow case timed only every few rounds).
    pub fn skip(&mut self) {
        self.next_case += 1;
    }
}

/// The median of `values` (the upper one of an even count; NaN when empty).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_rounds_are_dropped_and_cases_keep_their_order() {
        let mut harness = Interleaved::new(3, 1);
        for round in 0..4 {
            let mut r = harness.round();
            assert_eq!(r.time(|| round), round);
            if round % 2 == 0 {
                r.skip();
            } else {
                r.time(|| ());
            }
            r.time(|| ());
        }
        assert_eq!([0, 1, 2].map(|c| harness.seconds(c).len()), [3, 2, 3]);
        let mut r = harness.round();
        r.time_unless_reported(|| Some(42.0));
        r.time_unless_reported(|| None);
        assert_eq!(harness.seconds(0).last(), Some(&42.0), "a reported time is kept as it is");
        assert!(harness.seconds(1).last().is_some_and(|&s| s < 1.0), "an unreported one is timed");
        assert!(harness.min_s(0) <= harness.median_s(0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert!(median(&[]).is_nan());
    }
}
