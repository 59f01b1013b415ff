//! The epoch plan, computed from the index alone (no tokenization): which records, in which order, in which
//! batches, for which rank.
//!
//! - Split: a record is in "eval" when its content hash falls in the lowest `eval_fraction` of the hash range,
//!   so the split is deterministic and independent of file order.
//! - Dedup: by content hash, the first occurrence (in file order) wins.
//! - Order: natural, or with `shuffle` a seeded permutation of all records for `(seed, epoch)`.
//! - `batch_size`: consecutive rows of that order. `max_tokens`: the order is cut into large windows; inside a
//!   window records are sorted by target length, cut into chunks of a few batches' worth, each chunk sorted by
//!   source length, then packed greedily so that `rows × (longest source + longest target)` (after
//!   `pad_to_multiple_of`) stays within `max_tokens`; a record over the budget alone gets its own batch (counted).
//!   The batch list is then shuffled (seeded) when `shuffle` is on.
//! - `pack` (packed rows): the order is packed into rows of `source_len` encoder and `target_len` decoder tokens
//!   ([`crate::pack`]), consecutive rows into micro-batches of exactly `rows` rows (the last one of the epoch
//!   padded with empty rows); the micro-batch list is then shuffled (seeded) when `shuffle` is on.
//! - Sharding: the global batch list is cut to a multiple of `world_size`; rank `r` gets batches `r, r+W, ...`.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::hash::{mix, Rng};
use crate::pack;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    All,
    Train,
    Eval,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::All => "all",
            Split::Train => "train",
            Split::Eval => "eval",
        })
    }
}

impl Split {
    pub fn parse(s: &str) -> Option<Split> {
        match s {
            "all" => Some(Split::All),
            "train" => Some(Split::Train),
            "eval" => Some(Split::Eval),
            _ => None,
        }
    }
}

/// The fixed shape of every packed micro-batch of a run: `rows` rows of `source_len` encoder and `target_len`
/// decoder tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PackShape {
    pub rows: usize,
    pub source_len: usize,
    pub target_len: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    pub batch_size: Option<usize>,
    pub max_tokens: Option<usize>,
    /// Packed rows instead of padded batches (then `batch_size`/`max_tokens` are what decided the shape).
    pub pack: Option<PackShape>,
    pub pad_to_multiple_of: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub rank: usize,
    pub world_size: usize,
    pub split: Split,
    pub eval_fraction: f64,
    pub dedup: bool,
}

/// Whether a record with `hash` is held out for eval.
pub fn is_eval(hash: u64, eval_fraction: f64) -> bool {
    let u = (mix(hash ^ 0x5eed_5eed) >> 11) as f64 / (1u64 << 53) as f64;
    u < eval_fraction
}

/// Records selected by split and dedup, in natural order, plus the global ids of duplicates dropped.
pub fn select(hashes: &[u64], cfg: &PlanConfig) -> (Vec<u32>, Vec<(u32, u32)>) {
    let mut out = Vec::with_capacity(hashes.len());
    let mut dups = Vec::new();
    let mut seen: HashMap<u64, u32> = HashMap::new();
    for (i, &h) in hashes.iter().enumerate() {
        let eval = is_eval(h, cfg.eval_fraction);
        let keep = match cfg.split {
            Split::All => true,
            Split::Train => !eval,
            Split::Eval => eval,
        };
        if !keep {
            continue;
        }
        if cfg.dedup {
            if let Some(&first) = seen.get(&h) {
                dups.push((i as u32, first));
                continue;
            }
            seen.insert(h, i as u32);
        }
        out.push(i as u32);
    }
    (out, dups)
}

fn round_up(n: usize, m: usize) -> usize {
    if m <= 1 {
        n
    } else {
        n.div_ceil(m) * m
    }
}

/// One rank's batches for one epoch: `batches[k]` is a range into `order`. Packed, batch `k` has exactly
/// `shape.rows` rows, whose ends (into `order`) are `row_ends[k * rows..(k + 1) * rows]`; a padding row is empty.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub order: Vec<u32>,
    pub batches: Vec<(u32, u32)>,
    pub row_ends: Vec<u32>,
    /// Batches (global, before sharding) holding a single record over `max_tokens`.
    pub oversize: u64,
    /// Global batches dropped so that every rank gets the same count.
    pub dropped_batches: u64,
}

impl Plan {
    pub fn batch(&self, k: usize) -> &[u32] {
        let (a, b) = self.batches[k];
        &self.order[a as usize..b as usize]
    }

    /// The rows of packed batch `k` (`rows` of them: the shape's).
    pub fn rows(&self, k: usize, rows: usize) -> Vec<&[u32]> {
        let mut start = self.batches[k].0 as usize;
        self.row_ends[k * rows..(k + 1) * rows]
            .iter()
            .map(|&end| {
                let row = &self.order[start..end as usize];
                start = end as usize;
                row
            })
            .collect()
    }
}

/// Builds the plan of `epoch` from the selected records and their token lengths (indexed by global id).
pub fn make_plan(selected: &[u32], src: &[u16], tgt: &[u16], cfg: &PlanConfig, epoch: u64) -> Plan {
    let mut rng = Rng::new(mix(cfg.seed) ^ mix(epoch.wrapping_add(0x1234_5678)));
    let mut order = selected.to_vec();
    if cfg.shuffle {
        rng.shuffle(&mut order);
    }
    let mut batches: Vec<(u32, u32)> = Vec::new();
    let mut oversize = 0u64;
    let pad = cfg.pad_to_multiple_of.max(1);
    if let Some(shape) = cfg.pack {
        return packed_plan(order, src, tgt, cfg, shape, &mut rng);
    }
    if let Some(budget) = cfg.max_tokens {
        let total: usize = order
            .iter()
            .map(|&i| src[i as usize] as usize + tgt[i as usize] as usize)
            .sum();
        let mean = (total / order.len().max(1)).max(1);
        let rows_per_batch = (budget / mean).max(1);
        let window = (100 * rows_per_batch).max(50_000);
        let mut packed = Vec::with_capacity(order.len());
        for w in order.chunks(window) {
            let mut w = w.to_vec();
            w.sort_by_key(|&i| std::cmp::Reverse(tgt[i as usize]));
            // Sorted by target, then chunk-wise by source: a chunk of about sqrt(window x rows) records balances
            // the target spread inside a chunk against the source spread inside a batch.
            let chunk = (((w.len() * rows_per_batch) as f64).sqrt() as usize).max(1);
            for c in w.chunks_mut(chunk) {
                c.sort_by_key(|&i| std::cmp::Reverse(src[i as usize]));
            }
            let mut start = packed.len();
            let (mut ms, mut mt) = (0usize, 0usize);
            for &i in &w {
                let (s, t) = (
                    round_up(src[i as usize] as usize, pad),
                    round_up(tgt[i as usize] as usize, pad),
                );
                let rows = packed.len() - start;
                let (ns, nt) = (ms.max(s), mt.max(t));
                if rows > 0 && (rows + 1) * (ns + nt) > budget {
                    batches.push((start as u32, packed.len() as u32));
                    start = packed.len();
                    ms = 0;
                    mt = 0;
                }
                if s + t > budget {
                    // Alone over the budget: its own batch.
                    if packed.len() > start {
                        batches.push((start as u32, packed.len() as u32));
                    }
                    packed.push(i);
                    batches.push(((packed.len() - 1) as u32, packed.len() as u32));
                    oversize += 1;
                    start = packed.len();
                    ms = 0;
                    mt = 0;
                    continue;
                }
                packed.push(i);
                ms = ms.max(s);
                mt = mt.max(t);
            }
            if packed.len() > start {
                batches.push((start as u32, packed.len() as u32));
            }
        }
        order = packed;
        if cfg.shuffle {
            rng.shuffle(&mut batches);
        }
    } else {
        let bs = cfg.batch_size.unwrap_or(1).max(1);
        let mut a = 0;
        while a < order.len() {
            let b = (a + bs).min(order.len());
            batches.push((a as u32, b as u32));
            a = b;
        }
    }
    let w = cfg.world_size.max(1);
    let keep = batches.len() / w * w;
    let dropped_batches = (batches.len() - keep) as u64;
    let mine: Vec<(u32, u32)> = batches[..keep]
        .iter()
        .skip(cfg.rank)
        .step_by(w)
        .copied()
        .collect();
    Plan {
        order,
        batches: mine,
        row_ends: Vec::new(),
        oversize,
        dropped_batches,
    }
}

/// The packed plan: rows packed from `order`, `shape.rows` consecutive rows per micro-batch, the micro-batches
/// shuffled, then sharded; `order` is rebuilt as this rank's records, batch after batch, row after row.
fn packed_plan(
    order: Vec<u32>,
    src: &[u16],
    tgt: &[u16],
    cfg: &PlanConfig,
    shape: PackShape,
    rng: &mut Rng,
) -> Plan {
    let rows = pack::pack(&order, src, tgt, shape.source_len, shape.target_len);
    drop(order);
    let r = shape.rows.max(1);
    let mut ids: Vec<u32> = (0..rows.len().div_ceil(r) as u32).collect();
    if cfg.shuffle {
        rng.shuffle(&mut ids);
    }
    let w = cfg.world_size.max(1);
    let keep = ids.len() / w * w;
    let mut plan = Plan {
        dropped_batches: (ids.len() - keep) as u64,
        ..Plan::default()
    };
    for &b in ids[..keep].iter().skip(cfg.rank).step_by(w) {
        let start = plan.order.len() as u32;
        for j in b as usize * r..(b as usize + 1) * r {
            if j < rows.len() {
                plan.order.extend_from_slice(rows.row(j));
            }
            plan.row_ends.push(plan.order.len() as u32);
        }
        plan.batches.push((start, plan.order.len() as u32));
    }
    plan
}

/// Share of real tokens in the padded (or packed, with `pack`) batches of `plan`.
pub fn real_token_share(
    plan: &Plan,
    src: &[u16],
    tgt: &[u16],
    pad: usize,
    pack: Option<PackShape>,
) -> f64 {
    let (mut real, mut total) = (0usize, 0usize);
    for k in 0..plan.batches.len() {
        let b = plan.batch(k);
        real += b
            .iter()
            .map(|&i| src[i as usize] as usize + tgt[i as usize] as usize)
            .sum::<usize>();
        total += match pack {
            Some(shape) => shape.rows * (shape.source_len + shape.target_len),
            None => {
                let longest = |lens: &[u16]| {
                    let m = b.iter().map(|&i| lens[i as usize] as usize).max();
                    round_up(m.unwrap_or(0), pad.max(1))
                };
                b.len() * (longest(src) + longest(tgt))
            }
        };
    }
    if total == 0 {
        1.0
    } else {
        real as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(n: usize, seed: u64) -> (Vec<u16>, Vec<u16>) {
        let mut r = Rng::new(seed);
        let s = (0..n)
            .map(|_| (20 + r.below(80) + r.below(60)) as u16)
            .collect();
        let t = (0..n)
            .map(|_| (60 + r.below(200) + r.below(150)) as u16)
            .collect();
        (s, t)
    }

    fn cfg() -> PlanConfig {
        PlanConfig {
            batch_size: None,
            max_tokens: Some(4096),
            pack: None,
            pad_to_multiple_of: 8,
            shuffle: true,
            seed: 3,
            rank: 0,
            world_size: 1,
            split: Split::All,
            eval_fraction: 0.0,
            dedup: false,
        }
    }

    #[test]
    fn max_tokens_bound_and_share() {
        let (s, t) = lens(20_000, 1);
        let sel: Vec<u32> = (0..20_000).collect();
        let p = make_plan(&sel, &s, &t, &cfg(), 0);
        let mut seen = vec![false; 20_000];
        for k in 0..p.batches.len() {
            let b = p.batch(k);
            let ms = b
                .iter()
                .map(|&i| round_up(s[i as usize] as usize, 8))
                .max()
                .unwrap();
            let mt = b
                .iter()
                .map(|&i| round_up(t[i as usize] as usize, 8))
                .max()
                .unwrap();
            assert!(b.len() * (ms + mt) <= 4096);
            for &i in b {
                assert!(!seen[i as usize]);
                seen[i as usize] = true;
            }
        }
        assert!(seen.iter().all(|&x| x));
        let share = real_token_share(&p, &s, &t, 8, None);
        assert!(share >= 0.95, "{share}");
        assert_eq!(p, make_plan(&sel, &s, &t, &cfg(), 0));
        assert_ne!(p, make_plan(&sel, &s, &t, &cfg(), 1));
    }

    #[test]
    fn oversize_record_alone() {
        let s = vec![10, 3000, 10];
        let t = vec![10, 3000, 10];
        let p = make_plan(&[0, 1, 2], &s, &t, &cfg(), 0);
        assert_eq!(p.oversize, 1);
        assert!((0..p.batches.len()).any(|k| p.batch(k) == [1]));
    }

    #[test]
    fn sharding_counts() {
        let (s, t) = lens(5_000, 2);
        let sel: Vec<u32> = (0..5_000).collect();
        for bs in [None, Some(7)] {
            for w in 1..=4 {
                let mut seen = vec![0u8; 5_000];
                let mut counts = vec![];
                for r in 0..w {
                    let c = PlanConfig {
                        rank: r,
                        world_size: w,
                        batch_size: bs,
                        max_tokens: bs.map_or(Some(4096), |_| None),
                        ..cfg()
                    };
                    let p = make_plan(&sel, &s, &t, &c, 5);
                    counts.push(p.batches.len());
                    for k in 0..p.batches.len() {
                        for &i in p.batch(k) {
                            seen[i as usize] += 1;
                        }
                    }
                }
                assert!(counts.iter().all(|&c| c == counts[0]));
                assert!(seen.iter().all(|&x| x <= 1));
                let missing = seen.iter().filter(|&&x| x == 0).count();
                assert!(missing < 600 * w, "{missing}");
            }
        }
    }

    #[test]
    fn split_and_dedup() {
        let hashes: Vec<u64> = (0..10_000u64).map(|i| mix(i % 9_000)).collect();
        let c = PlanConfig {
            dedup: true,
            eval_fraction: 0.1,
            split: Split::Eval,
            ..cfg()
        };
        let (ev, dups) = select(&hashes, &c);
        let (tr, _) = select(
            &hashes,
            &PlanConfig {
                split: Split::Train,
                ..c.clone()
            },
        );
        assert_eq!(ev.len() + tr.len(), 9_000);
        assert!(ev.len() > 700 && ev.len() < 1100, "{}", ev.len());
        assert!(dups.iter().all(|&(d, f)| d > f));
    }
}
