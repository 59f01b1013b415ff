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
use crate::compress::Compression;
use crate::error::{LoaderError, Result};
use crate::formats::{self, Columns, Format, Parsed, Skip, MAX_RECORD_BYTES};
use crate::hash::{hash_file, hash_parts, mix, HashingReader};
use crate::render::Renderer;
use crate::split::{read_line_bounded, CsvRecords};
use crate::tokenize::Tok;

const MAGIC: &[u8; 8] = b"RLIDX004";
const CHUNK: usize = 1024;
/// Bad-record examples kept per file.
pub const MAX_EXAMPLES: usize = 10;

/// A skipped record kept as an example.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Example {
    pub path: String,
    pub line: u64,
    pub reason: String,
    pub detail: String,
}

impl std::fmt::Display for Example {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: {} ({})",
            self.path, self.line, self.reason, self.detail
        )
    }
}

/// Everything the loader needs to know about one file.
#[derive(Debug)]
pub struct FileIndex {
    pub path: PathBuf,
    /// The file read at random offsets: `path` itself, or its decompressed copy.
    pub data_path: PathBuf,
    pub format: Format,
    pub columns: Option<Columns>,
    pub key: u64,
    pub offsets: Vec<u64>,
    pub lens: Vec<u32>,
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

    /// Reads and parses record `i` (an index into this file's valid records).
    pub fn read(&self, file: &File, i: usize) -> Result<Parsed> {
        let mut buf = vec![0u8; self.lens[i] as usize];
        file.read_exact_at(&mut buf, self.offsets[i])
            .map_err(|e| LoaderError::io(self.data_path.display(), "cannot read record", &e))?;
        let parsed = match self.format {
            Format::Jsonl => formats::parse_jsonl(&buf),
            f => {
                let mut rdr = csv::ReaderBuilder::new()
                    .has_headers(false)
                    .flexible(true)
                    .from_reader(&buf[..]);
                let mut rec = csv::ByteRecord::new();
                match rdr.read_byte_record(&mut rec) {
                    Ok(true) => {
                        formats::parse_csv(&rec, f, self.columns.as_ref().expect("csv columns"))
                    }
                    _ => Err(Skip::new("malformed_csv", "record changed since indexing")),
                }
            }
        };
        parsed.map_err(|s| {
            LoaderError::data(
                self.path.display(),
                self.lines[i] as u64,
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
    pub cache_dir: Option<PathBuf>,
    pub strict: bool,
}

/// Expands paths and globs, in the given order (each glob sorted). An existing path is taken as it is, even with
/// `[`, `*` or `?` in its name; a glob skips hidden files (the loader's own `.<name>.<key>.rlidx` caches live
/// beside the data). A file named twice, literally or through overlapping globs, is an error: it would be read
/// twice per epoch.
pub fn expand_paths(patterns: &[String]) -> Result<Vec<PathBuf>> {
    if patterns.is_empty() {
        return Err(LoaderError::Config("no data paths given".into()));
    }
    let mut out: Vec<PathBuf> = Vec::new();
    let mut seen: std::collections::HashMap<(u64, u64), String> = std::collections::HashMap::new();
    for p in patterns {
        let literal = PathBuf::from(p);
        let meta = std::fs::metadata(&literal);
        let found = if meta.is_ok() || !p.contains(['*', '?', '[']) {
            match meta {
                Ok(m) if m.is_file() => vec![literal],
                Ok(_) => return Err(LoaderError::file(p, "not a regular file")),
                Err(e) => return Err(path_error(&literal, "", &e)),
            }
        } else {
            // Hidden files only when the pattern's file name asks for them (`.*.csv`). (glob's own
            // require_literal_leading_dot drops every hidden entry, even for such a pattern.)
            let hidden_wanted = Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            let entries =
                glob::glob(p).map_err(|e| LoaderError::file(p, format!("bad glob: {e}")))?;
            let mut found = Vec::new();
            for entry in entries {
                let path = entry.map_err(|e| {
                    LoaderError::io(
                        e.path().display(),
                        &format!("cannot read while expanding {p}"),
                        e.error(),
                    )
                })?;
                let hidden = path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'));
                if !hidden_wanted && hidden {
                    continue;
                }
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => found.push(path),
                    Ok(_) => {} // a directory matched by the glob
                    // A broken symlink or a loop: a file the user meant, not to be skipped silently.
                    Err(e) => return Err(path_error(&path, "", &e)),
                }
            }
            if found.is_empty() {
                return Err(LoaderError::file(
                    shown_path(Path::new(p)),
                    "glob matches no file",
                ));
            }
            found.sort();
            found
        };
        for path in found {
            // Device and inode: the same file through a symlink, a hard link or another spelling of the path.
            let id = std::fs::metadata(&path)
                .map(|m| (m.dev(), m.ino()))
                .map_err(|e| LoaderError::io(path.display(), "", &e))?;
            if let Some(first) = seen.insert(id, p.clone()) {
                return Err(LoaderError::file(
                    path.display(),
                    format!("named twice (by {first:?} and {p:?}); each file must be listed once"),
                ));
            }
            out.push(path);
        }
    }
    Ok(out)
}

/// `path` as the user gave it, with the directory a relative path was resolved against: `data/x.csv (resolved
/// against /home/u/proj)`.
pub fn shown_path(path: &Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => {
            format!("{} (resolved against {})", path.display(), cwd.display())
        }
        _ => path.display().to_string(),
    }
}

/// The operating system's number for "too many levels of symbolic links".
#[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
const ELOOP: i32 = 62;
#[cfg(not(any(target_os = "macos", target_os = "ios", target_os = "freebsd")))]
const ELOOP: i32 = 40;

/// The error for a path that cannot be opened: a symlink loop or a broken symlink said as such, a missing
/// relative path with the directory it was resolved against; the errno kept. `context` (may be empty) says what
/// was being done.
pub fn path_error(path: &Path, context: &str, e: &std::io::Error) -> LoaderError {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let reason = if e.raw_os_error() == Some(ELOOP) {
        "symlink loop (too many levels of symbolic links, ELOOP)".to_string()
    } else if e.kind() == std::io::ErrorKind::NotFound && link {
        let target =
            std::fs::read_link(path).map_or_else(|_| "?".into(), |t| t.display().to_string());
        format!("broken symlink: it points to {target}, which does not exist")
    } else if e.kind() == std::io::ErrorKind::NotFound {
        "no such file".to_string()
    } else {
        e.to_string()
    };
    LoaderError::File {
        path: shown_path(path),
        reason: if context.is_empty() {
            reason
        } else {
            format!("{context}: {reason}")
        },
        errno: e.raw_os_error(),
    }
}

/// The cache directory used when the data's directory is not writable.
pub fn cache_root(cache_dir: Option<&Path>) -> PathBuf {
    if let Some(d) = cache_dir {
        return d.to_path_buf();
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("recipe-trainer");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("recipe-trainer")
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

/// Writes via a temporary file and rename, so a reader never sees half a file.
fn write_atomic(
    dest: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let tmp = dest.with_extension(format!("tmp{}", std::process::id()));
    let res = (|| {
        let mut f = File::create(&tmp)?;
        write(&mut f)?;
        f.flush()?;
        std::fs::rename(&tmp, dest)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// The decompressed copy of `path`, made once per version of the compressed file: its key has the inode and
/// ctime too, so a compressed file rewritten with the same size and mtime gets a new copy (and `chmod` one more
/// decompression).
fn decompress(
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

/// Builds the index of one file, or loads it from the cache. What the user should know but that does not stop
/// the loader (a cache that could not be written) is pushed to `warnings`; the Python layer logs it.
pub fn index_file(path: &Path, s: &IndexSettings, warnings: &mut Vec<String>) -> Result<FileIndex> {
    let meta = std::fs::metadata(path).map_err(|e| LoaderError::io(path.display(), "", &e))?;
    if meta.len() == 0 {
        return Err(LoaderError::file(path.display(), "empty file"));
    }
    let root = cache_root(s.cache_dir.as_deref());
    let (comp, stem) = Compression::split(path);
    let data_path = if comp == Compression::None {
        path.to_path_buf()
    } else {
        decompress(path, comp, &stem, &root, s.cancel)?
    };
    let first_byte =
        first_content_byte(&data_path).map_err(|e| LoaderError::io(path.display(), "", &e))?;
    let Some(first_byte) = first_byte else {
        return Err(LoaderError::file(path.display(), "empty file"));
    };
    let ext = Path::new(&stem)
        .extension()
        .map(|e| e.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let mut header = None;
    let format = match s.format {
        Some(f) => f,
        None => match ext.as_str() {
            "jsonl" | "json" | "ndjson" => Format::Jsonl,
            "csv" => {
                let h = read_header(&data_path, path)?;
                let f = formats::sniff_csv(&h).ok_or_else(|| {
                    LoaderError::data(path.display(), 1, "CSV header has neither `directions` (RecipeNLG) nor `steps` (Food.com)")
                })?;
                header = Some(h);
                f
            }
            _ => {
                return Err(LoaderError::file(
                    path.display(),
                    "cannot tell the format from the extension (.csv, .jsonl, .json, optionally .gz/.zst); pass data_format",
                ))
            }
        },
    };
    if format == Format::Jsonl && first_byte == b'[' {
        return Err(LoaderError::data(
            path.display(),
            1,
            "a JSON array, not JSON Lines (one object per line); convert it with `jq -c '.[]' FILE > FILE.jsonl`",
        ));
    }
    let columns = match format {
        Format::Jsonl => None,
        f => {
            let h = match header {
                Some(h) => h,
                None => read_header(&data_path, path)?,
            };
            Some(Columns::from_header(f, &h).map_err(|e| LoaderError::data(path.display(), 1, e))?)
        }
    };
    let st = stamp(path)?;
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
        columns,
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
                return Err(LoaderError::data(
                    &ex.path,
                    ex.line,
                    format!("{} ({})", ex.reason, ex.detail),
                ));
            }
        }
    } else {
        scan(&mut idx, s)?;
        idx.identity = now;
        if idx.is_empty() && idx.skipped.is_empty() {
            return Err(LoaderError::file(path.display(), "empty file: no records"));
        }
        if !candidates.iter().any(|c| save_cache(c, &idx).is_ok()) {
            warnings.push(format!(
                "could not write the index cache of {} (beside it or in {}): the next run indexes it again",
                path.display(),
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
    let shown = idx.path.display().to_string();
    let file = File::open(&idx.data_path).map_err(|e| LoaderError::io(&shown, "", &e))?;
    // The content hash of what is indexed, computed on the way (both readers below read to the end).
    let mut hashing = HashingReader::new(CancellableRead::new(file, s.cancel));
    let f = &mut hashing;
    let io_err = |e: std::io::Error| LoaderError::io(&shown, "read error", &e);
    match idx.format {
        Format::Jsonl => {
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
                process_chunk(idx, s, chunk)?;
            }
        }
        Format::RecipeNlg | Format::FoodCom => {
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
                process_chunk(idx, s, chunk)?;
            }
        }
    }
    idx.content = hashing.digest();
    Ok(())
}

fn process_chunk(idx: &mut FileIndex, s: &IndexSettings, chunk: Vec<Raw>) -> Result<()> {
    cancel::check(s.cancel)?;
    let format = idx.format;
    let cols = idx.columns.clone();
    let results: Vec<std::result::Result<Entry, Skip>> = chunk
        .par_iter()
        .map(|raw| {
            if raw.len as usize > MAX_RECORD_BYTES {
                return Err(Skip::new(
                    "over_long",
                    format!("record of {} bytes (limit {MAX_RECORD_BYTES})", raw.len),
                ));
            }
            let parsed = match &raw.data {
                RawData::Line(b) => formats::parse_jsonl(b)?,
                RawData::Csv(rec) => {
                    formats::parse_csv(rec, format, cols.as_ref().expect("csv columns"))?
                }
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
                if s.strict {
                    return Err(LoaderError::data(
                        idx.path.display(),
                        raw.line,
                        format!("{} ({})", skip.reason, skip.detail),
                    ));
                }
                *idx.skipped.entry(skip.reason.to_string()).or_default() += 1;
                if idx.examples.len() < MAX_EXAMPLES {
                    idx.examples.push(Example {
                        path: idx.path.display().to_string(),
                        line: raw.line,
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
    let in_data = |(&o, &l): (&u64, &u32)| {
        l as usize <= MAX_RECORD_BYTES && o.checked_add(l as u64).is_some_and(|e| e <= data_len)
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
