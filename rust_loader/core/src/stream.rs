//! The stream: worker threads build the batches of the epoch plan in order (read at offsets, parse, render,
//! tokenize, pad or pack) into a bounded reorder buffer; the consumer receives them in plan order.
//!
//! Resume state is `(epoch, batches consumed in that epoch, fingerprint of data + settings)`: resuming recomputes
//! the plan from the index and starts at that batch, so nothing skipped is read or tokenized again.
use std::collections::BTreeMap;
use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Receiver, Sender};
use serde::{Deserialize, Serialize};

use crate::error::{LoaderError, Result};
use crate::hash::{hash_parts, mix, Rng};
use crate::index::{self, Example, FileIndex, IndexSettings};
use crate::mixture::{Mixture, SourceCount};
use crate::options::LoaderOptions;
use crate::plan::{self, PackShape, Plan, PlanConfig};
use crate::records::Rendered;
use crate::render::Renderer;
use crate::tokenize::Tok;

/// Part of the resume fingerprint: bumped whenever the same settings would give another epoch plan (v2: the
/// xoshiro256** PRNG shared with the sample generator; v3: packed rows), so an older state is refused instead of
/// misapplied.
const PLAN_VERSION: &[u8] = b"plan-v3";

/// Everything that configures a [`Loader`].
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    pub paths: Vec<String>,
    pub tokenizer: PathBuf,
    pub options: LoaderOptions,
}

/// One padded or packed batch, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub rows: usize,
    pub source_len: usize,
    pub target_len: usize,
    pub input_ids: Vec<i64>,
    pub attention_mask: Vec<i64>,
    pub labels: Vec<i64>,
    pub real_tokens: usize,
    /// Packed batches only.
    pub segments: Option<Segments>,
}

/// What a packed batch adds (see docs/loader.md): per position, the segment (1, 2, ... in placement order within
/// the row; 0 on padding) and the position inside the segment (0 on padding), for the encoder rows (`rows x
/// source_len`) and the decoder rows (`rows x target_len`).
#[derive(Clone, Debug, PartialEq)]
pub struct Segments {
    pub encoder_segment_ids: Vec<i64>,
    pub decoder_segment_ids: Vec<i64>,
    pub encoder_positions: Vec<i64>,
    pub decoder_positions: Vec<i64>,
}

/// Resume position.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct State {
    pub epoch: u64,
    pub batches_consumed: u64,
    pub fingerprint: String,
}

/// Counters and examples for `stats()`.
#[derive(Clone, Debug, Serialize)]
pub struct Stats {
    pub yielded: u64,
    pub yielded_batches: u64,
    pub skipped: BTreeMap<String, u64>,
    pub examples: Vec<String>,
    pub real_token_share: f64,
    pub records: u64,
    pub batches_per_epoch: u64,
    pub oversize_batches: u64,
    pub dropped_batches: u64,
    /// The shape of every batch when packing.
    pub packed_shape: Option<PackShape>,
    pub epoch: u64,
    pub position: u64,
    pub files: Vec<String>,
    pub index_cached: Vec<bool>,
    /// Per path (or glob) given: its files, weight, records and records drawn per epoch.
    pub sources: Vec<SourceStats>,
    /// Records drawn per epoch over all sources (`records` when every weight is 1).
    pub epoch_records: u64,
}

/// What one source (a path or glob given) contributes to an epoch.
#[derive(Clone, Debug, Serialize)]
pub struct SourceStats {
    pub path: String,
    pub files: Vec<String>,
    #[serde(flatten)]
    pub count: SourceCount,
}

struct Ctx {
    files: Vec<FileIndex>,
    starts: Vec<u32>,
    src_len: Vec<u16>,
    tgt_len: Vec<u16>,
    tok: Tok,
    renderer: Renderer,
    pad_id: i64,
    pad_multiple: usize,
    pack: Option<PackShape>,
}

impl Ctx {
    fn locate(&self, id: u32) -> (usize, usize) {
        let f = self.starts.partition_point(|&s| s <= id) - 1;
        (f, (id - self.starts[f]) as usize)
    }

    /// Reads and renders record `id`: its source and target text.
    fn text(&self, id: u32, handles: &mut [Option<File>]) -> Result<(String, String)> {
        let (f, i) = self.locate(id);
        let fi = &self.files[f];
        let parsed = fi.read(&mut handles[f], i)?;
        self.renderer
            .render(&parsed)
            .map_err(|s| fi.error(i, s.detail))
    }

    /// Tokenizes record `id`'s text.
    fn tokens(&self, id: u32, source: &str, target: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let (f, i) = self.locate(id);
        let fi = &self.files[f];
        let (s, t) = self
            .tok
            .encode(source, target)
            .map_err(|e| fi.error(i, e))?;
        // Packed rows are planned from the index's lengths: a record that tokenizes otherwise now was changed.
        if (s.len(), t.len())
            != (
                self.src_len[id as usize] as usize,
                self.tgt_len[id as usize] as usize,
            )
        {
            return Err(fi.error(
                i,
                "record changed since it was indexed (other token lengths)",
            ));
        }
        Ok((s, t))
    }

    /// Reads, renders and tokenizes record `id`.
    fn encode(&self, id: u32, handles: &mut [Option<File>]) -> Result<(Vec<u32>, Vec<u32>)> {
        let (source, target) = self.text(id, handles)?;
        self.tokens(id, &source, &target)
    }

    /// Record `id` with its text and ids, named `file:line` as the renderer names records.
    fn record(&self, id: u32, handles: &mut [Option<File>]) -> Result<Rendered> {
        let (source, target) = self.text(id, handles)?;
        let (source_ids, target_ids) = self.tokens(id, &source, &target)?;
        let (f, i) = self.locate(id);
        Ok(Rendered {
            id: self.files[f].place(i),
            source,
            reference: Some(target),
            source_ids,
            target_ids: Some(target_ids),
        })
    }

    /// Batch `k` of `plan`.
    fn build(&self, plan: &Plan, k: usize, handles: &mut [Option<File>]) -> Result<Batch> {
        match self.pack {
            None => {
                let rows: Result<Vec<_>> = plan
                    .batch(k)
                    .iter()
                    .map(|&id| self.encode(id, handles))
                    .collect();
                Ok(pad_batch(&rows?, self.pad_id, self.pad_multiple))
            }
            Some(shape) => {
                let mut rows = Vec::with_capacity(shape.rows);
                for row in plan.rows(k, shape.rows) {
                    let records: Result<Vec<_>> =
                        row.iter().map(|&id| self.encode(id, handles)).collect();
                    rows.push(records?);
                }
                Ok(pack_batch(&rows, shape, self.pad_id))
            }
        }
    }
}

/// Lays out packed rows (each a list of `(source ids, target ids)` records) as a batch of `shape`: a record's
/// source and target under the same segment id (1, 2, ... from the left), positions restarting at 0 per segment,
/// padding (segment 0) with the pad id, attention mask 0 and label -100; rows past `rows.len()` are padding.
pub fn pack_batch(rows: &[Vec<(Vec<u32>, Vec<u32>)>], shape: PackShape, pad_id: i64) -> Batch {
    let (n, sl, tl) = (shape.rows, shape.source_len, shape.target_len);
    let mut b = Batch {
        rows: n,
        source_len: sl,
        target_len: tl,
        input_ids: vec![pad_id; n * sl],
        attention_mask: vec![0; n * sl],
        labels: vec![-100; n * tl],
        real_tokens: 0,
        segments: None,
    };
    let mut seg = Segments {
        encoder_segment_ids: vec![0; n * sl],
        decoder_segment_ids: vec![0; n * tl],
        encoder_positions: vec![0; n * sl],
        decoder_positions: vec![0; n * tl],
    };
    for (r, records) in rows.iter().enumerate() {
        let (mut at_s, mut at_t) = (r * sl, r * tl);
        for (j, (s, t)) in records.iter().enumerate() {
            assert!(
                at_s + s.len() <= (r + 1) * sl && at_t + t.len() <= (r + 1) * tl,
                "a packed row over its capacity"
            );
            for (p, &id) in s.iter().enumerate() {
                b.input_ids[at_s + p] = id as i64;
                b.attention_mask[at_s + p] = 1;
                seg.encoder_segment_ids[at_s + p] = j as i64 + 1;
                seg.encoder_positions[at_s + p] = p as i64;
            }
            for (p, &id) in t.iter().enumerate() {
                b.labels[at_t + p] = id as i64;
                seg.decoder_segment_ids[at_t + p] = j as i64 + 1;
                seg.decoder_positions[at_t + p] = p as i64;
            }
            at_s += s.len();
            at_t += t.len();
            b.real_tokens += s.len() + t.len();
        }
    }
    b.segments = Some(seg);
    b
}

/// Pads `(source ids, target ids)` rows: input_ids with `pad_id`, attention_mask 0/1, labels with -100, to the
/// longest row rounded up to `multiple`.
pub fn pad_batch(rows: &[(Vec<u32>, Vec<u32>)], pad_id: i64, multiple: usize) -> Batch {
    let m = multiple.max(1);
    let sl = rows
        .iter()
        .map(|r| r.0.len())
        .max()
        .unwrap_or(0)
        .div_ceil(m)
        * m;
    let tl = rows
        .iter()
        .map(|r| r.1.len())
        .max()
        .unwrap_or(0)
        .div_ceil(m)
        * m;
    let n = rows.len();
    let mut input_ids = vec![pad_id; n * sl];
    let mut attention_mask = vec![0i64; n * sl];
    let mut labels = vec![-100i64; n * tl];
    let mut real = 0;
    for (r, (s, t)) in rows.iter().enumerate() {
        for (j, &id) in s.iter().enumerate() {
            input_ids[r * sl + j] = id as i64;
            attention_mask[r * sl + j] = 1;
        }
        for (j, &id) in t.iter().enumerate() {
            labels[r * tl + j] = id as i64;
        }
        real += s.len() + t.len();
    }
    Batch {
        rows: n,
        source_len: sl,
        target_len: tl,
        input_ids,
        attention_mask,
        labels,
        real_tokens: real,
        segments: None,
    }
}

struct Pipeline {
    jobs: Option<Sender<usize>>,
    results: Option<Receiver<(usize, Result<Batch>)>>,
    handles: Vec<JoinHandle<()>>,
    next_submit: usize,
    next: usize,
    end: usize,
    buf: BTreeMap<usize, Result<Batch>>,
}

impl Pipeline {
    fn start(
        ctx: Arc<Ctx>,
        plan: Arc<Plan>,
        from: usize,
        threads: usize,
        prefetch: usize,
    ) -> Pipeline {
        let (job_tx, job_rx) = unbounded::<usize>();
        let (res_tx, res_rx) = unbounded();
        let handles = (0..threads.max(1))
            .map(|_| {
                let (ctx, plan, job_rx, res_tx) =
                    (ctx.clone(), plan.clone(), job_rx.clone(), res_tx.clone());
                std::thread::spawn(move || {
                    let mut files: Vec<Option<File>> = (0..ctx.files.len()).map(|_| None).collect();
                    for k in job_rx.iter() {
                        let r = catch_unwind(AssertUnwindSafe(|| ctx.build(&plan, k, &mut files)))
                            .unwrap_or_else(|p| {
                                Err(LoaderError::Internal(panic_message("worker", &p)))
                            });
                        if res_tx.send((k, r)).is_err() {
                            break;
                        }
                    }
                })
            })
            .collect();
        let mut p = Pipeline {
            jobs: Some(job_tx),
            results: Some(res_rx),
            handles,
            next_submit: from,
            next: from,
            end: plan.batches.len(),
            buf: BTreeMap::new(),
        };
        for _ in 0..prefetch.max(1) {
            p.submit();
        }
        p
    }

    fn submit(&mut self) {
        if self.next_submit < self.end {
            if let Some(j) = &self.jobs {
                let _ = j.send(self.next_submit);
            }
            self.next_submit += 1;
        }
    }

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.next >= self.end {
            return None;
        }
        loop {
            if let Some(b) = self.buf.remove(&self.next) {
                self.next += 1;
                self.submit();
                return Some(b);
            }
            match self.results.as_ref().expect("results").recv() {
                Ok((k, b)) => {
                    self.buf.insert(k, b);
                }
                Err(_) => return Some(Err(LoaderError::Internal("loader workers stopped".into()))),
            }
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.jobs.take();
        self.results.take();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn panic_message(what: &str, p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("{what} panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("{what} panicked: {s}")
    } else {
        format!("{what} panicked")
    }
}

/// What the epoch plan depends on, from the records themselves: their rendered text's hash and token lengths,
/// in order. Touching, copying or moving the files keeps it (a resume in a container sees other paths and
/// times); any change to what would be trained on changes it.
fn content_hash(src_len: &[u16], tgt_len: &[u16], hashes: &[u64]) -> u64 {
    let mut h = mix(hashes.len() as u64);
    for ((&s, &t), &x) in src_len.iter().zip(tgt_len).zip(hashes) {
        h = mix(h ^ x).wrapping_add(((s as u64) << 16) | t as u64);
    }
    mix(h)
}

/// Skipped records by reason, over all files.
fn skip_counts(files: &[FileIndex]) -> BTreeMap<String, u64> {
    let mut skipped = BTreeMap::new();
    for f in files {
        for (reason, n) in &f.skipped {
            *skipped.entry(reason.clone()).or_default() += n;
        }
    }
    skipped
}

/// The error when nothing is left to train on, with what was skipped and why.
fn no_usable_records(
    paths: &[PathBuf],
    files: &[FileIndex],
    valid: usize,
    split: plan::Split,
) -> LoaderError {
    let skipped = skip_counts(files);
    let total_skipped: u64 = skipped.values().sum();
    let mut reason =
        format!("no usable records for the {split} split ({valid} valid, {total_skipped} skipped");
    if !skipped.is_empty() {
        let counts: Vec<String> = skipped.iter().map(|(r, n)| format!("{r}: {n}")).collect();
        reason += &format!(": {}", counts.join(", "));
    }
    reason += ")";
    if let Some(ex) = files.iter().flat_map(|f| &f.examples).next() {
        reason += &format!("; first skipped: {ex}");
    }
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    LoaderError::data(shown.join(", "), 0, reason)
}

/// The whole loader: index, plan, workers, position.
pub struct Loader {
    ctx: Arc<Ctx>,
    cfg: PlanConfig,
    selected: Vec<u32>,
    duplicates: Vec<(u32, u32)>,
    epoch: u64,
    pos: usize,
    plan: Option<(u64, Arc<Plan>)>,
    pipe: Option<Pipeline>,
    threads: usize,
    prefetch: usize,
    fingerprint: String,
    /// The mixing weights, None when every record is drawn once.
    mixture: Option<Mixture>,
    /// Per source: the path (or glob) given and its files; where its records start (global ids), then the end.
    sources: Vec<(String, Vec<String>)>,
    source_starts: Vec<u32>,
    warnings: Vec<String>,
    yielded: u64,
    yielded_batches: u64,
    real: u64,
    total: u64,
}

impl Loader {
    /// Validates settings, indexes every file (or loads cached indexes) and computes the selection. A bug that
    /// panics here is returned as [`LoaderError::Internal`].
    pub fn new(c: LoaderConfig) -> Result<Loader> {
        Loader::new_cancellable(c, &AtomicBool::new(false))
    }

    /// [`Loader::new`] that another thread can stop by setting `cancel`: it then returns
    /// [`LoaderError::Cancelled`] within one chunk of records (or one MiB read), having written no index cache.
    pub fn new_cancellable(c: LoaderConfig, cancel: &AtomicBool) -> Result<Loader> {
        catch_unwind(AssertUnwindSafe(|| Loader::build(c, cancel)))
            .unwrap_or_else(|p| Err(LoaderError::Internal(panic_message("indexing", &p))))
    }

    fn build(c: LoaderConfig, cancel: &AtomicBool) -> Result<Loader> {
        let o = &c.options;
        o.check()?;
        let renderer = Renderer::new(
            &o.task,
            o.source_template.as_deref(),
            o.target_template.as_deref(),
        )?;
        let sources = crate::paths::expand_sources(&c.paths)?;
        let paths: Vec<PathBuf> = sources.iter().flatten().cloned().collect();
        let tok = Tok::load(&c.tokenizer, o.max_source_length, o.max_target_length)?;
        let settings = IndexSettings {
            cancel,
            tok: &tok,
            renderer: &renderer,
            max_source: o.max_source_length,
            max_target: o.max_target_length,
            format: o.format()?,
            names: o.column_names()?,
            cache_dir: o.cache_dir.clone(),
            strict: o.strict,
        };
        let mut files = Vec::new();
        let mut warnings = Vec::new();
        let mut source_starts = vec![0u32];
        for source in &sources {
            for path in source {
                files.push(index::index_file(path, &settings, &mut warnings)?);
            }
            let records: usize = files.iter().map(|f| f.len()).sum();
            if records > u32::MAX as usize {
                return Err(LoaderError::Config("more than 2^32 records".into()));
            }
            source_starts.push(records as u32);
        }
        let total = *source_starts.last().expect("the end") as usize;
        let mut starts = Vec::with_capacity(files.len());
        let (mut src_len, mut tgt_len, mut hashes) = (
            Vec::with_capacity(total),
            Vec::with_capacity(total),
            Vec::with_capacity(total),
        );
        for f in &mut files {
            starts.push(src_len.len() as u32);
            src_len.append(&mut f.src_len);
            tgt_len.append(&mut f.tgt_len);
            hashes.append(&mut f.hashes);
        }
        let mixture = match &o.weights {
            None => None,
            Some(w) if w.len() != c.paths.len() => {
                return Err(LoaderError::Config(format!(
                    "weights: {} given for {} paths; give one per path (or glob)",
                    w.len(),
                    c.paths.len()
                )))
            }
            Some(w) => Mixture::new(w, source_starts.clone()).map_err(LoaderError::Config)?,
        };
        // The packed shape comes from all records, whatever the split (train and eval get the same one), as the
        // mixture draws them.
        let shape = match &mixture {
            None => o.pack_shape(&src_len, &tgt_len)?,
            Some(m) => {
                let drawn = m.draw(&(0..total as u32).collect::<Vec<_>>(), o.seed, 0);
                let gather =
                    |lens: &[u16]| drawn.iter().map(|&i| lens[i as usize]).collect::<Vec<_>>();
                o.pack_shape(&gather(&src_len), &gather(&tgt_len))?
            }
        };
        let plan_cfg = o.plan_config(shape);
        let (selected, duplicates) = plan::select(&hashes, &plan_cfg);
        if selected.is_empty() {
            return Err(no_usable_records(&paths, &files, total, plan_cfg.split));
        }
        let mut fingerprint_parts: Vec<&[u8]> = vec![PLAN_VERSION];
        let content = content_hash(&src_len, &tgt_len, &hashes).to_le_bytes();
        let tok_hash = tok.file_hash.to_le_bytes();
        let plan_text = format!("{plan_cfg:?}");
        fingerprint_parts.extend([&content[..], &tok_hash[..], plan_text.as_bytes()]);
        // Only with weights: a state saved without them keeps its fingerprint.
        let mixture_text = mixture.as_ref().map(Mixture::fingerprint);
        if let Some(m) = &mixture_text {
            fingerprint_parts.push(m.as_bytes());
        }
        let fingerprint = format!("{:016x}", hash_parts(&fingerprint_parts));
        drop(hashes);
        let pad_id = tok.pad_id as i64;
        let threads = o
            .num_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        Ok(Loader {
            ctx: Arc::new(Ctx {
                files,
                starts,
                src_len,
                tgt_len,
                tok,
                renderer,
                pad_id,
                pad_multiple: plan_cfg.pad_to_multiple_of,
                pack: plan_cfg.pack,
            }),
            cfg: plan_cfg,
            selected,
            duplicates,
            epoch: o.epoch,
            pos: 0,
            plan: None,
            pipe: None,
            threads,
            prefetch: o.prefetch,
            fingerprint,
            mixture,
            sources: c
                .paths
                .iter()
                .zip(&sources)
                .map(|(p, files)| {
                    let names = files.iter().map(|f| f.display().to_string()).collect();
                    (p.clone(), names)
                })
                .collect(),
            source_starts,
            warnings,
            yielded: 0,
            yielded_batches: 0,
            real: 0,
            total: 0,
        })
    }

    /// Warnings gathered since the last call (a cache that could not be written, a file re-indexed), for the
    /// caller to log.
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    /// The records of the current epoch: the selected ones, or the mixture's draw from them.
    fn drawn(&self) -> std::borrow::Cow<'_, [u32]> {
        match &self.mixture {
            None => std::borrow::Cow::Borrowed(&self.selected),
            Some(m) => std::borrow::Cow::Owned(m.draw(&self.selected, self.cfg.seed, self.epoch)),
        }
    }

    /// The plan of the current epoch (computed once per epoch).
    pub fn plan(&mut self) -> Arc<Plan> {
        match &self.plan {
            Some((e, p)) if *e == self.epoch => p.clone(),
            _ => {
                let p = Arc::new(plan::make_plan(
                    &self.drawn(),
                    &self.ctx.src_len,
                    &self.ctx.tgt_len,
                    &self.cfg,
                    self.epoch,
                ));
                self.plan = Some((self.epoch, p.clone()));
                p
            }
        }
    }

    /// Batches this rank yields per epoch.
    pub fn len(&mut self) -> usize {
        self.plan().batches.len()
    }

    pub fn is_empty(&mut self) -> bool {
        self.len() == 0
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Starts epoch `n` from its first batch.
    pub fn set_epoch(&mut self, n: u64) {
        self.pipe = None;
        self.epoch = n;
        self.pos = 0;
    }

    /// The next batch of the epoch; `None` at its end, after which the stream moves to the next epoch.
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.pipe.is_none() {
            let plan = self.plan();
            if self.pos >= plan.batches.len() {
                self.epoch += 1;
                self.pos = 0;
                return Ok(None);
            }
            self.pipe = Some(Pipeline::start(
                self.ctx.clone(),
                plan,
                self.pos,
                self.threads,
                self.prefetch,
            ));
        }
        match self.pipe.as_mut().expect("pipeline").next() {
            None => {
                self.pipe = None;
                self.epoch += 1;
                self.pos = 0;
                Ok(None)
            }
            Some(Err(e)) => {
                self.pipe = None;
                Err(e)
            }
            Some(Ok(b)) => {
                self.pos += 1;
                self.yielded += b.rows as u64;
                self.yielded_batches += 1;
                self.real += b.real_tokens as u64;
                self.total += (b.rows * (b.source_len + b.target_len)) as u64;
                Ok(Some(b))
            }
        }
    }

    pub fn state(&self) -> State {
        State {
            epoch: self.epoch,
            batches_consumed: self.pos as u64,
            fingerprint: self.fingerprint.clone(),
        }
    }

    /// Moves to a saved position; refuses a state from other data or settings.
    pub fn load_state(&mut self, s: &State) -> Result<()> {
        if s.fingerprint != self.fingerprint {
            return Err(LoaderError::Config(format!(
                "cannot resume: the saved data position belongs to other data or loader settings (the records' \
                 text or token lengths, batch size or token budget, packing and its row shape, seed, split, dedup, \
                 rank or world size; fingerprint {} != {})",
                s.fingerprint, self.fingerprint
            )));
        }
        self.pipe = None;
        self.epoch = s.epoch;
        let n = self.len();
        if s.batches_consumed as usize > n {
            return Err(LoaderError::Config(format!(
                "cannot resume at batch {} of an epoch of {n}",
                s.batches_consumed
            )));
        }
        self.pos = s.batches_consumed as usize;
        Ok(())
    }

    pub fn stats(&mut self) -> Stats {
        let plan = self.plan();
        let sources = self.source_stats();
        let ctx = &self.ctx;
        let mut skipped = skip_counts(&ctx.files);
        let mut examples: Vec<String> = ctx
            .files
            .iter()
            .flat_map(|f| f.examples.iter().map(Example::to_string))
            .collect();
        if !self.duplicates.is_empty() {
            skipped.insert("duplicate".into(), self.duplicates.len() as u64);
            let at = |id: u32| {
                let (f, i) = ctx.locate(id);
                ctx.files[f].place(i)
            };
            for &(d, first) in self.duplicates.iter().take(index::MAX_EXAMPLES) {
                examples.push(format!("{}: duplicate (same text as {})", at(d), at(first)));
            }
        }
        let share = if self.total > 0 {
            self.real as f64 / self.total as f64
        } else {
            plan::real_token_share(
                &plan,
                &ctx.src_len,
                &ctx.tgt_len,
                self.cfg.pad_to_multiple_of,
                self.cfg.pack,
            )
        };
        Stats {
            yielded: self.yielded,
            yielded_batches: self.yielded_batches,
            skipped,
            examples,
            real_token_share: share,
            records: self.selected.len() as u64,
            batches_per_epoch: plan.batches.len() as u64,
            oversize_batches: plan.oversize,
            dropped_batches: plan.dropped_batches,
            packed_shape: self.cfg.pack,
            epoch: self.epoch,
            position: self.pos as u64,
            files: ctx
                .files
                .iter()
                .map(|f| f.path.display().to_string())
                .collect(),
            index_cached: ctx.files.iter().map(|f| f.cached).collect(),
            epoch_records: sources.iter().map(|s| s.count.drawn).sum(),
            sources,
        }
    }

    /// Per source: its files, weight, records and records drawn per epoch.
    fn source_stats(&self) -> Vec<SourceStats> {
        let counts = match &self.mixture {
            Some(m) => m.counts(&self.selected),
            None => (0..self.sources.len())
                .map(|s| {
                    let (a, b) = (self.source_starts[s], self.source_starts[s + 1]);
                    let n = self
                        .selected
                        .iter()
                        .filter(|&&id| id >= a && id < b)
                        .count() as u64;
                    SourceCount {
                        weight: 1.0,
                        records: n,
                        drawn: n,
                    }
                })
                .collect(),
        };
        self.sources
            .iter()
            .zip(counts)
            .map(|((path, files), count)| SourceStats {
                path: path.clone(),
                files: files.clone(),
                count,
            })
            .collect()
    }

    /// `n` of the selected records (all of them when there are fewer), drawn with `seed` whatever the rank,
    /// in index order, each with its text and ids as the batches have them. The evaluation generates for
    /// these: a few records read at their indexed offsets instead of the files read again.
    pub fn sample_records(&self, n: usize, seed: u64) -> Result<Vec<Rendered>> {
        let mut ids = self.selected.clone();
        if ids.len() > n {
            let mut rng = Rng::new(mix(seed ^ 0x5eed_5a3b_1e00_0000));
            for i in 0..n {
                let j = i + rng.below(ids.len() - i); // the first n of a Fisher-Yates shuffle
                ids.swap(i, j);
            }
            ids.truncate(n);
            ids.sort_unstable();
        }
        let mut handles: Vec<Option<File>> = (0..self.ctx.files.len()).map(|_| None).collect();
        ids.iter()
            .map(|&id| self.ctx.record(id, &mut handles))
            .collect()
    }

    /// Token lengths `(source, target)` of the current epoch's records: the selected ones, or with weights the
    /// records the mixture draws (a record drawn three times counts three times), for `data inspect`, the time
    /// estimate of `trainer plan` and the memory plan.
    pub fn lengths(&self) -> (Vec<u16>, Vec<u16>) {
        let drawn = self.drawn();
        let s = drawn
            .iter()
            .map(|&i| self.ctx.src_len[i as usize])
            .collect();
        let t = drawn
            .iter()
            .map(|&i| self.ctx.tgt_len[i as usize])
            .collect();
        (s, t)
    }
}
