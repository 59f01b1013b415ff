//! Mixing weights: how often each source's records are drawn in an epoch.
//!
//! A source is one of the paths (or globs) given, with all its files. With weight `w = k + f` (`k` whole,
//! `0 <= f < 1`) and `n` records (those of the split, after dedup: held-out records are never drawn), an epoch
//! draws every record `k` times and, without replacement, `round(f * n)` records more: `k * n + round(f * n)`
//! records, the same count every epoch, each record `k` or `k + 1` times (weight 3: each record three times;
//! 0.5: half of the records, another half each epoch). Which records the fraction takes comes from `(seed,
//! epoch, source)` alone, so an epoch's draw is the same on every rank and for every world size (the plan shuffles
//! and shards it afterwards) and again on resume. Without shuffling the drawn records keep the files' order,
//! source after source, the `k` passes first.
use crate::hash::{mix, Rng};

/// The weights of the sources and where each source's records start among the loader's records (global ids).
#[derive(Clone, Debug, PartialEq)]
pub struct Mixture {
    weights: Vec<f64>,
    /// `starts[s]..starts[s + 1]`: the global ids of source `s`'s records.
    starts: Vec<u32>,
}

/// What one source contributes to an epoch.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SourceCount {
    pub weight: f64,
    /// Records of the source in the split (held-out and duplicate records excluded).
    pub records: u64,
    /// Records drawn per epoch: `k * records + round(f * records)`.
    pub drawn: u64,
}

/// Checks weights: finite, at least 0, one of them above 0.
pub fn check_weights(weights: &[f64]) -> Result<(), String> {
    if let Some(w) = weights.iter().find(|w| !w.is_finite() || **w < 0.0) {
        return Err(format!("weights must be numbers >= 0, got {w}"));
    }
    if weights.iter().all(|&w| w == 0.0) {
        return Err("weights are all 0: nothing would be drawn".into());
    }
    Ok(())
}

fn drawn(weight: f64, n: usize) -> (usize, usize) {
    let whole = weight.trunc() as usize;
    let extra = ((weight - weight.trunc()) * n as f64).round() as usize;
    (whole, extra.min(n))
}

impl Mixture {
    /// The mixture of sources with `weights` whose records are `starts[s]..starts[s + 1]`; None when every weight
    /// is 1 (each record once: no draw needed, the plan is the one of the plain concatenation).
    pub fn new(weights: &[f64], starts: Vec<u32>) -> Result<Option<Mixture>, String> {
        check_weights(weights)?;
        assert_eq!(
            starts.len(),
            weights.len() + 1,
            "one start per source and the end"
        );
        if weights.iter().all(|&w| w == 1.0) {
            return Ok(None);
        }
        Ok(Some(Mixture {
            weights: weights.to_vec(),
            starts,
        }))
    }

    /// Source `s`'s records among `selected` (sorted global ids).
    fn records<'a>(&self, selected: &'a [u32], s: usize) -> &'a [u32] {
        let a = selected.partition_point(|&id| id < self.starts[s]);
        let b = selected.partition_point(|&id| id < self.starts[s + 1]);
        &selected[a..b]
    }

    /// What each source contributes to an epoch of `selected` (sorted global ids).
    pub fn counts(&self, selected: &[u32]) -> Vec<SourceCount> {
        self.weights
            .iter()
            .enumerate()
            .map(|(s, &weight)| {
                let n = self.records(selected, s).len();
                let (whole, extra) = drawn(weight, n);
                SourceCount {
                    weight,
                    records: n as u64,
                    drawn: (whole * n + extra) as u64,
                }
            })
            .collect()
    }

    /// The records of `epoch`, drawn from `selected` (sorted global ids), source after source.
    pub fn draw(&self, selected: &[u32], seed: u64, epoch: u64) -> Vec<u32> {
        let total: u64 = self.counts(selected).iter().map(|c| c.drawn).sum();
        let mut out = Vec::with_capacity(total as usize);
        for (s, &weight) in self.weights.iter().enumerate() {
            let records = self.records(selected, s);
            let (whole, extra) = drawn(weight, records.len());
            for _ in 0..whole {
                out.extend_from_slice(records);
            }
            if extra > 0 {
                let mut rng = Rng::new(
                    mix(seed ^ 0x6d69_7874_7572_6500) ^ mix(epoch.wrapping_add(1)) ^ mix(s as u64),
                );
                let mut pool = records.to_vec();
                for i in 0..extra {
                    let j = i + rng.below(pool.len() - i); // the first `extra` of a Fisher-Yates shuffle
                    pool.swap(i, j);
                }
                let mut chosen = pool[..extra].to_vec();
                chosen.sort_unstable();
                out.extend_from_slice(&chosen);
            }
        }
        out
    }

    /// What the draw depends on besides the seed and the records, for the resume fingerprint.
    pub fn fingerprint(&self) -> String {
        format!("{:?} {:?}", self.weights, self.starts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mixture(weights: &[f64], sizes: &[u32]) -> Mixture {
        let mut starts = vec![0];
        for n in sizes {
            starts.push(starts.last().unwrap() + n);
        }
        Mixture::new(weights, starts).unwrap().unwrap()
    }

    fn per_source(m: &Mixture, drawn: &[u32]) -> Vec<usize> {
        (0..m.weights.len())
            .map(|s| {
                drawn
                    .iter()
                    .filter(|&&id| id >= m.starts[s] && id < m.starts[s + 1])
                    .count()
            })
            .collect()
    }

    #[test]
    fn each_source_is_drawn_weight_times_its_records() {
        let m = mixture(&[1.0, 3.0, 0.5, 0.0, 2.25], &[1000, 200, 301, 50, 40]);
        let selected: Vec<u32> = (0..1591).collect();
        let d = m.draw(&selected, 7, 0);
        assert_eq!(per_source(&m, &d), vec![1000, 600, 151, 0, 90]);
        let counts: Vec<u64> = m.counts(&selected).iter().map(|c| c.drawn).collect();
        assert_eq!(counts, vec![1000, 600, 151, 0, 90]);
        // Weight 3: every record exactly three times; 2.25: every record twice or three times.
        let times = |id: u32| d.iter().filter(|&&x| x == id).count();
        assert!((1000..1200).all(|id| times(id) == 3));
        assert!((1551..1591).all(|id| (2..=3).contains(&times(id))));
        // Weight 0.5: half of the records, each at most once, another half in another epoch.
        let half: Vec<u32> = d
            .iter()
            .copied()
            .filter(|&id| (1200..1501).contains(&id))
            .collect();
        assert!(half.windows(2).all(|w| w[0] < w[1]));
        let other = m.draw(&selected, 7, 1);
        assert_eq!(per_source(&m, &other), per_source(&m, &d));
        assert_ne!(other, d);
    }

    #[test]
    fn the_draw_depends_on_seed_and_epoch_only() {
        let m = mixture(&[0.3, 1.7], &[500, 500]);
        let selected: Vec<u32> = (0..1000).collect();
        assert_eq!(m.draw(&selected, 3, 5), m.draw(&selected, 3, 5));
        assert_ne!(m.draw(&selected, 3, 5), m.draw(&selected, 4, 5));
        assert_ne!(m.draw(&selected, 3, 5), m.draw(&selected, 3, 6));
    }

    #[test]
    fn held_out_records_are_never_drawn() {
        let m = mixture(&[2.0, 0.5], &[100, 100]);
        let selected: Vec<u32> = (0..200).filter(|id| id % 10 != 0).collect(); // every 10th held out
        let d = m.draw(&selected, 1, 0);
        assert!(d.iter().all(|id| id % 10 != 0));
        assert_eq!(per_source(&m, &d), vec![180, 45]);
    }

    #[test]
    fn weights_are_checked_and_ones_need_no_draw() {
        assert!(Mixture::new(&[1.0, 1.0], vec![0, 5, 9]).unwrap().is_none());
        assert!(Mixture::new(&[-1.0], vec![0, 5])
            .unwrap_err()
            .contains(">= 0"));
        assert!(Mixture::new(&[f64::NAN], vec![0, 5]).is_err());
        assert!(Mixture::new(&[0.0, 0.0], vec![0, 5, 9])
            .unwrap_err()
            .contains("all 0"));
    }
}
