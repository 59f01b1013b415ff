//! Packing records into fixed-capacity rows: each record's source into the encoder row and its target into the
//! decoder row, so that a row's total source length stays within `ls` AND its total target length within `lt`
//! (2-D vector bin packing), from the index's token lengths alone.
//!
//! The records arrive in the epoch's seeded order into a pool of [`POOL`] records; rows are built one at a time
//! from the pool, which is refilled after each row:
//! 1. the oldest record in the pool opens the row (no record waits long, and records that are hard to place
//!    cannot pile up in the pool);
//! 2. while the room left holds more than about three typical records, the oldest record of the ratio class
//!    (target / source length, 16 quantile classes) nearest to the room's own ratio is added, which keeps the room
//!    shaped like typical records;
//! 3. then a record near `room / k` while about `k >= 3` records still fit; then the record that, with the best
//!    fit for what it leaves, fills the room most (the best fit and up to [`PAIR_CANDIDATES`] records near half
//!    the room are tried; a pair within two tokens of full ends the search); then best fits until none fits.
//!
//! Searches take source tokens at `alpha` times the value of target tokens, `alpha` being the pool's source share
//! over the records' (to the 8th power): when the row shape's ratio differs from the data's, the side rows fill
//! last would otherwise pile up in the pool. Measured (`cargo test -p recipe_core --release --lib pack --
//! --nocapture`, and the `measure` test): over 99.4% of the row capacity holds real tokens on recipe-like
//! lengths; docs/loader.md has the numbers.
use std::collections::VecDeque;

use crate::hash::{mix, Rng};

/// Records in the pool the rows are built from. Smaller pools drain faster at the end of an epoch (the last
/// pool's records pack less tightly); larger ones gave no better rows in the measurements.
pub const POOL: usize = 2048;
/// Ratio classes of step 2.
const CLASSES: usize = 16;
/// Candidates for the first record of the final pair.
pub const PAIR_CANDIDATES: usize = 64;

/// Tunables, for the measurements.
#[derive(Clone, Copy, Debug)]
pub struct PackParams {
    pub pool: usize,
    pub pair_candidates: usize,
    /// Step 2 runs while the room holds more than this many mean records in both dimensions.
    pub steer_above: f64,
    /// How strongly the searches favour the side that piles up in the pool.
    pub alpha_power: f64,
    /// The pair search stops at a pair that leaves at most this many (weighted) tokens.
    pub good_enough: f64,
}

impl Default for PackParams {
    fn default() -> Self {
        PackParams {
            pool: POOL,
            pair_candidates: PAIR_CANDIDATES,
            steer_above: 3.0,
            alpha_power: 8.0,
            good_enough: 2.0,
        }
    }
}

/// Packed rows: row `r` holds `items[ends[r - 1]..ends[r]]` (from 0 for the first row), in placement order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rows {
    pub items: Vec<u32>,
    pub ends: Vec<u32>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.ends.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
    pub fn row(&self, r: usize) -> &[u32] {
        let a = if r == 0 { 0 } else { self.ends[r - 1] as usize };
        &self.items[a..self.ends[r] as usize]
    }
}

/// Share of target tokens in these records (0.5 when there are none).
pub fn target_share(src: &[u16], tgt: &[u16]) -> f64 {
    let s: f64 = src.iter().map(|&x| x as f64).sum();
    let t: f64 = tgt.iter().map(|&x| x as f64).sum();
    if s + t > 0.0 {
        t / (s + t)
    } else {
        0.5
    }
}

/// `(source_len, target_len)` of a row of at most `per_row` tokens for records with `target_share` of their
/// tokens in the target: multiples of `multiple`, at least `min_source`/`min_target` (multiples of `multiple`
/// themselves, with `min_source + min_target <= per_row`), holding the most tokens in that proportion (a row of
/// the wrong shape fills one side and leaves the other partly empty).
pub fn split_row(
    per_row: usize,
    target_share: f64,
    (min_source, min_target): (usize, usize),
    multiple: usize,
) -> (usize, usize) {
    let m = multiple.max(1);
    let ratio = target_share / (1.0 - target_share).max(1e-9);
    let usable = |s: usize, t: usize| (s as f64).min(t as f64 / ratio) * (1.0 + ratio);
    let mut best = (min_source, min_target);
    let mut t = min_target;
    while t + min_source <= per_row {
        let s = (per_row - t) / m * m;
        if usable(s, t) > usable(best.0, best.1) {
            best = (s, t);
        }
        t += m;
    }
    best
}

/// Records a row should hold on average at least: rows of one or two records cannot be filled.
pub const MIN_RECORDS_PER_ROW: usize = 4;

/// Tokens in the shortest row for these records: one that holds a source of `min_source` and a target of
/// `min_target` tokens in the records' proportion (at least `min_source + min_target`), and
/// [`MIN_RECORDS_PER_ROW`] records of mean length.
pub fn shortest_row(src: &[u16], tgt: &[u16], (min_source, min_target): (usize, usize)) -> usize {
    let share = target_share(src, tgt);
    let fit =
        (min_source as f64 / (1.0 - share).max(1e-3)).max(min_target as f64 / share.max(1e-3));
    let tokens: f64 = src.iter().chain(tgt).map(|&x| x as f64).sum();
    let mean = tokens / src.len().max(1) as f64;
    (fit.max(MIN_RECORDS_PER_ROW as f64 * mean).ceil() as usize).max(min_source + min_target)
}

/// Records packed to compare row shapes in [`choose_split`].
const TRIAL_RECORDS: usize = 32_768;

/// `(source_len, target_len)` of a row of at most `per_row` tokens for these records, sides at least
/// `max_source`/`max_target` and multiples of `multiple`: among the split in the records' proportion
/// ([`split_row`]) and the splits whose sides hold whole numbers of records cut at the length limits (when many
/// records are exactly that long, other lengths leave gaps that only short records could fill), the one that
/// puts the most tokens into a row when packing a sample of the records (every k-th, up to 32,768; rows built
/// while the pool is full, so that the pool's draining at the end does not count).
pub fn choose_split(
    src: &[u16],
    tgt: &[u16],
    per_row: usize,
    (max_source, max_target): (usize, usize),
    multiple: usize,
) -> (usize, usize) {
    let m = multiple.max(1);
    let up = |x: usize| x.div_ceil(m) * m;
    let (min_s, min_t) = (up(max_source), up(max_target));
    let share = target_share(src, tgt);
    let mut candidates = vec![split_row(per_row, share, (min_s, min_t), m)];
    let whole_t = per_row as f64 * share / max_target.max(1) as f64;
    let whole_s = per_row as f64 * (1.0 - share) / max_source.max(1) as f64;
    for k in [whole_t.floor(), whole_t.ceil()] {
        let t = up(k as usize * max_target).max(min_t);
        if t + min_s <= per_row {
            candidates.push(((per_row - t) / m * m, t));
        }
    }
    for k in [whole_s.floor(), whole_s.ceil()] {
        let s = up(k as usize * max_source).max(min_s);
        if s + min_t <= per_row {
            candidates.push((s, (per_row - s) / m * m));
        }
    }
    candidates.dedup();
    if candidates.len() == 1 || src.is_empty() {
        return candidates[0];
    }
    let step = src.len().div_ceil(TRIAL_RECORDS);
    let sample: Vec<u32> = (0..src.len() as u32).step_by(step).collect();
    let tokens_per_row = |&(s, t): &(usize, usize)| {
        let mut packer = Packer::new(&sample, src, tgt, s, t, PackParams::default());
        let mut rows = Rows::default();
        let mut n = 0usize;
        // A sample of a few pools: all of it; else the rows built while the pool is full.
        let full = sample.len() <= 4 * POOL;
        while packer.placed < sample.len() && (full || packer.arrived < sample.len()) {
            packer.row(&mut rows);
            n += 1;
        }
        let real: usize = rows
            .items
            .iter()
            .map(|&i| src[i as usize] as usize + tgt[i as usize] as usize)
            .sum();
        real as f64 / n.max(1) as f64
    };
    let scores: Vec<f64> = candidates.iter().map(tokens_per_row).collect();
    let best = (0..candidates.len())
        .max_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(b.cmp(&a)))
        .expect("one candidate at least");
    candidates[best]
}

/// Encoder and decoder row lengths for packing records of these token lengths into micro-batches of `budget`
/// tokens: `(rows, source_len, target_len)`. `rows = budget // shortest_row`, and the rows are as long as that
/// many rows can be within the budget, split by [`choose_split`] (each side at least the longest record allowed,
/// `max_source` and `max_target`, and a multiple of `multiple`). Err when `budget` is smaller than one row of
/// `max_source + max_target`.
pub fn suggest_shape(
    src: &[u16],
    tgt: &[u16],
    max_source: usize,
    max_target: usize,
    budget: usize,
    multiple: usize,
) -> Result<(usize, usize, usize), String> {
    let m = multiple.max(1);
    let (min_s, min_t) = (max_source.div_ceil(m) * m, max_target.div_ceil(m) * m);
    if budget < min_s + min_t {
        return Err(format!(
            "max_tokens {budget} is smaller than one packed row of {min_s} + {min_t} tokens (max_source_length + \
             max_target_length, rounded up to a multiple of {m}): raise max_tokens or lower the lengths"
        ));
    }
    let rows = (budget / shortest_row(src, tgt, (min_s, min_t)).min(budget)).max(1);
    let (source_len, target_len) =
        choose_split(src, tgt, budget / rows, (max_source, max_target), m);
    Ok((rows, source_len, target_len))
}

const NONE: u32 = u32::MAX;

/// Pooled records by (target, source) length: a doubly linked list of pool slots per cell (oldest first), a
/// bitset of non-empty source lengths per target length and a bitset of non-empty target lengths.
struct Grid {
    smax: usize,
    tmax: usize,
    words: usize,
    head: Vec<u32>,
    tail: Vec<u32>,
    next: Vec<u32>,
    prev: Vec<u32>,
    sbits: Vec<u64>,
    tbits: Vec<u64>,
}

impl Grid {
    fn new(slots: usize, smax: usize, tmax: usize) -> Grid {
        let words = (smax + 1).div_ceil(64);
        let cells = (smax + 1) * (tmax + 1);
        Grid {
            smax,
            tmax,
            words,
            head: vec![NONE; cells],
            tail: vec![NONE; cells],
            next: vec![NONE; slots],
            prev: vec![NONE; slots],
            sbits: vec![0; words * (tmax + 1)],
            tbits: vec![0; (tmax + 1).div_ceil(64)],
        }
    }

    fn cell(&self, s: usize, t: usize) -> usize {
        t * (self.smax + 1) + s
    }

    fn mark(&mut self, s: usize, t: usize) {
        self.sbits[t * self.words + s / 64] |= 1 << (s % 64);
        self.tbits[t / 64] |= 1 << (t % 64);
    }

    /// Adds `slot` at the tail of cell `(s, t)`.
    fn push(&mut self, slot: u32, s: usize, t: usize) {
        let c = self.cell(s, t);
        self.next[slot as usize] = NONE;
        self.prev[slot as usize] = self.tail[c];
        if self.tail[c] == NONE {
            self.head[c] = slot;
            self.mark(s, t);
        } else {
            self.next[self.tail[c] as usize] = slot;
        }
        self.tail[c] = slot;
    }

    /// Puts `slot` back at the head of its cell (undoes the removal of the cell's oldest).
    fn push_front(&mut self, slot: u32, s: usize, t: usize) {
        let c = self.cell(s, t);
        self.prev[slot as usize] = NONE;
        self.next[slot as usize] = self.head[c];
        if self.head[c] == NONE {
            self.tail[c] = slot;
            self.mark(s, t);
        } else {
            self.prev[self.head[c] as usize] = slot;
        }
        self.head[c] = slot;
    }

    fn remove(&mut self, slot: u32, s: usize, t: usize) {
        let c = self.cell(s, t);
        let (p, n) = (self.prev[slot as usize], self.next[slot as usize]);
        if p == NONE {
            self.head[c] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail[c] = p;
        } else {
            self.prev[n as usize] = p;
        }
        if self.head[c] == NONE {
            self.sbits[t * self.words + s / 64] &= !(1 << (s % 64));
            if self.sbits[t * self.words..(t + 1) * self.words]
                .iter()
                .all(|&w| w == 0)
            {
                self.tbits[t / 64] &= !(1 << (t % 64));
            }
        }
    }

    /// The oldest slot of cell `(s, t)`.
    fn first(&self, s: usize, t: usize) -> u32 {
        self.head[self.cell(s, t)]
    }

    /// The largest set bit `<= x` of `bits`.
    fn at_most(bits: &[u64], x: usize) -> Option<usize> {
        let mut w = x / 64;
        let mut word = bits[w] & (u64::MAX >> (63 - x % 64));
        loop {
            if word != 0 {
                return Some(w * 64 + 63 - word.leading_zeros() as usize);
            }
            if w == 0 {
                return None;
            }
            w -= 1;
            word = bits[w];
        }
    }

    /// The smallest set bit `>= x` of `bits`.
    fn at_least(bits: &[u64], x: usize) -> Option<usize> {
        let mut w = x / 64;
        if w >= bits.len() {
            return None;
        }
        let mut word = bits[w] & (u64::MAX << (x % 64));
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            if w == bits.len() {
                return None;
            }
            word = bits[w];
        }
    }

    fn srow(&self, t: usize) -> &[u64] {
        &self.sbits[t * self.words..(t + 1) * self.words]
    }

    /// The largest pooled source length `<= s` at target length `t`.
    fn s_at_most(&self, t: usize, s: usize) -> Option<usize> {
        Self::at_most(self.srow(t), s.min(self.smax))
    }

    fn s_at_least(&self, t: usize, s: usize) -> Option<usize> {
        Self::at_least(self.srow(t), s).filter(|&x| x <= self.smax)
    }

    /// The largest pooled target length `<= t`.
    fn t_at_most(&self, t: usize) -> Option<usize> {
        Self::at_most(&self.tbits, t.min(self.tmax))
    }

    fn t_at_least(&self, t: usize) -> Option<usize> {
        Self::at_least(&self.tbits, t).filter(|&x| x <= self.tmax)
    }

    /// The cell with the most tokens (`alpha * s + t`) that fits `(rs, rt)`, if it has more than `floor`; with
    /// its value.
    fn best_fit(
        &self,
        (rs, rt): (usize, usize),
        alpha: f64,
        floor: f64,
    ) -> Option<((usize, usize), f64)> {
        let value = |s: usize, t: usize| alpha * s as f64 + t as f64;
        let mut best: Option<((usize, usize), f64)> = None;
        let mut t = self.t_at_most(rt)?;
        loop {
            let score = best.map_or(floor, |b| b.1);
            if value(rs.min(self.smax), t) <= score {
                return best;
            }
            if let Some(s) = self.s_at_most(t, rs) {
                if value(s, t) > score {
                    best = Some(((s, t), value(s, t)));
                }
            }
            match t.checked_sub(1).and_then(|x| self.t_at_most(x)) {
                Some(x) => t = x,
                None => return best,
            }
        }
    }

    /// Cells that fit `room` near `(ps, pt)`: target lengths in order of `|t - pt|`, at each the nearest source
    /// length at or below `ps` and the one above.
    fn near(&self, (ps, pt): (f64, f64), (rs, rt): (usize, usize)) -> Near<'_> {
        let start = (pt.round().max(0.0) as usize).min(rt);
        Near {
            grid: self,
            pt,
            ps: (ps.round().max(0.0) as usize).min(rs),
            rs,
            rt,
            down: self.t_at_most(start),
            up: self.t_at_least(start + 1).filter(|&t| t <= rt),
            pending: None,
        }
    }
}

/// The iterator of [`Grid::near`].
struct Near<'g> {
    grid: &'g Grid,
    pt: f64,
    ps: usize,
    rs: usize,
    rt: usize,
    down: Option<usize>,
    up: Option<usize>,
    pending: Option<(usize, usize)>,
}

impl Iterator for Near<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if let Some(cell) = self.pending.take() {
            return Some(cell);
        }
        let g = self.grid;
        loop {
            let d_down = self.down.map(|t| self.pt - t as f64);
            let d_up = self.up.map(|t| t as f64 - self.pt);
            let t = match (d_down, d_up) {
                (None, None) => return None,
                (Some(d), Some(u)) if d <= u => self.step_down(),
                (Some(_), None) => self.step_down(),
                _ => {
                    let t = self.up.expect("checked");
                    self.up = g.t_at_least(t + 1).filter(|&x| x <= self.rt);
                    t
                }
            };
            let below = g.s_at_most(t, self.ps);
            let above = g.s_at_least(t, self.ps + 1).filter(|&s| s <= self.rs);
            match (below, above) {
                (Some(a), Some(b)) => {
                    self.pending = Some((b, t));
                    return Some((a, t));
                }
                (Some(a), None) | (None, Some(a)) => return Some((a, t)),
                (None, None) => {}
            }
        }
    }
}

impl Near<'_> {
    fn step_down(&mut self) -> usize {
        let t = self.down.expect("checked");
        self.down = t.checked_sub(1).and_then(|x| self.grid.t_at_most(x));
        t
    }
}

/// Packs `order` (record ids, in the epoch's order) into rows of capacity `(ls, lt)`; every record must fit a
/// row alone (`src[i] <= ls`, `tgt[i] <= lt`). Deterministic: the same input gives the same rows.
pub fn pack(order: &[u32], src: &[u16], tgt: &[u16], ls: usize, lt: usize) -> Rows {
    pack_with(order, src, tgt, ls, lt, PackParams::default())
}

/// [`pack`] with explicit tunables.
pub fn pack_with(
    order: &[u32],
    src: &[u16],
    tgt: &[u16],
    ls: usize,
    lt: usize,
    p: PackParams,
) -> Rows {
    let mut rows = Rows {
        items: Vec::with_capacity(order.len()),
        ends: Vec::new(),
    };
    if order.is_empty() {
        return rows;
    }
    let mut packer = Packer::new(order, src, tgt, ls, lt, p);
    while packer.placed < order.len() {
        packer.row(&mut rows);
        rows.ends.push(rows.items.len() as u32);
    }
    rows
}

/// A pooled record: its position `k` in `order` and its pool slot.
#[derive(Clone, Copy)]
struct Pooled {
    k: u32,
    slot: u32,
}

/// The state of [`pack_with`].
struct Packer<'a> {
    order: &'a [u32],
    src: &'a [u16],
    tgt: &'a [u16],
    /// Row capacity `(ls, lt)`.
    capacity: (usize, usize),
    p: PackParams,
    mean: (f64, f64),
    /// Source / target tokens of all records, and of the pooled ones.
    ratio: f64,
    pool_sums: (f64, f64),
    /// Ratio classes: upper bounds of log(t / s), and each class's median.
    bounds: Vec<f32>,
    centers: Vec<f32>,
    /// Pooled records by class and overall, oldest first (taken ones are dropped when they reach the front).
    classes: Vec<VecDeque<Pooled>>,
    arrivals: VecDeque<Pooled>,
    grid: Grid,
    /// Which slot holds which record (`NONE`: free), and the free slots.
    slot_k: Vec<u32>,
    free: Vec<u32>,
    arrived: usize,
    placed: usize,
}

impl<'a> Packer<'a> {
    fn new(
        order: &'a [u32],
        src: &'a [u16],
        tgt: &'a [u16],
        ls: usize,
        lt: usize,
        p: PackParams,
    ) -> Self {
        let n = order.len();
        let (mut sum, mut smax, mut tmax) = ((0f64, 0f64), 0, 0);
        let mut log_ratio: Vec<f32> = Vec::with_capacity(n);
        for &i in order {
            let (s, t) = (src[i as usize] as usize, tgt[i as usize] as usize);
            assert!(
                s <= ls && t <= lt,
                "record longer than a row: ({s}, {t}) > ({ls}, {lt})"
            );
            sum = (sum.0 + s as f64, sum.1 + t as f64);
            smax = smax.max(s);
            tmax = tmax.max(t);
            log_ratio.push((t.max(1) as f32 / s.max(1) as f32).ln());
        }
        log_ratio.sort_by(|a, b| a.total_cmp(b));
        let quantile = |q: usize| log_ratio[(q * n / (2 * CLASSES)).min(n - 1)];
        let pool = p.pool.clamp(1, n);
        Packer {
            order,
            src,
            tgt,
            capacity: (ls, lt),
            p,
            mean: (sum.0 / n as f64, sum.1 / n as f64),
            ratio: sum.0 / sum.1.max(1.0),
            pool_sums: (0.0, 0.0),
            bounds: (1..CLASSES).map(|c| quantile(2 * c)).collect(),
            centers: (0..CLASSES).map(|c| quantile(2 * c + 1)).collect(),
            classes: vec![VecDeque::new(); CLASSES],
            arrivals: VecDeque::with_capacity(pool),
            grid: Grid::new(pool, smax, tmax),
            slot_k: vec![NONE; pool],
            free: (0..pool as u32).rev().collect(),
            arrived: 0,
            placed: 0,
        }
    }

    fn len_of(&self, k: u32) -> (usize, usize) {
        let i = self.order[k as usize] as usize;
        (self.src[i] as usize, self.tgt[i] as usize)
    }

    fn class_of(&self, (s, t): (usize, usize)) -> usize {
        let r = (t.max(1) as f32 / s.max(1) as f32).ln();
        self.bounds.partition_point(|&b| b <= r)
    }

    fn fill_pool(&mut self) {
        while let Some(&slot) = self.free.last() {
            if self.arrived == self.order.len() {
                break;
            }
            self.free.pop();
            let k = self.arrived as u32;
            self.arrived += 1;
            let (s, t) = self.len_of(k);
            self.slot_k[slot as usize] = k;
            self.grid.push(slot, s, t);
            self.pool_sums = (self.pool_sums.0 + s as f64, self.pool_sums.1 + t as f64);
            let c = self.class_of((s, t));
            self.classes[c].push_back(Pooled { k, slot });
            self.arrivals.push_back(Pooled { k, slot });
        }
    }

    fn pooled(&self, x: &Pooled) -> bool {
        self.slot_k[x.slot as usize] == x.k
    }

    /// Moves the record in `slot` into the row.
    fn take(&mut self, slot: u32, room: &mut (usize, usize), rows: &mut Rows) {
        let k = self.slot_k[slot as usize];
        let (s, t) = self.len_of(k);
        self.grid.remove(slot, s, t);
        self.slot_k[slot as usize] = NONE;
        self.free.push(slot);
        self.pool_sums = (self.pool_sums.0 - s as f64, self.pool_sums.1 - t as f64);
        self.placed += 1;
        rows.items.push(self.order[k as usize]);
        *room = (room.0 - s, room.1 - t);
    }

    /// The slot of the oldest pooled record of the ratio class nearest to `want` (a log ratio).
    fn oldest_near_ratio(&mut self, want: f32) -> Option<u32> {
        let at = self.centers.partition_point(|&c| c < want);
        let (mut lo, mut hi) = (at.checked_sub(1), (at < CLASSES).then_some(at));
        loop {
            let c = match (lo, hi) {
                (None, None) => return None,
                (Some(l), Some(h)) if want - self.centers[l] <= self.centers[h] - want => {
                    lo = l.checked_sub(1);
                    l
                }
                (Some(l), None) => {
                    lo = l.checked_sub(1);
                    l
                }
                (_, Some(h)) => {
                    hi = (h + 1 < CLASSES).then_some(h + 1);
                    h
                }
            };
            while let Some(front) = self.classes[c].front() {
                if self.pooled(front) {
                    return Some(front.slot);
                }
                self.classes[c].pop_front();
            }
        }
    }

    /// Builds one row into `rows.items`.
    fn row(&mut self, rows: &mut Rows) {
        self.fill_pool();
        let mut room = self.capacity;
        // 1. The oldest record opens the row.
        while let Some(front) = self.arrivals.pop_front() {
            if self.pooled(&front) {
                self.take(front.slot, &mut room, rows);
                break;
            }
        }
        // 2. Oldest records of the ratio class that keeps the room shaped like typical records.
        let (mean_s, mean_t) = self.mean;
        let steer = self.p.steer_above;
        while room.0 as f64 > steer * mean_s && room.1 as f64 > steer * mean_t {
            let Some(slot) = self.oldest_near_ratio((room.1 as f32 / room.0 as f32).ln()) else {
                break;
            };
            let (s, t) = self.len_of(self.slot_k[slot as usize]);
            if s > room.0 || t > room.1 {
                break;
            }
            self.take(slot, &mut room, rows);
        }
        // 3. Searches for the last records.
        let pool_ratio = self.pool_sums.0 / self.pool_sums.1.max(1.0);
        let alpha = (pool_ratio / self.ratio).powf(self.p.alpha_power);
        loop {
            let (rs, rt) = room;
            let left = ((rs as f64 / mean_s + rt as f64 / mean_t) / 2.0).round() as usize;
            let cell = if left >= 3 {
                let target = (rs as f64 / left as f64, rt as f64 / left as f64);
                self.grid.near(target, room).next()
            } else {
                self.best_pair_start(room, alpha)
            };
            let Some((s, t)) = cell else { break };
            self.take(self.grid.first(s, t), &mut room, rows);
        }
    }

    /// The record that, with the best fit for the room it leaves, fills `room` most: among the best fit itself
    /// and records near half the room.
    fn best_pair_start(&mut self, room: (usize, usize), alpha: f64) -> Option<(usize, usize)> {
        let value = |(s, t): (usize, usize)| alpha * s as f64 + t as f64;
        let (rs, rt) = room;
        let full = value(room);
        let first = self.grid.best_fit(room, alpha, 0.0).map(|b| b.0);
        let near: Vec<(usize, usize)> = self
            .grid
            .near((rs as f64 / 2.0, rt as f64 / 2.0), room)
            .take(self.p.pair_candidates)
            .collect();
        let mut best: Option<((usize, usize), f64)> = None;
        for (s, t) in first.into_iter().chain(near) {
            let got = best.map_or(0.0, |b| b.1);
            if got >= full - self.p.good_enough {
                break;
            }
            let slot = self.grid.first(s, t);
            self.grid.remove(slot, s, t);
            let rest = self
                .grid
                .best_fit((rs - s, rt - t), alpha, got - value((s, t)));
            self.grid.push_front(slot, s, t);
            let fill = value((s, t)) + rest.map_or(0.0, |r| r.1);
            if fill > got {
                best = Some(((s, t), fill));
            }
        }
        best.map(|b| b.0)
    }
}

/// Lengths drawn like recipes (source ~ lognormal, median 96, sigma 0.35, in 16..=512; target ~ lognormal,
/// median 256, sigma 0.45, in 32..=512): `bench/train_throughput.py`'s `make_records` distribution.
pub fn lognormal_lengths(n: usize, seed: u64) -> (Vec<u16>, Vec<u16>) {
    let mut rng = Rng::new(mix(seed));
    let mut normal = move || {
        // Box-Muller.
        let (u, v) = (rng.unit().max(1e-300), rng.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    };
    let mut draw = |median: f64, sigma: f64, lo: f64, hi: f64| {
        (median * (sigma * normal()).exp()).clamp(lo, hi) as u16
    };
    let mut src = Vec::with_capacity(n);
    let mut tgt = Vec::with_capacity(n);
    for _ in 0..n {
        src.push(draw(96.0, 0.35, 16.0, 512.0));
        tgt.push(draw(256.0, 0.45, 32.0, 512.0));
    }
    (src, tgt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real-token share of `rows` grouped into micro-batches of `r` rows (the last one padded with empty rows).
    fn share(rows: &Rows, r: usize, src: &[u16], tgt: &[u16], ls: usize, lt: usize) -> f64 {
        let real: usize = rows
            .items
            .iter()
            .map(|&i| src[i as usize] as usize + tgt[i as usize] as usize)
            .sum();
        let batches = rows.len().div_ceil(r);
        real as f64 / (batches * r * (ls + lt)) as f64
    }

    fn check_rows(rows: &Rows, n: usize, src: &[u16], tgt: &[u16], ls: usize, lt: usize) {
        let mut seen = vec![false; n];
        for r in 0..rows.len() {
            let row = rows.row(r);
            assert!(!row.is_empty());
            let s: usize = row.iter().map(|&i| src[i as usize] as usize).sum();
            let t: usize = row.iter().map(|&i| tgt[i as usize] as usize).sum();
            assert!(s <= ls && t <= lt, "row {r}: ({s}, {t}) over ({ls}, {lt})");
            for &i in row {
                assert!(!seen[i as usize], "record {i} twice");
                seen[i as usize] = true;
            }
        }
        assert!(seen.iter().all(|&x| x), "a record is missing");
    }

    #[test]
    fn recipe_lengths_fill_99_percent_of_the_rows() {
        // 300,000 records and a micro-batch of 32,768 tokens, the shape chosen by suggest_shape.
        let n = 300_000;
        let (src, tgt) = lognormal_lengths(n, 1);
        let (r, ls, lt) = suggest_shape(&src, &tgt, 512, 512, 32_768, 8).unwrap();
        assert!(ls >= 512 && lt >= 512 && r * (ls + lt) <= 32_768 && ls % 8 == 0 && lt % 8 == 0);
        let order: Vec<u32> = (0..n as u32).collect();
        let rows = pack(&order, &src, &tgt, ls, lt);
        check_rows(&rows, n, &src, &tgt, ls, lt);
        let got = share(&rows, r, &src, &tgt, ls, lt);
        println!("{n} lognormal records, {r} rows x ({ls} + {lt}): real-token share {got:.4}");
        assert!(got >= 0.99, "real-token share {got}");
        // Deterministic.
        assert_eq!(rows, pack(&order, &src, &tgt, ls, lt));
    }

    #[test]
    fn mismatched_shapes_and_small_inputs_stay_valid() {
        let (src, tgt) = lognormal_lengths(20_000, 2);
        let order: Vec<u32> = (0..20_000).rev().collect();
        for (ls, lt) in [(512, 512), (576, 1536), (2048, 2048), (512, 4096)] {
            let rows = pack(&order, &src, &tgt, ls, lt);
            check_rows(&rows, 20_000, &src, &tgt, ls, lt);
        }
        // Fewer records than a pool, and records as long as a row.
        let (s, t) = (vec![512, 3, 512, 7], vec![1, 512, 512, 9]);
        let rows = pack(&[3, 2, 1, 0], &s, &t, 512, 512);
        check_rows(&rows, 4, &s, &t, 512, 512);
        assert!(pack(&[], &s, &t, 512, 512).is_empty());
    }

    #[test]
    fn suggested_shapes() {
        let (src, tgt) = lognormal_lengths(50_000, 3);
        let (r, ls, lt) = suggest_shape(&src, &tgt, 512, 512, 32_768, 8).unwrap();
        // Target about 73% of the tokens: rows of about 520 + 1400.
        assert_eq!(r, 17);
        assert!(
            (512..=560).contains(&ls) && (1360..=1440).contains(&lt),
            "{ls} {lt}"
        );
        // Records cut at small limits: many exactly 256 target tokens long. Rows holding whole numbers of them
        // pack better than the split in proportion.
        let cut_s: Vec<u16> = src.iter().map(|&x| x.min(128)).collect();
        let cut_t: Vec<u16> = tgt.iter().map(|&x| x.min(256)).collect();
        let (r, ls, lt) = suggest_shape(&cut_s, &cut_t, 128, 256, 8192, 64).unwrap();
        assert!(ls >= 128 && lt >= 256 && ls % 64 == 0 && lt % 64 == 0 && r * (ls + lt) <= 8192);
        let order: Vec<u32> = (0..cut_s.len() as u32).collect();
        let fill = |ls, lt| {
            share(
                &pack(&order, &cut_s, &cut_t, ls, lt),
                1,
                &cut_s,
                &cut_t,
                ls,
                lt,
            )
        };
        let per_row = 8192 / r;
        let (ps, pt) = split_row(per_row, target_share(&cut_s, &cut_t), (128, 256), 64);
        println!("cut records: {r} rows x ({ls} + {lt}) fill {:.4}; in proportion ({ps} + {pt}) fill {:.4}", fill(ls, lt), fill(ps, pt));
        assert!(fill(ls, lt) * ((ls + lt) as f64) >= fill(ps, pt) * ((ps + pt) as f64));
        // A budget below one row of the longest records is an error; one row exactly is fine.
        assert!(suggest_shape(&src, &tgt, 512, 512, 1000, 8).is_err());
        assert_eq!(
            suggest_shape(&src, &tgt, 512, 512, 1024, 8).unwrap(),
            (1, 512, 512)
        );
    }

    /// `N=1000000 LS=576 LT=1560 cargo test -p recipe_core --release --lib pack::tests::measure -- --ignored
    /// --nocapture`: fill and time for other sizes, shapes and tunables (POOL, PAIR, STEER, ALPHA, GOOD).
    #[test]
    #[ignore]
    fn measure() {
        let env = |k: &str, d: f64| std::env::var(k).ok().map_or(d, |v| v.parse().unwrap());
        let d = PackParams::default();
        let n = env("N", 1_000_000.0) as usize;
        let (ls, lt) = (env("LS", 576.0) as usize, env("LT", 1560.0) as usize);
        let p = PackParams {
            pool: env("POOL", d.pool as f64) as usize,
            pair_candidates: env("PAIR", d.pair_candidates as f64) as usize,
            steer_above: env("STEER", d.steer_above),
            alpha_power: env("ALPHA", d.alpha_power),
            good_enough: env("GOOD", d.good_enough),
        };
        let (src, tgt) = lognormal_lengths(n, 1);
        let order: Vec<u32> = (0..n as u32).collect();
        let t0 = std::time::Instant::now();
        let rows = pack_with(&order, &src, &tgt, ls, lt, p);
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "{n} records into rows of ({ls}, {lt}), {p:?}: {} rows, real-token share {:.4}, {secs:.2} s",
            rows.len(),
            share(&rows, 1, &src, &tgt, ls, lt)
        );
    }
}
