//! What the fuzz targets do with one input, shared with the replay of their corpora in `cargo test`
//! (`tests/it/fuzz_corpus.rs` includes this file). Any bytes may come in: a reader may refuse them with an
//! error, never panic, hang or allocate without bound.
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::OnceLock;

use recipe_core::formats::ColumnNames;
use recipe_core::index::{index_file, FileIndex, IndexSettings};
use recipe_core::records::{Prompter, ReadOptions};
use recipe_core::render::Renderer;
use recipe_core::scratch::ScratchDir;
use recipe_core::tokenize::Tok;

/// The names a fuzzed file is given: every format and compression the loader reads.
pub const FILE_NAMES: [&str; 16] = [
    "data.csv",
    "data.jsonl",
    "data.parquet",
    "data.arrow",
    "data.csv.gz",
    "data.jsonl.gz",
    "data.csv.zst",
    "data.jsonl.zst",
    "data.parquet.gz",
    "data.arrow.zst",
    "data.json",
    "data.feather",
    "DATA.CSV.GZ",
    "data.ndjson.zstd",
    "data.pq",
    "data.ipc",
];

/// The `columns` options a fuzzed file is read with: the format's own names, a source/target pair, recipe
/// fields under other names.
fn column_names(choice: u8) -> ColumnNames {
    let pairs: &[(&str, &str)] = match choice % 3 {
        0 => &[],
        1 => &[("source", "question"), ("target", "answer")],
        _ => &[
            ("title", "name"),
            ("ingredients", "items"),
            ("directions", "steps"),
        ],
    };
    let map: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ColumnNames::new(&map).expect("known fields")
}

/// The test tokenizer, loaded once per process: loading it per input would be most of the time. This file is
/// compiled in two crates (the fuzz targets under `fuzz/`, the core's tests): the tokenizer is under the core.
fn tokenizer() -> &'static Tok {
    static TOK: OnceLock<Tok> = OnceLock::new();
    TOK.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = ["../tests/data/tokenizer.json", "tests/data/tokenizer.json"]
            .iter()
            .map(|p| manifest.join(p))
            .find(|p| p.is_file())
            .expect("the test tokenizer");
        Tok::load(&path, 64, 96).expect("the test tokenizer loads")
    })
}

fn renderer() -> Renderer {
    Renderer::new("ingredients-to-recipe", None, None).expect("the preset's templates")
}

/// Indexes `path` as the loader does and reads, renders and tokenizes every record it kept.
fn index_and_read(
    path: &Path,
    cache: &Path,
    names: &ColumnNames,
    strict: bool,
) -> Option<FileIndex> {
    let renderer = renderer();
    let cancel = AtomicBool::new(false);
    let settings = IndexSettings {
        cancel: &cancel,
        tok: tokenizer(),
        renderer: &renderer,
        max_source: 64,
        max_target: 96,
        format: None,
        names: names.clone(),
        cache_dir: Some(cache.to_path_buf()),
        strict,
    };
    let idx = index_file(path, &settings, &mut Vec::new()).ok()?;
    let prompter = Prompter::new("ingredients-to-recipe", None, None, None).expect("the preset");
    let opts = ReadOptions {
        names: names.clone(),
        ..ReadOptions::default()
    };
    let mut file: Option<File> = None;
    for i in 0..idx.len() {
        let _ = idx.place(i);
        if let Ok(parsed) = idx.read(&mut file, i) {
            if let Ok(Some(r)) = prompter.render(i.to_string(), &parsed, &opts) {
                let _ = tokenizer().encode(&r.source, r.reference.as_deref().unwrap_or(""));
            }
        }
    }
    Some(idx)
}

/// One data file: the first byte picks the file's name (its format and compression), the `columns` option and
/// strict reading; the rest is the file. The file is indexed as the loader does, every record read back, and
/// the whole file read again by the sequential reader (`trainer generate --input`, `trainer evaluate`).
pub fn read_file(data: &[u8]) {
    let Some((&choice, bytes)) = data.split_first() else {
        return;
    };
    let dir = ScratchDir::new().expect("a scratch directory");
    let path = dir
        .path()
        .join(FILE_NAMES[choice as usize % FILE_NAMES.len()]);
    std::fs::write(&path, bytes).expect("the fuzzed file is written");
    let names = column_names(choice >> 4);
    let strict = choice & 0x80 != 0;
    index_and_read(&path, &dir.path().join("cache"), &names, strict);
    let prompter = Prompter::new("ingredients-to-recipe", None, None, None).expect("the preset");
    let opts = ReadOptions {
        names,
        ..ReadOptions::default()
    };
    let _ = prompter.read(&[path.display().to_string()], &opts);
}

/// The recipes the index cache target indexes: three good records and one the index skips.
pub const CACHED_CSV: &str = "title,ingredients,directions,NER\n\
    Toast,\"[\"\"bread\"\"]\",\"[\"\"Toast it.\"\"]\",\"[\"\"bread\"\"]\"\n\
    Tea,\"[\"\"tea\"\", \"\"water\"\"]\",\"[\"\"Boil.\"\", \"\"Steep.\"\"]\",\"[\"\"tea\"\"]\"\n\
    Soup,\"[\"\"stock\"\"]\",\"[\"\"Heat.\"\"]\",\"[\"\"stock\"\"]\"\n\
    Empty,[],[],[]\n";

/// A damaged index cache read back: a small CSV is indexed (which writes its cache beside it), the cache is
/// damaged as `edits` say (see [`damage`]), and the file is indexed and read again: the same records, from the
/// cache or from indexing the file again.
pub fn index_cache(edits: &[u8]) {
    let dir = ScratchDir::new().expect("a scratch directory");
    let path = dir.path().join("recipes.csv");
    std::fs::write(&path, CACHED_CSV).expect("the recipes are written");
    let cache = dir.path().join("cache");
    let names = ColumnNames::default();
    let first = index_and_read(&path, &cache, &names, false).expect("the good file indexes");
    let Some(cached) = cache_file(dir.path()) else {
        panic!("no index cache was written beside {}", path.display());
    };
    let genuine = std::fs::read(&cached).expect("the cache reads");
    std::fs::write(&cached, damage(&genuine, edits)).expect("the damaged cache is written");
    let again =
        index_and_read(&path, &cache, &names, false).expect("a damaged cache is indexed again");
    assert_eq!(
        again.len(),
        first.len(),
        "the same records through a damaged cache"
    );
}

/// `cache` changed by `edits`: their first two bytes (little-endian) are the length it is cut to (65535: not
/// cut), the rest is XORed onto it after its magic and key (which a damage there only refuses), and what goes
/// past its end is appended. No edits: the cache as it was written.
pub fn damage(cache: &[u8], edits: &[u8]) -> Vec<u8> {
    let mut damaged = cache.to_vec();
    if let [lo, hi, flips @ ..] = edits {
        let cut = u16::from_le_bytes([*lo, *hi]) as usize;
        for (i, flip) in flips.iter().enumerate() {
            match damaged.get_mut(16 + i) {
                Some(byte) => *byte ^= flip,
                None => damaged.push(*flip),
            }
        }
        if cut != u16::MAX as usize {
            damaged.truncate(cut);
        }
    }
    damaged
}

/// The `.rlidx` file in `dir`.
pub fn cache_file(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "rlidx"))
}
