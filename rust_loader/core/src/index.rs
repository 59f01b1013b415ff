//! The first pass: one fast scan per file that records where every valid record is and how long it tokenizes.
//!
//! For each valid record the index keeps its byte offset and length in the (decompressed) file, its 1-based line,
//! the source/target token lengths after truncation and a 64-bit hash of the rendered source and target (used for
//! dedup and the eval split). Skipped records are counted by reason, with the first few kept as `file:line`
//! examples. Parsing, rendering and tokenizing run on rayon over chunks of raw records read sequentially.
//!
//! The index is cached as a small binary file keyed by (path, size, mtime, tokenizer.json hash, templates, max
//! lengths, format): beside the data file as `.<name>.<key>.rlidx` when that directory is writable, else in the cache
//! directory (`cache_dir`, else `$XDG_CACHE_HOME/recipe-trainer`, else `~/.cache/recipe-trainer`). The cache also
//! holds the file's device, inode and ctime and the xxh3-64 of its bytes (computed during the scan): a cache whose
//! key matches is used as is when the inode and ctime match too, else only when the file's hash still matches (a
//! file rewritten with its size and mtime kept is indexed again). A compressed file cannot be read at random
//! offsets, so it is decompressed once, streaming, into the cache directory, and that copy is indexed and read; it
//! is reused while the compressed file's size, mtime, inode and ctime are unchanged.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::cancel::{self, CancellableRead};
use crate::columnar::{self, ArrowTable, TableColumns};
use crate::compress::Compression;
use crate::error::{LoaderError, Result};
use crate::formats::{self, ColumnNames, Columns, Format, Parsed, Skip, MAX_RECORD_BYTES};
use crate::hash::{hash_file, hash_parts, mix, HashingReader};
use crate::paths::{cache_root, write_atomic};
use crate::render::Renderer;
use crate::split::{read_line_bounded, CsvRecords};
use crate::tokenize::Tok;

// Bumped when the same file would index differently (006: an empty CSV list cell is an empty list).
const MAGIC: &[u8; 8] = b"RLIDX006";
const CHUNK: usize = 1024;
/// Bad-record examples kept per file.
pub const MAX_EXAMPLES: usize = 10;

/// A skipped record kept as an example.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Example {
    pub path: String,
    /// The record's first line (1-based), or with `row` its row (0-based, as pandas and pyarrow count).
    pub line: u64,
    #[serde(default)]
    pub row: bool,
    pub reason: String,
    pub detail: String,
}

impl std::fmt::Display for Example {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} ({})",
            place(&self.path, self.line, self.row),
            self.reason,
            self.detail
        )
    }
}

/// Where a record is, for messages: `file:line`, or `file:row N` for a row of a Parquet or Arrow file.
pub fn place(path: &str, line: u64, row: bool) -> String {
    if row {
        format!("{path}:row {line}")
    } else {
        format!("{path}:{line}")
    }
}

/// A [`LoaderError::Data`] about the record at `line` (with `row`: a row, see [`place`]) of `path`.
pub fn record_error(
    path: &str,
    line: u64,
    row: bool,
    reason: impl std::fmt::Display,
) -> LoaderError {
    if row {
        LoaderError::data(place(path, line, row), 0, reason)
    } else {
        LoaderError::data(path, line, reason)
    }
}

/// How a file's records are read back.
pub enum Reader {
    /// JSONL: a record is a line, at its byte offset.
    Lines,
    /// CSV: a record at its byte offset, its fields in these columns.
    Csv(Columns),
    /// Parquet or Arrow: a record is `(batch, row)` of this table (the file, or its decoded copy).
    Table(Box<ArrowTable>, TableColumns),
}

/// Everything the loader needs to know about one file.
pub struct FileIndex {
    pub path: PathBuf,
    /// The file read back: `path` itself, or its decompressed (or, for Parquet, decoded) copy.
    pub data_path: PathBuf,
    pub format: Format,
    pub reader: Reader,
    pub names: ColumnNames,
    pub key: u64,
    /// Per record: its byte offset and length (CSV, JSONL), or its batch and row in the batch (Parquet, Arrow).
    pub offsets: Vec<u64>,
    pub lens: Vec<u32>,
    /// Per record: its first line (1-based), or its row in the file (0-based) for Parquet and Arrow.
    pub lines: Vec<u32>,
    pub src_len: Vec<u16>,
    pub tgt_len: Vec<u16>,
    pub hashes: Vec<u64>,
    pub skipped: BTreeMap<String, u64>,
    pub examples: Vec<Example>,
    /// Whether this index came from the cache.
    pub cached: bool,
    /// The data file's identity when it was indexed, and the xxh3-64 of its bytes.
    pub identity: Identity,
    pub content: u64,
}

impl FileIndex {
    pub fn len(&self) -> usize {
        self.offsets.len()
    }
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Where record `i` is, for messages: `file:line` or `file:row N`.
    pub fn place(&self, i: usize) -> String {
        place(
            &self.path.display().to_string(),
            self.lines[i] as u64,
            self.format.is_columnar(),
        )
    }

    /// A [`LoaderError::Data`] about record `i`.
    pub fn error(&self, i: usize, reason: impl std::fmt::Display) -> LoaderError {
        record_error(
            &self.path.display().to_string(),
            self.lines[i] as u64,
            self.format.is_columnar(),
            reason,
        )
    }

    /// Reads and parses record `i` (an index into this file's valid records); `file` is this thread's handle
    /// on the data file, opened here when needed.
    pub fn read(&self, file: &mut Option<File>, i: usize) -> Result<Parsed> {
        let parsed = match &self.reader {
            Reader::Table(table, cols) => {
                let batch = table
                    .batch(self.offsets[i] as usize)
                    .map_err(|e| self.error(i, e))?;
                cols.parse(batch, self.lens[i] as usize)
            }
            text => {
                if file.is_none() {
                    *file = Some(
                        File::open(&self.data_path)
                            .map_err(|e| LoaderError::io(self.data_path.display(), "", &e))?,
                    );
                }
                let mut buf = vec![0u8; self.lens[i] as usize];
                file.as_ref()
                    .expect("opened")
                    .read_exact_at(&mut buf, self.offsets[i])
                    .map_err(|e| {
                        LoaderError::io(self.data_path.display(), "cannot read record", &e)
                    })?;
                match text {
                    Reader::Csv(cols) => {
                        let mut rdr = csv::ReaderBuilder::new()
                            .has_headers(false)
                            .flexible(true)
                            .from_reader(&buf[..]);
                        let mut rec = csv::ByteRecord::new();
                        match rdr.read_byte_record(&mut rec) {
                            Ok(true) => formats::parse_csv(&rec, self.format, cols),
                            _ => Err(Skip::new("malformed_csv", "record changed since indexing")),
                        }
                    }
                    _ => formats::parse_jsonl(&buf, &self.names),
                }
            }
        };
        parsed.map_err(|s| {
            self.error(
                i,
                format!(
                    "{} ({}); the file changed since it was indexed?",
                    s.reason, s.detail
                ),
            )
        })
    }
}

/// Settings that shape an index.
pub struct IndexSettings<'a> {
    /// Set by another thread to stop indexing (see [`crate::cancel`]).
    pub cancel: &'a AtomicBool,
    pub tok: &'a Tok,
    pub renderer: &'a Renderer,
    pub max_source: usize,
    pub max_target: usize,
    pub format: Option<Format>,
    pub names: ColumnNames,
    pub cache_dir: Option<PathBuf>,
    pub strict: bool,
}

/// What the file system says about a file: the cache key's part (path, size, mtime) and what changes whenever
/// the file's bytes are written, even when its size and mtime are kept or restored (`cp -p`, `rsync -t`): the
/// inode (a new file) and the status-change time (ctime: set by the kernel on every write or rename, and no
/// call sets it back).
struct Stamp {
    canon: String,
    size: u64,
    mtime: u128,
    identity: Identity,
}

/// Device, inode and ctime (seconds, nanoseconds) of a file.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Identity {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Identity {
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
        }
    }
    fn to_bytes(self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&self.dev.to_le_bytes());
        b[8..16].copy_from_slice(&self.ino.to_le_bytes());
        b[16..24].copy_from_slice(&self.ctime.to_le_bytes());
        b[24..].copy_from_slice(&self.ctime_nsec.to_le_bytes());
        b
    }
    fn from_bytes(b: &[u8; 32]) -> Identity {
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Identity {
            dev: u(0),
            ino: u(8),
            ctime: u(16) as i64,
            ctime_nsec: u(24) as i64,
        }
    }
}

fn stamp(path: &Path) -> Result<Stamp> {
    let meta = std::fs::metadata(path).map_err(|e| LoaderError::io(path.display(), "", &e))?;
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Ok(Stamp {
        canon: canon.display().to_string(),
        size: meta.len(),
        mtime,
        identity: Identity::of(&meta),
    })
}

/// The decompressed copy of `path`, made once per version of the compressed file: its key has the inode and
/// ctime too, so a compressed file rewritten with the same size and mtime gets a new copy (and `chmod` one more
/// decompression).
pub fn decompressed_copy(
    path: &Path,
    comp: Compression,
    stem: &str,
    root: &Path,
    stop: &AtomicBool,
) -> Result<PathBuf> {
    let st = stamp(path)?;
    let key = hash_parts(&[
        st.canon.as_bytes(),
        &st.size.to_le_bytes(),
        &st.mtime.to_le_bytes(),
        &st.identity.to_bytes(),
    ]);
    let dest = root.join(format!("{stem}.{key:016x}.data"));
    if dest.is_file() {
        return Ok(dest);
    }
    std::fs::create_dir_all(root)
        .map_err(|e| LoaderError::io(root.display(), "cannot create cache directory", &e))?;
    let src = File::open(path).map_err(|e| LoaderError::io(path.display(), "", &e))?;
    let kind = comp.name();
    let mut failed_on_input = false;
    let res = write_atomic(&dest, |out| {
        let mut reader = CancellableRead::new(comp.reader(src)?, stop);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    failed_on_input = true;
                    return Err(e);
                }
            };
            out.write_all(&buf[..n])?;
        }
    });
    match res {
        Ok(()) => Ok(dest),
        Err(e) if failed_on_input => Err(LoaderError::io(
            path.display(),
            &format!("corrupt or truncated {kind} file"),
            &e,
        )),
        Err(e) => Err(LoaderError::io(
            dest.display(),
            "cannot write decompressed copy",
            &e,
        )),
    }
}

fn csv_reader<R: Read>(r: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .buffer_capacity(1 << 20)
        .from_reader(r)
}

fn read_header(data_path: &Path, shown: &Path) -> Result<Vec<String>> {
    let f = File::open(data_path).map_err(|e| LoaderError::io(shown.display(), "", &e))?;
    let mut rdr = csv_reader(f);
    let h = rdr.headers().map_err(|e| {
        LoaderError::data(
            shown.display(),
            1,
            format!("cannot read the CSV header: {e}"),
        )
    })?;
    Ok(h.iter()
        .map(|s| s.trim_start_matches('\u{feff}').to_string())
        .collect())
}

/// The first byte that is not whitespace or a UTF-8 byte-order mark; `None` for a file without content.
fn first_content_byte(path: &Path) -> std::io::Result<Option<u8>> {
    let mut r = BufReader::new(File::open(path)?);
    let mut at_start = true;
    loop {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok(None);
        }
        let mut body = buf;
        if at_start && body.starts_with(b"\xef\xbb\xbf") {
            body = &body[3..];
        }
        at_start = false;
        if let Some(&b) = body.iter().find(|b| !b.is_ascii_whitespace()) {
            return Ok(Some(b));
        }
        let n = buf.len();
        r.consume(n);
    }
}

enum RawData {
    Csv(csv::ByteRecord),
    Line(Vec<u8>),
    /// A row of a table: `start` is its batch, `len` its row in the batch, `line` its row in the file.
    Row,
}

struct Raw {
    data: RawData,
    start: u64,
    len: u64,
    line: u64,
}

struct Entry {
    src: u16,
    tgt: u16,
    hash: u64,
}

/// The file a Parquet file (or an Arrow file with compressed buffers) is read from: its decoded copy, an
/// uncompressed Arrow IPC file of the columns `names` needs ([`columnar::convert`]), made once per version of
/// `data_path` (keyed, as a decompressed copy, by its path, size, mtime, inode and ctime) and of `names`.
fn decoded_copy(
    data_path: &Path,
    format: Format,
    names: &ColumnNames,
    shown: &str,
    root: &Path,
    stop: &AtomicBool,
) -> Result<PathBuf> {
    let st = stamp(data_path)?;
    let key = hash_parts(&[
        b"decoded-v1",
        st.canon.as_bytes(),
        &st.size.to_le_bytes(),
        &st.mtime.to_le_bytes(),
        &st.identity.to_bytes(),
        format!("{names:?}").as_bytes(),
    ]);
    let name = data_path.file_name().unwrap_or_default().to_string_lossy();
    let dest = root.join(format!("{name}.{key:016x}.arrow"));
    if !dest.is_file() {
        std::fs::create_dir_all(root)
            .map_err(|e| LoaderError::io(root.display(), "cannot create cache directory", &e))?;
        columnar::convert(data_path, format, &dest, names, shown, stop)?;
    }
    Ok(dest)
}

/// The format of `path` (`data_path`: the file as read, decompressed) from `s.format` or its name; a CSV's
/// header is read to tell RecipeNLG from Food.com, and returned.
fn format_of(
    path: &Path,
    data_path: &Path,
    s: &IndexSettings,
) -> Result<(Format, Option<Vec<String>>)> {
    let by_name = Format::from_path(path).1;
    match (s.format, by_name) {
        (Some(f), _) => Ok((f, None)),
        (None, Some(Format::RecipeNlg)) => {
            let h = read_header(data_path, path)?;
            let f = formats::sniff_csv(&h, &s.names).ok_or_else(|| {
                LoaderError::data(path.display(), 1, formats::unknown_csv_header(&h))
            })?;
            Ok((f, Some(h)))
        }
        (None, Some(f)) => Ok((f, None)),
        (None, None) => Err(LoaderError::file(
            path.display(),
            format!(
                "cannot tell the format from the extension ({}); pass data_format",
                formats::EXTENSIONS
            ),
        )),
    }
}

/// Builds the index of one file, or loads it from the cache. What the user should know but that does not stop
/// the loader (a cache that could not be written) is pushed to `warnings`; the Python layer logs it.
pub fn index_file(path: &Path, s: &IndexSettings, warnings: &mut Vec<String>) -> Result<FileIndex> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| LoaderError::io(&shown, "", &e))?;
    if meta.len() == 0 {
        return Err(LoaderError::file(&shown, "empty file"));
    }
    let root = cache_root(s.cache_dir.as_deref());
    let (comp, stem) = Compression::split(path);
    let mut data_path = if comp == Compression::None {
        path.to_path_buf()
    } else {
        decompressed_copy(path, comp, &stem, &root, s.cancel)?
    };
    let columnar = s
        .format
        .or(Format::from_path(path).1)
        .is_some_and(Format::is_columnar);
    // Text with nothing but blank lines is empty whatever its name says; a columnar file is binary.
    let first_byte = if columnar {
        0
    } else {
        first_content_byte(&data_path)
            .map_err(|e| LoaderError::io(&shown, "", &e))?
            .ok_or_else(|| LoaderError::file(&shown, "empty file"))?
    };
    let (format, header) = format_of(path, &data_path, s)?;
    let reader = match format {
        Format::Jsonl | Format::RecipeNlg | Format::FoodCom => {
            if format == Format::Jsonl {
                if first_byte == b'[' {
                    return Err(LoaderError::data(
                        &shown,
                        1,
                        "a JSON array, not JSON Lines (one object per line); convert it with `jq -c '.[]' FILE > FILE.jsonl`",
                    ));
                }
                Reader::Lines
            } else {
                let h = match header {
                    Some(h) => h,
                    None => read_header(&data_path, path)?,
                };
                Reader::Csv(
                    Columns::from_header(format, &h, &s.names)
                        .map_err(|e| LoaderError::data(&shown, 1, e))?,
                )
            }
        }
        Format::Parquet | Format::Arrow => {
            let needs_copy =
                format == Format::Parquet || ArrowTable::open(&data_path, &shown)?.compressed();
            if needs_copy {
                data_path = decoded_copy(&data_path, format, &s.names, &shown, &root, s.cancel)?;
            }
            let table = ArrowTable::open(&data_path, &shown)?;
            let cols = TableColumns::resolve(table.schema(), &s.names)
                .map_err(|e| LoaderError::data(&shown, 0, e))?;
            Reader::Table(Box::new(table), cols)
        }
    };
    let st = stamp(path)?;
    let names = format!("{:?}", s.names);
    let key = hash_parts(&[
        MAGIC,
        st.canon.as_bytes(),
        &st.size.to_le_bytes(),
        &st.mtime.to_le_bytes(),
        &s.tok.file_hash.to_le_bytes(),
        s.renderer.source.text.as_bytes(),
        s.renderer.target.text.as_bytes(),
        &(s.max_source as u64).to_le_bytes(),
        &(s.max_target as u64).to_le_bytes(),
        format.name().as_bytes(),
        names.as_bytes(),
        &(MAX_RECORD_BYTES as u64).to_le_bytes(),
    ]);
    let dir = if comp == Compression::None {
        path.parent().map(Path::to_path_buf).unwrap_or_default()
    } else {
        root.clone()
    };
    let dir = if dir.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        dir
    };
    let cache_name = format!(
        ".{}.{key:016x}.rlidx",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let candidates = [dir.join(&cache_name), root.join(&cache_name)];
    let mut idx = FileIndex {
        path: path.to_path_buf(),
        data_path,
        format,
        reader,
        names: s.names.clone(),
        key,
        offsets: vec![],
        lens: vec![],
        lines: vec![],
        src_len: vec![],
        tgt_len: vec![],
        hashes: vec![],
        skipped: BTreeMap::new(),
        examples: vec![],
        cached: false,
        identity: Identity::default(),
        content: 0,
    };
    // Taken before the scan: a write during it changes the ctime, so the next run checks the content again.
    let now = stamp(&idx.data_path)?.identity;
    if reuse_cache(&candidates, &mut idx, now, s.cancel, warnings)? {
        idx.cached = true;
        if s.strict {
            if let Some(ex) = idx.examples.first() {
                return Err(record_error(
                    &ex.path,
                    ex.line,
                    ex.row,
                    format!("{} ({})", ex.reason, ex.detail),
                ));
            }
        }
    } else {
        scan(&mut idx, s)?;
        idx.identity = now;
        if idx.is_empty() && idx.skipped.is_empty() {
            return Err(LoaderError::file(&shown, "empty file: no records"));
        }
        if !candidates.iter().any(|c| save_cache(c, &idx).is_ok()) {
            warnings.push(format!(
                "could not write the index cache of {shown} (beside it or in {}): the next run indexes it again",
                root.display()
            ));
        }
    }
    Ok(idx)
}

/// Loads the first valid cache among `candidates` into `idx` if it describes the file as it is now: the same
/// inode and ctime as when it was indexed (no read needed), or else the same content hash (one read of the file;
/// the cache is then rewritten with the new identity so the next run needs none). A cache of other content
/// (the file rewritten with its size and mtime kept) is refused with a warning, and the file indexed again.
fn reuse_cache(
    candidates: &[PathBuf],
    idx: &mut FileIndex,
    now: Identity,
    stop: &AtomicBool,
    warnings: &mut Vec<String>,
) -> Result<bool> {
    let Some(cache) = candidates.iter().find(|c| load_cache(c, idx).is_ok()) else {
        return Ok(false);
    };
    if idx.identity == now {
        return Ok(true);
    }
    let content = hash_file(&idx.data_path, stop)
        .map_err(|e| LoaderError::io(idx.path.display(), "read error", &e))?;
    if content == idx.content {
        idx.identity = now;
        let _ = save_cache(cache, idx); // if it cannot be written, the next run hashes again
        return Ok(true);
    }
    warnings.push(format!(
        "{} changed since it was indexed, though its size and modification time are the same: indexing it \
         again (a resume from a checkpoint of the old content will be refused)",
        idx.path.display()
    ));
    Ok(false)
}

fn scan(idx: &mut FileIndex, s: &IndexSettings) -> Result<()> {
    // A cache file that failed to load half-way may have filled some fields.
    idx.offsets.clear();
    idx.lens.clear();
    idx.lines.clear();
    idx.src_len.clear();
    idx.tgt_len.clear();
    idx.hashes.clear();
    idx.skipped.clear();
    idx.examples.clear();
    // Lent out while the index fills: the chunks read through it.
    let reader = std::mem::replace(&mut idx.reader, Reader::Lines);
    let res = scan_with(idx, &reader, s);
    idx.reader = reader;
    res
}

fn scan_with(idx: &mut FileIndex, reader: &Reader, s: &IndexSettings) -> Result<()> {
    let shown = idx.path.display().to_string();
    if let Reader::Table(table, _) = reader {
        let mut chunk = Vec::with_capacity(CHUNK);
        let mut row = 0u64;
        for k in 0..table.num_batches() {
            let batch = table
                .batch(k)
                .map_err(|e| LoaderError::file(&shown, format!("batch {k}: {e}")))?;
            for r in 0..batch.num_rows() {
                chunk.push(Raw {
                    data: RawData::Row,
                    start: k as u64,
                    len: r as u64,
                    line: row,
                });
                row += 1;
                if chunk.len() == CHUNK {
                    process_chunk(idx, reader, s, std::mem::take(&mut chunk))?;
                }
            }
        }
        if !chunk.is_empty() {
            process_chunk(idx, reader, s, chunk)?;
        }
        idx.content = xxhash_rust::xxh3::xxh3_64(table.bytes());
        return Ok(());
    }
    let file = File::open(&idx.data_path).map_err(|e| LoaderError::io(&shown, "", &e))?;
    // The content hash of what is indexed, computed on the way (both readers below read to the end).
    let mut hashing = HashingReader::new(CancellableRead::new(file, s.cancel));
    let f = &mut hashing;
    let io_err = |e: std::io::Error| LoaderError::io(&shown, "read error", &e);
    match reader {
        Reader::Lines => {
            let mut r = BufReader::with_capacity(1 << 20, f);
            let mut pos = 0u64;
            let mut line = 0u64;
            loop {
                let mut chunk = Vec::with_capacity(CHUNK);
                while chunk.len() < CHUNK {
                    let mut buf = Vec::new();
                    let n = read_line_bounded(&mut r, &mut buf, MAX_RECORD_BYTES + 1)
                        .map_err(io_err)?;
                    if n == 0 {
                        break;
                    }
                    let truncated = n > buf.len();
                    line += 1;
                    let mut start = pos;
                    pos += n as u64;
                    let mut body: &[u8] = &buf;
                    if line == 1 && body.starts_with(b"\xef\xbb\xbf") {
                        body = &body[3..];
                        start += 3;
                    }
                    while body.last().is_some_and(|&c| c == b'\n' || c == b'\r') {
                        body = &body[..body.len() - 1];
                    }
                    if body.iter().all(|c| c.is_ascii_whitespace()) {
                        continue;
                    }
                    let len = if truncated {
                        n as u64
                    } else {
                        body.len() as u64
                    };
                    chunk.push(Raw {
                        data: RawData::Line(body.to_vec()),
                        start,
                        len,
                        line,
                    });
                }
                if chunk.is_empty() {
                    break;
                }
                process_chunk(idx, reader, s, chunk)?;
            }
        }
        Reader::Csv(_) => {
            let mut rdr = CsvRecords::new(f);
            rdr.next_record().map_err(io_err)?; // the header, read by `read_header`
            loop {
                let mut chunk = Vec::with_capacity(CHUNK);
                while chunk.len() < CHUNK {
                    let Some(rec) = rdr.next_record().map_err(io_err)? else {
                        break;
                    };
                    if rec.is_blank() {
                        continue;
                    }
                    chunk.push(Raw {
                        start: rec.start,
                        len: rec.len,
                        line: rec.line,
                        data: RawData::Csv(rec.fields),
                    });
                }
                if chunk.is_empty() {
                    break;
                }
                process_chunk(idx, reader, s, chunk)?;
            }
        }
        Reader::Table(..) => unreachable!("read above"),
    }
    idx.content = hashing.digest();
    Ok(())
}

fn process_chunk(
    idx: &mut FileIndex,
    reader: &Reader,
    s: &IndexSettings,
    chunk: Vec<Raw>,
) -> Result<()> {
    cancel::check(s.cancel)?;
    let format = idx.format;
    let names = &idx.names;
    let results: Vec<std::result::Result<Entry, Skip>> = chunk
        .par_iter()
        .map(|raw| {
            let parsed = match (&raw.data, reader) {
                (RawData::Row, Reader::Table(table, cols)) => {
                    let batch = table
                        .batch(raw.start as usize)
                        .map_err(|e| Skip::new("malformed_row", e))?;
                    cols.parse(batch, raw.len as usize)?
                }
                _ if raw.len as usize > MAX_RECORD_BYTES => {
                    return Err(Skip::new(
                        "over_long",
                        format!("record of {} bytes (limit {MAX_RECORD_BYTES})", raw.len),
                    ));
                }
                (RawData::Line(b), _) => formats::parse_jsonl(b, names)?,
                (RawData::Csv(rec), Reader::Csv(cols)) => formats::parse_csv(rec, format, cols)?,
                _ => unreachable!("records come from their file's reader"),
            };
            let (src, tgt) = s.renderer.render(&parsed)?;
            let (si, ti) = s
                .tok
                .encode(&src, &tgt)
                .map_err(|e| Skip::new("tokenizer_error", e))?;
            let hash = hash_parts(&[src.as_bytes(), tgt.as_bytes()]);
            Ok(Entry {
                src: si.len() as u16,
                tgt: ti.len() as u16,
                hash,
            })
        })
        .collect();
    let row = format.is_columnar();
    for (raw, res) in chunk.iter().zip(results) {
        match res {
            Ok(e) => {
                idx.offsets.push(raw.start);
                idx.lens.push(raw.len as u32);
                idx.lines.push(raw.line.min(u32::MAX as u64) as u32);
                idx.src_len.push(e.src);
                idx.tgt_len.push(e.tgt);
                idx.hashes.push(e.hash);
            }
            Err(skip) => {
                let path = idx.path.display().to_string();
                if s.strict {
                    return Err(record_error(
                        &path,
                        raw.line,
                        row,
                        format!("{} ({})", skip.reason, skip.detail),
                    ));
                }
                *idx.skipped.entry(skip.reason.to_string()).or_default() += 1;
                if idx.examples.len() < MAX_EXAMPLES {
                    idx.examples.push(Example {
                        path,
                        line: raw.line,
                        row,
                        reason: skip.reason.to_string(),
                        detail: skip.detail,
                    });
                }
            }
        }
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct CacheMeta {
    skipped: BTreeMap<String, u64>,
    examples: Vec<Example>,
}

/// Every value of the cache: a damaged cache whose offsets still fit the data would otherwise read the wrong
/// records.
fn cache_checksum(idx: &FileIndex, meta: &[u8]) -> u64 {
    let mut h = hash_parts(&[meta, &idx.identity.to_bytes(), &idx.content.to_le_bytes()]);
    for i in 0..idx.len() {
        h = mix(h ^ idx.offsets[i]);
        h = mix(h ^ (((idx.lens[i] as u64) << 32) | idx.lines[i] as u64));
        h = mix(h ^ idx.hashes[i]);
        h = mix(h ^ (((idx.src_len[i] as u64) << 16) | idx.tgt_len[i] as u64));
    }
    h
}

fn save_cache(dest: &Path, idx: &FileIndex) -> std::io::Result<()> {
    if let Some(d) = dest.parent() {
        std::fs::create_dir_all(d)?;
    }
    write_atomic(dest, |f| {
        let mut w = std::io::BufWriter::new(f);
        w.write_all(MAGIC)?;
        w.write_all(&idx.key.to_le_bytes())?;
        w.write_all(&(idx.len() as u64).to_le_bytes())?;
        for &x in &idx.offsets {
            w.write_all(&x.to_le_bytes())?;
        }
        for &x in &idx.lens {
            w.write_all(&x.to_le_bytes())?;
        }
        for &x in &idx.lines {
            w.write_all(&x.to_le_bytes())?;
        }
        for &x in &idx.src_len {
            w.write_all(&x.to_le_bytes())?;
        }
        for &x in &idx.tgt_len {
            w.write_all(&x.to_le_bytes())?;
        }
        for &x in &idx.hashes {
            w.write_all(&x.to_le_bytes())?;
        }
        let meta = serde_json::to_vec(&CacheMeta {
            skipped: idx.skipped.clone(),
            examples: idx.examples.clone(),
        })?;
        w.write_all(&(meta.len() as u64).to_le_bytes())?;
        w.write_all(&meta)?;
        w.write_all(&idx.identity.to_bytes())?;
        w.write_all(&idx.content.to_le_bytes())?;
        w.write_all(&cache_checksum(idx, &meta).to_le_bytes())?;
        w.flush()
    })
}

fn load_cache(src: &Path, idx: &mut FileIndex) -> std::io::Result<()> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad index cache");
    let file = File::open(src)?;
    let cache_len = file.metadata()?.len();
    let data_len = std::fs::metadata(&idx.data_path)?.len();
    let mut r = BufReader::new(file);
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)?;
    let mut u64buf = [0u8; 8];
    let mut read_u64 = |r: &mut BufReader<File>| -> std::io::Result<u64> {
        r.read_exact(&mut u64buf)?;
        Ok(u64::from_le_bytes(u64buf))
    };
    if &magic != MAGIC || read_u64(&mut r)? != idx.key {
        return Err(bad());
    }
    // A damaged cache must not drive an allocation: the arrays take 28 bytes per record.
    let n = read_u64(&mut r)?;
    if n > cache_len / 28 {
        return Err(bad());
    }
    let n = n as usize;
    fn arr<const N: usize, T>(
        r: &mut impl Read,
        n: usize,
        f: fn([u8; N]) -> T,
    ) -> std::io::Result<Vec<T>> {
        let mut raw = vec![0u8; n * N];
        r.read_exact(&mut raw)?;
        Ok(raw
            .chunks_exact(N)
            .map(|c| f(c.try_into().unwrap()))
            .collect())
    }
    idx.offsets = arr(&mut r, n, u64::from_le_bytes)?;
    idx.lens = arr(&mut r, n, u32::from_le_bytes)?;
    idx.lines = arr(&mut r, n, u32::from_le_bytes)?;
    idx.src_len = arr(&mut r, n, u16::from_le_bytes)?;
    idx.tgt_len = arr(&mut r, n, u16::from_le_bytes)?;
    idx.hashes = arr(&mut r, n, u64::from_le_bytes)?;
    let in_data = |(&o, &l): (&u64, &u32)| match &idx.reader {
        Reader::Table(table, _) => {
            (o as usize) < table.num_batches() && (l as u64) < table.batch_rows(o as usize)
        }
        _ => {
            l as usize <= MAX_RECORD_BYTES && o.checked_add(l as u64).is_some_and(|e| e <= data_len)
        }
    };
    if !idx.offsets.iter().zip(&idx.lens).all(in_data) {
        return Err(bad());
    }
    let m = read_u64(&mut r)?;
    if m > cache_len {
        return Err(bad());
    }
    let m = m as usize;
    let mut meta = vec![0u8; m];
    r.read_exact(&mut meta)?;
    let mut identity = [0u8; 32];
    r.read_exact(&mut identity)?;
    idx.identity = Identity::from_bytes(&identity);
    idx.content = read_u64(&mut r)?;
    if read_u64(&mut r)? != cache_checksum(idx, &meta) {
        return Err(bad());
    }
    let meta: CacheMeta = serde_json::from_slice(&meta).map_err(|_| bad())?;
    idx.skipped = meta.skipped;
    idx.examples = meta.examples;
    Ok(())
}
