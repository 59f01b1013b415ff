//! Seeded generator of realistic recipes in the real dumps' formats: test and benchmark data, outside the
//! production loader (`trainer data sample`, the loader's tests and benchmarks use it).
//!
//! Formats, written exactly as the public dumps are:
//! - RecipeNLG `full_dataset.csv`: an unnamed index column, then `title,ingredients,directions,link,source,NER`;
//!   the list columns hold JSON arrays as strings.
//! - Food.com `RAW_recipes.csv`: `name,id,minutes,contributor_id,submitted,tags,nutrition,n_steps,steps,
//!   description,ingredients,n_ingredients`; the list columns hold Python list literals (as `repr` writes them).
//! - JSONL: one object per line with `title`, `ingredients`, `directions` and `NER`.
//! - Parquet and Arrow IPC (file): RecipeNLG's columns as Hugging Face's `recipe_nlg` holds them: `title`,
//!   `ingredients`, `directions`, `link`, `source`, `NER`, the list columns as lists of strings.
//!
//! A file's name says its format, as the loader reads it ([`Format::from_path`]): `.csv`, `.jsonl`, `.parquet`,
//! `.arrow`, each optionally `.gz`/`.zst`. The output depends only on `(n, seed, format)`: the PRNG is the
//! loader's hand-written xoshiro256** ([`recipe_core::hash::Rng`]), so no dependency upgrade can change it.
//! Content is built from recipe-shaped templates over frequency-ordered word lists plus a Zipf-weighted tail of
//! synthetic words, so a tokenizer trained on it sees a long-tailed vocabulary of a few thousand words.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use arrow_array::builder::{ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use recipe_core::compress::Compression;
use recipe_core::formats::{Format, EXTENSIONS};
use recipe_core::hash::Rng;

mod words;
use words::words;

/// Output layout of [`write_sample`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleFormat {
    /// RecipeNLG `full_dataset.csv`.
    RecipeNlgCsv,
    /// Food.com `RAW_recipes.csv`.
    FoodComCsv,
    /// One JSON object per line.
    Jsonl,
    /// RecipeNLG's columns in a Parquet file (snappy, as pandas and pyarrow write it).
    Parquet,
    /// RecipeNLG's columns in an Arrow IPC file.
    Arrow,
}

/// Recipes per record batch (Parquet row group: pyarrow writes larger ones; the reader does not care).
const BATCH_ROWS: u64 = 8192;

impl SampleFormat {
    /// The names the CLI uses.
    pub const NAMES: [&'static str; 5] =
        ["recipenlg-csv", "foodcom-csv", "jsonl", "parquet", "arrow"];

    /// Parses one of [`SampleFormat::NAMES`].
    pub fn parse(name: &str) -> Result<Self, SampleError> {
        match name {
            "recipenlg-csv" => Ok(Self::RecipeNlgCsv),
            "foodcom-csv" => Ok(Self::FoodComCsv),
            "jsonl" => Ok(Self::Jsonl),
            "parquet" => Ok(Self::Parquet),
            "arrow" => Ok(Self::Arrow),
            other => Err(SampleError::BadFormat(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::RecipeNlgCsv => "recipenlg-csv",
            Self::FoodComCsv => "foodcom-csv",
            Self::Jsonl => "jsonl",
            Self::Parquet => "parquet",
            Self::Arrow => "arrow",
        }
    }

    /// The format `path`'s name says (`.csv`: RecipeNLG CSV, or Food.com CSV when `requested`); `requested`,
    /// if given, must be that format. Errors name the file: an unknown suffix, a format that does not match it.
    pub fn for_path(path: &Path, requested: Option<SampleFormat>) -> Result<Self, SampleError> {
        let by_name = match Format::from_path(path).1 {
            None => return Err(SampleError::UnknownSuffix(path.display().to_string())),
            Some(Format::RecipeNlg | Format::FoodCom) => match requested {
                Some(Self::FoodComCsv) => Self::FoodComCsv,
                _ => Self::RecipeNlgCsv,
            },
            Some(Format::Jsonl) => Self::Jsonl,
            Some(Format::Parquet) => Self::Parquet,
            Some(Format::Arrow) => Self::Arrow,
        };
        match requested {
            Some(r) if r != by_name => Err(SampleError::Mismatch {
                path: path.display().to_string(),
                requested: r,
                by_name,
            }),
            _ => Ok(by_name),
        }
    }
}

/// What can go wrong while writing a sample.
#[derive(Debug)]
pub enum SampleError {
    /// Unknown format name.
    BadFormat(String),
    /// A file name whose suffix names no format.
    UnknownSuffix(String),
    /// A format asked for that the file's suffix contradicts.
    Mismatch {
        path: String,
        requested: SampleFormat,
        by_name: SampleFormat,
    },
    /// Creating or writing the output failed.
    Io { path: String, source: io::Error },
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadFormat(name) => write!(
                f,
                "unknown sample format {name:?}; expected one of {}",
                SampleFormat::NAMES.join(", ")
            ),
            Self::UnknownSuffix(path) => write!(
                f,
                "{path}: the file name says no format; end it in {EXTENSIONS}"
            ),
            Self::Mismatch {
                path,
                requested,
                by_name,
            } => write!(
                f,
                "{path}: format {} does not match the file name, which says {}; rename the file or drop the format",
                requested.name(),
                by_name.name()
            ),
            Self::Io { path, source } => write!(f, "{path}: {source}"),
        }
    }
}

impl std::error::Error for SampleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Writes `n` recipes generated from `seed` to `path` in the format its name says ([`SampleFormat::for_path`],
/// `requested` checked against it), compressed as its name says ([`Compression::split`]: `.gz`, `.zst`,
/// `.zstd`, any case), so the loader reads back what was written. Returns the format written.
pub fn write_sample_file(
    path: &Path,
    n: u64,
    seed: u64,
    requested: Option<SampleFormat>,
) -> Result<SampleFormat, SampleError> {
    let format = SampleFormat::for_path(path, requested)?;
    let io_err = |source: io::Error| SampleError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io_err)?);
    match Compression::from_path(path) {
        Compression::None => {
            let mut w = file;
            write_sample(&mut w, n, seed, format).map_err(io_err)?;
            w.flush().map_err(io_err)?;
        }
        Compression::Gzip => {
            // Level 1: the compressor, not the generator, sets the pace (about 2x faster than level 6,
            // for files about 1.7x larger).
            let mut w = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
            write_sample(&mut w, n, seed, format).map_err(io_err)?;
            w.finish().map_err(io_err)?.flush().map_err(io_err)?;
        }
        Compression::Zstd => {
            let mut w = zstd::stream::write::Encoder::new(file, 3).map_err(io_err)?;
            write_sample(&mut w, n, seed, format).map_err(io_err)?;
            w.finish().map_err(io_err)?.flush().map_err(io_err)?;
        }
    }
    Ok(format)
}

/// Writes `n` recipes generated from `seed` to `out` in `format`.
pub fn write_sample<W: Write + Send>(
    out: &mut W,
    n: u64,
    seed: u64,
    format: SampleFormat,
) -> io::Result<()> {
    let mut gen = RecipeGen::new(seed);
    match format {
        SampleFormat::Jsonl => {
            let mut line = Vec::with_capacity(4096);
            for _ in 0..n {
                let r = gen.next_recipe();
                line.clear();
                line.extend_from_slice(b"{\"title\":");
                serde_json::to_writer(&mut line, &r.title)?;
                line.extend_from_slice(b",\"ingredients\":");
                serde_json::to_writer(&mut line, &r.ingredients)?;
                line.extend_from_slice(b",\"directions\":");
                serde_json::to_writer(&mut line, &r.directions)?;
                line.extend_from_slice(b",\"NER\":");
                serde_json::to_writer(&mut line, &r.ner)?;
                line.extend_from_slice(b"}\n");
                out.write_all(&line)?;
            }
            Ok(())
        }
        SampleFormat::RecipeNlgCsv => {
            let mut w = csv_writer(out);
            w.write_record([
                "",
                "title",
                "ingredients",
                "directions",
                "link",
                "source",
                "NER",
            ])?;
            let (mut ing, mut dir, mut ner) = (Vec::new(), Vec::new(), Vec::new());
            let mut link = String::new();
            for i in 0..n {
                link.clear();
                let (r, source) = gen.next_with_link(&mut link);
                for (buf, list) in [
                    (&mut ing, &r.ingredients),
                    (&mut dir, &r.directions),
                    (&mut ner, &r.ner),
                ] {
                    buf.clear();
                    serde_json::to_writer(&mut *buf, list)?;
                }
                let index = i.to_string();
                w.write_record([
                    index.as_bytes(),
                    r.title.as_bytes(),
                    &ing,
                    &dir,
                    link.as_bytes(),
                    source.as_bytes(),
                    &ner,
                ])?;
            }
            w.flush()?;
            Ok(())
        }
        SampleFormat::FoodComCsv => {
            let mut w = csv_writer(out);
            w.write_record([
                "name",
                "id",
                "minutes",
                "contributor_id",
                "submitted",
                "tags",
                "nutrition",
                "n_steps",
                "steps",
                "description",
                "ingredients",
                "n_ingredients",
            ])?;
            let mut f = FoodComFields::default();
            for i in 0..n {
                gen.next_foodcom(i, &mut f);
                w.write_record([
                    f.name.as_str(),
                    &f.id.to_string(),
                    &f.minutes.to_string(),
                    &f.contributor_id.to_string(),
                    &f.submitted,
                    &f.tags,
                    &f.nutrition,
                    &f.n_steps.to_string(),
                    &f.steps,
                    &f.description,
                    &f.ingredients,
                    &f.n_ingredients.to_string(),
                ])?;
            }
            w.flush()?;
            Ok(())
        }
        SampleFormat::Parquet | SampleFormat::Arrow => write_columnar(out, n, &mut gen, format),
    }
}

/// The RecipeNLG columns of Parquet and Arrow samples.
fn columnar_schema() -> Arc<Schema> {
    let list = || DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)));
    Arc::new(Schema::new(vec![
        Field::new("title", DataType::Utf8, false),
        Field::new("ingredients", list(), false),
        Field::new("directions", list(), false),
        Field::new("link", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, false),
        Field::new("NER", list(), false),
    ]))
}

/// The next `rows` recipes as a record batch of [`columnar_schema`].
fn columnar_batch(gen: &mut RecipeGen, rows: u64, schema: &Arc<Schema>) -> io::Result<RecordBatch> {
    let mut title = StringBuilder::new();
    let (mut ingredients, mut directions, mut ner) = (
        ListBuilder::new(StringBuilder::new()),
        ListBuilder::new(StringBuilder::new()),
        ListBuilder::new(StringBuilder::new()),
    );
    let (mut link, mut source) = (StringBuilder::new(), StringBuilder::new());
    let mut link_text = String::new();
    for _ in 0..rows {
        link_text.clear();
        let (r, from) = gen.next_with_link(&mut link_text);
        title.append_value(&r.title);
        for (builder, items) in [
            (&mut ingredients, &r.ingredients),
            (&mut directions, &r.directions),
            (&mut ner, &r.ner),
        ] {
            for item in items {
                builder.values().append_value(item);
            }
            builder.append(true);
        }
        link.append_value(&link_text);
        source.append_value(from);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(title.finish()),
        Arc::new(ingredients.finish()),
        Arc::new(directions.finish()),
        Arc::new(link.finish()),
        Arc::new(source.finish()),
        Arc::new(ner.finish()),
    ];
    // The builders' list items are nullable, as the schema says; the values are never null.
    RecordBatch::try_new(schema.clone(), columns).map_err(io::Error::other)
}

fn write_columnar<W: Write + Send>(
    out: &mut W,
    n: u64,
    gen: &mut RecipeGen,
    format: SampleFormat,
) -> io::Result<()> {
    let schema = columnar_schema();
    let batches = (0..n)
        .step_by(BATCH_ROWS as usize)
        .map(|start| BATCH_ROWS.min(n - start));
    if format == SampleFormat::Parquet {
        let props = parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .set_max_row_group_row_count(Some(BATCH_ROWS as usize))
            .build();
        let mut w = parquet::arrow::ArrowWriter::try_new(out, schema.clone(), Some(props))
            .map_err(io::Error::other)?;
        for rows in batches {
            w.write(&columnar_batch(gen, rows, &schema)?)
                .map_err(io::Error::other)?;
        }
        w.close().map_err(io::Error::other)?;
    } else {
        let mut w =
            arrow_ipc::writer::FileWriter::try_new(out, &schema).map_err(io::Error::other)?;
        for rows in batches {
            w.write(&columnar_batch(gen, rows, &schema)?)
                .map_err(io::Error::other)?;
        }
        w.finish().map_err(io::Error::other)?;
    }
    Ok(())
}

fn csv_writer<W: Write>(out: &mut W) -> csv::Writer<&mut W> {
    // pandas' to_csv (which wrote the real dumps) ends lines with \n and quotes only where needed.
    csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .buffer_capacity(1 << 16)
        .from_writer(out)
}

/// Appends `s` as Python's `repr(str)` writes it: single quotes, or double quotes when the text holds an
/// apostrophe and no double quote.
pub fn push_py_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    let plain = |c: char| {
        c != '\\' && c != quote && (c as u32) >= 0x20 && !(0x7f..0xa0).contains(&(c as u32))
    };
    if s.chars().all(plain) {
        // The common case: nothing to escape.
        out.push_str(s);
    } else {
        for c in s.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c if c == quote => {
                    out.push('\\');
                    out.push(c);
                }
                c if !plain(c) => {
                    let _ = write!(out, "\\x{:02x}", c as u32);
                }
                c => out.push(c),
            }
        }
    }
    out.push(quote);
}

/// Appends a Python list literal of strings, e.g. `['a', "cook's salt"]`.
pub fn push_py_list<S: AsRef<str>>(out: &mut String, items: &[S]) {
    out.push('[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_py_repr(out, item.as_ref());
    }
    out.push(']');
}

// ---------------------------------------------------------------------------------------------------------------
// PRNG

/// The generator's draws on the loader's PRNG.
trait Draws {
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize;
    fn chance(&mut self, p: f64) -> bool;
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T;
    /// A uniformly drawn word.
    fn word(&mut self, items: &[&'static str]) -> &'static str;
    /// Index drawn with probability proportional to 1/(rank+1)^s, via a precomputed cumulative table.
    fn zipf(&mut self, cdf: &[f64]) -> usize;
}

impl Draws for Rng {
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn word(&mut self, items: &[&'static str]) -> &'static str {
        items[self.below(items.len())]
    }

    fn zipf(&mut self, cdf: &[f64]) -> usize {
        let u = self.unit() * cdf[cdf.len() - 1];
        cdf.partition_point(|&c| c <= u).min(cdf.len() - 1)
    }
}

fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0;
    (0..n)
        .map(|i| {
            acc += 1.0 / ((i + 1) as f64).powf(s);
            acc
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Vocabulary

/// How an ingredient is measured, which decides its quantity and unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// flour, sugar, rice: cups, tablespoons, grams.
    Dry,
    /// milk, broth, oil: cups, tablespoons, ml.
    Liquid,
    /// spices and leaveners: teaspoons, pinches, "to taste".
    Spice,
    /// eggs, onions, apples: counted, often with a size ("2 large eggs").
    Count,
    /// meat and fish: pounds, ounces.
    Meat,
    /// canned or packaged goods: "1 (15 oz.) can".
    Can,
    /// butter, shortening: cups, tablespoons, sticks.
    Fat,
    /// cheese: cups shredded, ounces.
    Cheese,
    /// fresh herbs: tablespoons chopped, sprigs.
    Herb,
    /// garlic: cloves.
    Clove,
    /// a head of cabbage, a loaf of bread: one, often with a size.
    Whole,
}

use Kind::*;

/// How a dish is cooked, which decides the shape of its directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    Bake,
    Stove,
    Simmer,
    Cold,
    Grill,
    SlowCooker,
    Fry,
}

/// Syllables the synthetic long-tail words are made of.
const ONSETS: &[&str] = &[
    "b", "c", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "ch", "cr",
    "dr", "fl", "gr", "pl", "sh", "st", "tr", "qu",
];
const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ou", "ea", "ie", "y"];
const CODAS: &[&str] = &["", "", "", "n", "r", "l", "s", "t", "m", "sh", "nd", "rk"];

const SYNTHETIC_WORDS: usize = 3000;

struct Vocab {
    synthetic: Vec<String>,
    synthetic_title: Vec<String>,
    synthetic_cdf: Vec<f64>,
    savory_cdf: Vec<f64>,
    sweet_cdf: Vec<f64>,
    savory_main_cdf: Vec<f64>,
    sweet_main_cdf: Vec<f64>,
    adj_cdf: Vec<f64>,
    tag_cdf: Vec<f64>,
    contributor_cdf: Vec<f64>,
}

fn vocab() -> &'static Vocab {
    static VOCAB: OnceLock<Vocab> = OnceLock::new();
    VOCAB.get_or_init(|| {
        // A fixed seed: the word list is the same for every sample seed, as a language's vocabulary would be.
        let mut rng = Rng::new(0x5e_ed0f_f00d);
        let mut seen = std::collections::HashSet::new();
        let mut synthetic = Vec::with_capacity(SYNTHETIC_WORDS);
        while synthetic.len() < SYNTHETIC_WORDS {
            let mut w = String::new();
            for _ in 0..rng.range(2, 3) {
                w.push_str(rng.word(ONSETS));
                w.push_str(rng.word(VOWELS));
            }
            w.push_str(rng.word(CODAS));
            if seen.insert(w.clone()) {
                synthetic.push(w);
            }
        }
        let synthetic_title = synthetic.iter().map(|w| capitalize(w)).collect();
        Vocab {
            synthetic_cdf: zipf_cdf(synthetic.len(), 1.0),
            synthetic,
            synthetic_title,
            savory_cdf: zipf_cdf(words().savory.len(), 0.9),
            sweet_cdf: zipf_cdf(words().sweet.len(), 0.9),
            savory_main_cdf: zipf_cdf(words().savory_mains.len(), 0.8),
            sweet_main_cdf: zipf_cdf(words().sweet_mains.len(), 0.8),
            adj_cdf: zipf_cdf(words().title_adj.len(), 0.9),
            tag_cdf: zipf_cdf(words().foodcom_tags.len(), 0.7),
            contributor_cdf: zipf_cdf(5000, 1.1),
        }
    })
}

fn capitalize(w: &str) -> String {
    let mut c = w.chars();
    match c.next() {
        Some(first) => first.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Recipes

/// One generated recipe: the fields every format shares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Recipe {
    pub title: String,
    /// Lines with quantities and units, as RecipeNLG has them.
    pub ingredients: Vec<String>,
    pub directions: Vec<String>,
    /// Bare ingredient names, one per ingredient line.
    pub ner: Vec<String>,
    sweet: bool,
    method: Option<Method>,
}

/// The Food.com-only columns of one row, already rendered.
#[derive(Default)]
struct FoodComFields {
    name: String,
    id: u64,
    minutes: u32,
    contributor_id: u64,
    submitted: String,
    tags: String,
    nutrition: String,
    n_steps: usize,
    steps: String,
    description: String,
    ingredients: String,
    n_ingredients: usize,
}

/// An infinite, seeded stream of recipes.
pub struct RecipeGen {
    rng: Rng,
    /// Draws for format-only columns come from their own stream, so a seed gives the same recipes in every format.
    extra: Rng,
    vocab: &'static Vocab,
    recipe: Recipe,
    scratch: Vec<String>,
}

impl RecipeGen {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            extra: Rng::new(seed ^ 0xf0f0_5a5a_0ff1_ce00),
            vocab: vocab(),
            recipe: Recipe::default(),
            scratch: Vec::new(),
        }
    }

    /// The next recipe; the reference is valid until the next call.
    pub fn next_recipe(&mut self) -> &Recipe {
        let rng = &mut self.rng;
        let v = self.vocab;
        let r = &mut self.recipe;
        r.title.clear();
        r.ingredients.clear();
        r.directions.clear();
        r.ner.clear();

        r.sweet = rng.chance(0.35);
        let (main_name, main_title, main_kind) = if r.sweet {
            words().sweet_mains[rng.zipf(&v.sweet_main_cdf)]
        } else {
            words().savory_mains[rng.zipf(&v.savory_main_cdf)]
        };
        let (dish, method) = if r.sweet {
            *rng.pick(&words().sweet_dishes[..])
        } else {
            *rng.pick(&words().savory_dishes[..])
        };
        r.method = Some(method);

        // Ingredient count 5..=20, median about 10.
        let mut n_ing = 5 + rng.below(6) + rng.below(6);
        if rng.chance(0.12) {
            n_ing += rng.below(6);
        }
        let n_ing = n_ing.min(20);

        // The main ingredient first, then draws from the frequency-ordered pool without repeats; some items get a
        // synthetic variety name from the long tail.
        let pool: &[(&str, Kind)] = if r.sweet {
            &words().sweet[..]
        } else {
            &words().savory[..]
        };
        let cdf = if r.sweet { &v.sweet_cdf } else { &v.savory_cdf };
        let mut names: Vec<(String, Kind)> = Vec::with_capacity(n_ing);
        names.push((main_name.to_string(), main_kind));
        let mut tries = 0;
        while names.len() < n_ing && tries < 200 {
            tries += 1;
            let (name, kind) = if rng.chance(0.07) {
                let w = &v.synthetic[rng.zipf(&v.synthetic_cdf)];
                (
                    format!("{w} {}", rng.pick(&words().tail_nouns[..])),
                    if rng.chance(0.5) { Dry } else { Count },
                )
            } else {
                let (name, kind) = pool[rng.zipf(cdf)];
                if rng.chance(0.05) {
                    let w = &v.synthetic[rng.zipf(&v.synthetic_cdf)];
                    (format!("{w} {name}"), kind)
                } else {
                    (name.to_string(), kind)
                }
            };
            if !names.iter().any(|(n, _)| *n == name) {
                names.push((name, kind));
            }
        }
        for (name, kind) in names.iter_mut() {
            let mut line = String::with_capacity(48);
            *name = ingredient_line(rng, &mut line, name, *kind);
            r.ingredients.push(line);
            r.ner.push(name.clone());
        }

        // Title, e.g. "Creamy Garlic Chicken Casserole".
        let flavor = if r.sweet {
            rng.pick(&words().sweet_flavor[..])
        } else {
            rng.pick(&words().savory_flavor[..])
        };
        match rng.below(10) {
            0..=3 => {
                let _ = write!(
                    r.title,
                    "{} {flavor} {main_title} {dish}",
                    words().title_adj[rng.zipf(&v.adj_cdf)]
                );
            }
            4 | 5 => {
                let _ = write!(r.title, "{flavor} {main_title} {dish}");
            }
            6 => {
                let _ = write!(r.title, "{main_title} {dish}");
            }
            7 => {
                let _ = write!(r.title, "{main_title} {dish} with {flavor} Sauce");
            }
            8 => {
                let w = &v.synthetic_title[rng.zipf(&v.synthetic_cdf)];
                let _ = write!(r.title, "{w} {main_title} {dish}");
            }
            _ => {
                let _ = write!(
                    r.title,
                    "{} {main_title} {dish}",
                    words().title_adj[rng.zipf(&v.adj_cdf)]
                );
            }
        }

        // Steps 3..=15, with about 1% long outliers.
        let n_steps = if rng.chance(0.01) {
            rng.range(20, 60)
        } else {
            let mut s = 3 + rng.below(5) + rng.below(5);
            if rng.chance(0.1) {
                s += rng.below(5);
            }
            s.min(15)
        };
        directions(rng, r.sweet, method, &names, n_steps, &mut self.scratch);
        r.directions.append(&mut self.scratch);
        &self.recipe
    }

    /// The next recipe with a RecipeNLG-style link written to `link`, and the matching source.
    fn next_with_link(&mut self, link: &mut String) -> (&Recipe, &'static str) {
        self.next_recipe();
        let source = recipenlg_link(&mut self.extra, link);
        (&self.recipe, source)
    }

    /// The next recipe rendered as Food.com columns.
    fn next_foodcom(&mut self, index: u64, f: &mut FoodComFields) {
        self.next_recipe();
        foodcom_fields(&mut self.extra, self.vocab, &self.recipe, index, f);
    }
}

/// Fills `link` with a RecipeNLG-style link and returns the matching source.
fn recipenlg_link(rng: &mut Rng, link: &mut String) -> &'static str {
    let id = rng.range(1, 999_999);
    match rng.below(10) {
        0..=3 => {
            let _ = write!(link, "www.cookbooks.com/Recipe-Details.aspx?id={id}");
            "Gathered"
        }
        4 | 5 => {
            let _ = write!(link, "www.allrecipes.com/recipe/{id}/");
            "Recipes1M"
        }
        6 => {
            let _ = write!(link, "www.food.com/recipe/{id}");
            "Gathered"
        }
        7 => {
            let _ = write!(link, "www.epicurious.com/recipes/food/views/{id}");
            "Recipes1M"
        }
        8 => {
            let _ = write!(link, "www.myrecipes.com/recipe/{id}");
            "Gathered"
        }
        _ => {
            let _ = write!(link, "tastykitchen.com/recipes/{id}/");
            "Gathered"
        }
    }
}

fn foodcom_fields(rng: &mut Rng, v: &Vocab, r: &Recipe, index: u64, f: &mut FoodComFields) {
    // Food.com names are lower case and lose their apostrophes ("grandma s apple pie").
    f.name.clear();
    for c in r.title.chars().flat_map(char::to_lowercase) {
        f.name.push(if c == '\'' { ' ' } else { c });
    }
    f.id = 38 + index * 5 + rng.below(5) as u64;
    f.minutes = match r.method {
        Some(Method::SlowCooker) => rng.range(240, 600) as u32,
        Some(Method::Cold) => rng.range(5, 30) as u32,
        _ if rng.chance(0.02) => rng.range(600, 2880) as u32,
        _ => 5 * rng.range(2, 24) as u32,
    };
    f.contributor_id = 1533 + 137 * rng.zipf(&v.contributor_cdf) as u64;
    f.submitted.clear();
    let _ = write!(
        f.submitted,
        "{}-{:02}-{:02}",
        rng.range(1999, 2018),
        rng.range(1, 12),
        rng.range(1, 28)
    );

    let mut tags: Vec<&str> = Vec::with_capacity(16);
    let time_tag = match f.minutes {
        0..=15 => "15-minutes-or-less",
        16..=30 => "30-minutes-or-less",
        31..=60 => "60-minutes-or-less",
        61..=240 => "4-hours-or-less",
        _ => "time-to-make",
    };
    tags.push(time_tag);
    tags.push(if r.sweet { "desserts" } else { "main-dish" });
    for _ in 0..rng.range(3, 14) {
        let t = words().foodcom_tags[rng.zipf(&v.tag_cdf)];
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    f.tags.clear();
    push_py_list(&mut f.tags, &tags);

    // [calories, total fat, sugar, sodium, protein, saturated fat, carbohydrates] in %DV, one decimal as the
    // real dump has them (which Python's repr of these floats also gives).
    let cal = 50.0 + rng.unit() * 700.0;
    let mut nut = [cal, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    for x in nut.iter_mut().skip(1) {
        *x = (rng.unit() * cal / 6.0).floor();
    }
    f.nutrition.clear();
    f.nutrition.push('[');
    for (i, x) in nut.iter().enumerate() {
        if i > 0 {
            f.nutrition.push_str(", ");
        }
        // One decimal, written from integer tenths (float formatting is the slow part of this row).
        let tenths = (x * 10.0).round() as u64;
        let _ = write!(f.nutrition, "{}.{}", tenths / 10, tenths % 10);
    }
    f.nutrition.push(']');

    // Steps: lower case without the final period, as Food.com has them.
    f.n_steps = r.directions.len();
    f.steps.clear();
    f.steps.push('[');
    let mut step = String::with_capacity(128);
    for (i, s) in r.directions.iter().enumerate() {
        step.clear();
        let mut prev = ' ';
        for c in s.trim_end_matches('.').chars() {
            // Keep "350°F" readable: the degree sign's unit stays upper case.
            if prev == '°' {
                step.push(c);
            } else if c.is_ascii() {
                step.push(c.to_ascii_lowercase());
            } else {
                step.extend(c.to_lowercase());
            }
            prev = c;
        }
        if i > 0 {
            f.steps.push_str(", ");
        }
        push_py_repr(&mut f.steps, &step);
    }
    f.steps.push(']');

    f.description.clear();
    if !rng.chance(0.03) {
        let open = rng.pick(&words().desc_open[..]);
        f.description.push_str(open);
        if open.ends_with("from") {
            f.description.push(' ');
            f.description.push_str(rng.word(&words().person[..]));
        }
        f.description
            .push_str(if rng.chance(0.5) { ". " } else { "! " });
        if rng.chance(0.3) {
            let _ = write!(
                f.description,
                "the {} {} make it special. ",
                v.synthetic[rng.zipf(&v.synthetic_cdf)],
                rng.pick(&words().tail_nouns[..])
            );
        }
        if rng.chance(0.05) {
            // Real descriptions sometimes span lines; the CSV quoting must carry them.
            f.description.push_str("\r\n");
        }
        f.description.push_str(rng.word(&words().desc_close[..]));
    }

    // Food.com ingredients are bare names.
    f.n_ingredients = r.ner.len();
    f.ingredients.clear();
    push_py_list(&mut f.ingredients, &r.ner);
}

/// Writes a quantity such as "2", "1/2", "1 1/2", "½" or "1½".
fn quantity(rng: &mut Rng, out: &mut String, max_whole: usize) -> bool {
    const ASCII_FRAC: &[&str] = &["1/2", "1/3", "2/3", "1/4", "3/4", "1/8"];
    const UNI_FRAC: &[&str] = &["½", "⅓", "⅔", "¼", "¾", "⅛"];
    let whole = rng.below(max_whole + 1);
    let frac = whole == 0 || rng.chance(0.3);
    let unicode = rng.chance(0.2);
    if whole > 0 {
        let _ = write!(out, "{whole}");
    }
    if frac {
        let i = rng.below(ASCII_FRAC.len());
        if unicode {
            out.push_str(UNI_FRAC[i]);
        } else {
            if whole > 0 {
                out.push(' ');
            }
            out.push_str(ASCII_FRAC[i]);
        }
    }
    // Plural units when the amount exceeds one.
    whole > 1 || (whole == 1 && frac)
}

/// Picks the singular or plural form of a unit.
fn unit(plural: bool, one: &'static str, many: &'static str) -> &'static str {
    if plural {
        many
    } else {
        one
    }
}

/// "eggs" -> "egg", "tomatoes" -> "tomato", "peaches" -> "peach", "bay leaves" -> "bay leaf".
fn singular(name: &str) -> &str {
    if let Some(stem) = name.strip_suffix("leaves") {
        // Only "bay leaves" and "mint leaves" are counted; the caller writes "leaf" after the stem.
        return stem;
    }
    for suffix in ["oes", "ches", "shes"] {
        if name.ends_with(suffix) {
            return &name[..name.len() - 2];
        }
    }
    name.strip_suffix('s')
        .filter(|n| !n.ends_with('s'))
        .unwrap_or(name)
}

/// Writes one ingredient line such as "1 1/2 cups all-purpose flour, sifted" and returns the name as written.
fn ingredient_line(rng: &mut Rng, out: &mut String, name: &str, kind: Kind) -> String {
    let mut written = name.to_string();
    let notes: &[&str] = match kind {
        Dry => {
            let plural = quantity(rng, out, 3);
            let u = match rng.below(9) {
                0..=3 => unit(plural, "cup", "cups"),
                4 => "c.",
                5 => unit(plural, "tablespoon", "tablespoons"),
                6 => "Tbsp.",
                7 => "oz.",
                _ => "g",
            };
            let _ = write!(out, " {u} {name}");
            &[
                "divided", "packed", "sifted", "optional", "chopped", "toasted", "cooked",
            ]
        }
        Liquid => {
            let plural = quantity(rng, out, 3);
            let u = match rng.below(8) {
                0..=3 => unit(plural, "cup", "cups"),
                4 => "c.",
                5 => unit(plural, "tablespoon", "tablespoons"),
                6 => "ml",
                _ => "fl. oz.",
            };
            let _ = write!(out, " {u} {name}");
            &[
                "divided",
                "optional",
                "warmed",
                "or more to taste",
                "at room temperature",
                "chilled",
            ]
        }
        Spice => {
            if rng.chance(0.12) {
                let _ = write!(out, "{name} to taste");
                return written;
            }
            if rng.chance(0.08) {
                let _ = write!(
                    out,
                    "1 {} {name}",
                    if rng.chance(0.5) { "pinch" } else { "dash" }
                );
                return written;
            }
            let plural = quantity(rng, out, 2);
            let u = match rng.below(6) {
                0..=2 => unit(plural, "teaspoon", "teaspoons"),
                3 => "tsp.",
                4 => "Tbsp.",
                _ => unit(plural, "tablespoon", "tablespoons"),
            };
            let _ = write!(out, " {u} {name}");
            &[
                "optional",
                "divided",
                "or to taste",
                "freshly ground",
                "heaping",
            ]
        }
        Count => {
            let n = if rng.chance(0.3) { 1 } else { rng.range(2, 6) };
            if n == 1 {
                written = singular(name).to_string();
                if name.ends_with("leaves") {
                    written.push_str("leaf");
                }
            }
            if rng.chance(0.35) {
                let _ = write!(out, "{n} {} {written}", rng.pick(&words().sizes[..]));
            } else {
                let _ = write!(out, "{n} {written}");
            }
            if name == "eggs" {
                &[
                    "beaten",
                    "lightly beaten",
                    "at room temperature",
                    "separated",
                    "hard-boiled and chopped",
                ]
            } else {
                &[
                    "chopped",
                    "finely chopped",
                    "diced",
                    "sliced",
                    "thinly sliced",
                    "peeled and cubed",
                    "halved",
                    "seeded and chopped",
                    "quartered",
                    "peeled and grated",
                    "cut into wedges",
                ]
            }
        }
        Whole => {
            if rng.chance(0.5) {
                let _ = write!(out, "1 {} {name}", rng.pick(&words().sizes[..]));
            } else {
                let _ = write!(out, "{} {name}", *rng.pick(&["1", "1/2", "½", "2"]));
            }
            &[
                "chopped",
                "cut into bite-size pieces",
                "cored and shredded",
                "sliced",
                "cubed",
            ]
        }
        Meat => {
            if rng.chance(0.6) {
                let plural = quantity(rng, out, 3);
                let u = if rng.chance(0.5) {
                    "lb."
                } else {
                    unit(plural, "pound", "pounds")
                };
                let _ = write!(out, " {u} {name}");
            } else {
                let _ = write!(out, "{} oz. {name}", 2 * rng.range(2, 8));
            }
            &[
                "cut into 1-inch pieces",
                "cubed",
                "trimmed",
                "thinly sliced",
                "cooked and crumbled",
                "browned and drained",
                "patted dry",
                "chopped",
                "at room temperature",
            ]
        }
        Can => {
            let oz = *rng.pick(&[
                "8", "10 3/4", "14.5", "15", "16", "6", "4", "28", "10.5", "3.4", "8.5",
            ]);
            let n = if rng.chance(0.8) { 1 } else { rng.range(2, 3) };
            let (one, many) = *rng.pick(&[
                ("can", "cans"),
                ("pkg.", "pkg."),
                ("package", "packages"),
                ("jar", "jars"),
                ("container", "containers"),
                ("box", "boxes"),
            ]);
            let _ = write!(out, "{n} ({oz} oz.) {} {name}", unit(n > 1, one, many));
            &[
                "drained",
                "rinsed and drained",
                "undrained",
                "softened",
                "thawed",
                "divided",
            ]
        }
        Fat => {
            if rng.chance(0.15) {
                let _ = write!(out, "1/2 cup (1 stick) {name}");
            } else {
                let plural = quantity(rng, out, 2);
                let u = match rng.below(3) {
                    0 => unit(plural, "cup", "cups"),
                    1 => "c.",
                    _ => unit(plural, "tablespoon", "tablespoons"),
                };
                let _ = write!(out, " {u} {name}");
            }
            &[
                "melted",
                "softened",
                "at room temperature",
                "cut into pieces",
                "chilled",
                "divided",
            ]
        }
        Cheese => {
            if rng.chance(0.3) {
                let _ = write!(out, "{} oz. {name}", 4 * rng.range(1, 4));
                &[
                    "shredded", "grated", "cubed", "crumbled", "sliced", "divided",
                ]
            } else {
                let plural = quantity(rng, out, 2);
                let _ = write!(out, " {} shredded {name}", unit(plural, "cup", "cups"));
                &["divided", "plus more for serving"]
            }
        }
        Herb => {
            if rng.chance(0.3) {
                let _ = write!(out, "{} sprigs fresh {name}", rng.range(2, 6));
            } else {
                let plural = quantity(rng, out, 2);
                let _ = write!(
                    out,
                    " {} chopped fresh {name}",
                    unit(plural, "tablespoon", "tablespoons")
                );
            }
            &["leaves only", "plus more for garnish", "stems removed"]
        }
        Clove => {
            let n = rng.range(1, 6);
            let _ = write!(out, "{n} {} {name}", unit(n > 1, "clove", "cloves"));
            &[
                "minced",
                "crushed",
                "finely chopped",
                "thinly sliced",
                "peeled",
            ]
        }
    };
    if rng.chance(0.3) {
        let _ = write!(out, ", {}", rng.word(notes));
    }
    written
}

/// Joins names as "a", "a and b" or "a, b and c".
fn join_names(out: &mut String, names: &[(String, Kind)]) {
    for (i, (n, _)) in names.iter().enumerate() {
        if i > 0 {
            out.push_str(if i + 1 == names.len() { " and " } else { ", " });
        }
        out.push_str(n);
    }
}

fn temperature(rng: &mut Rng, out: &mut String) {
    const F: &[(u32, u32)] = &[
        (350, 175),
        (350, 175),
        (350, 175),
        (375, 190),
        (325, 165),
        (400, 200),
        (425, 220),
    ];
    let (f, c) = *rng.pick(F);
    if rng.chance(0.25) {
        let _ = write!(out, "{f}°F ({c}°C)");
    } else {
        let _ = write!(out, "{f}°F");
    }
}

/// Writes `n_steps` directions that walk through `names` in order.
fn directions(
    rng: &mut Rng,
    sweet: bool,
    method: Method,
    names: &[(String, Kind)],
    n_steps: usize,
    out: &mut Vec<String>,
) {
    let done = match (sweet, method) {
        (false, _) => &words().savory_done[..],
        (true, Method::Bake) => &words().sweet_done[..],
        (true, _) => &words().sweet_stove_done[..],
    };
    let bakes = matches!(method, Method::Bake);
    let mut s = String::with_capacity(128);

    // Opening and closing steps are fixed by the method; the middle consumes ingredients in small groups.
    let mut opening = 0;
    if bakes && rng.chance(0.8) {
        s.push_str("Preheat oven to ");
        temperature(rng, &mut s);
        s.push('.');
        if rng.chance(0.5) {
            let _ = write!(s, " Grease a {}.", rng.pick(&words().dish[..]));
        }
        out.push(std::mem::take(&mut s));
        opening = 1;
    }
    let closing = if n_steps - opening >= 3 { 2 } else { 1 };
    let middle = n_steps - opening - closing;

    let mut idx = 0;
    for step in 0..middle {
        let remaining = names.len() - idx;
        let left_steps = middle - step;
        let take = if remaining == 0 {
            0
        } else {
            remaining.div_ceil(left_steps).clamp(1, 4)
        };
        let group = &names[idx..idx + take];
        idx += take;
        if group.is_empty() {
            filler_step(rng, sweet, method, done, &mut s);
        } else {
            ingredient_step(rng, sweet, method, step, group, done, &mut s);
        }
        out.push(std::mem::take(&mut s));
    }

    // Closing: cook/bake, then rest and serve.
    match method {
        Method::Bake => {
            let _ = write!(s, "Bake at ");
            temperature(rng, &mut s);
            let m = 5 * rng.range(2, 12);
            let _ = write!(
                s,
                " for {m} to {} minutes, or until {}.",
                m + 5 * rng.range(1, 3),
                rng.pick(done)
            );
        }
        Method::Stove | Method::Fry => {
            let _ = write!(
                s,
                "Cook over {} heat, stirring occasionally, until {}, about {} minutes.",
                rng.pick(&words().heat[..]),
                rng.pick(done),
                rng.range(3, 20)
            );
        }
        Method::Simmer => {
            let _ = write!(
                s,
                "Bring to a boil; reduce heat, cover and simmer for {} minutes, or until {}.",
                5 * rng.range(2, 18),
                rng.pick(done)
            );
        }
        Method::Cold => {
            let _ = write!(
                s,
                "Cover and refrigerate for at least {} hours before serving.",
                rng.range(1, 8)
            );
        }
        Method::Grill => {
            let _ = write!(
                s,
                "Grill over {} heat for {} to {} minutes per side, or until {}.",
                rng.pick(&words().heat[..]),
                rng.range(3, 6),
                rng.range(7, 10),
                rng.pick(done)
            );
        }
        Method::SlowCooker => {
            let _ = write!(
                s,
                "Cover and cook on {} for {} hours.",
                if rng.chance(0.5) { "LOW" } else { "HIGH" },
                rng.range(3, 8)
            );
        }
    }
    out.push(std::mem::take(&mut s));
    if closing == 2 {
        match rng.below(6) {
            0 => {
                let _ = write!(
                    s,
                    "Serve with {}.",
                    rng.word(if sweet {
                        &words().serve_sweet[..]
                    } else {
                        &words().serve_savory[..]
                    })
                );
            }
            1 => {
                let _ = write!(s, "Let stand {} minutes before serving.", rng.range(5, 15));
            }
            2 => {
                let _ = write!(s, "Makes {} servings.", rng.range(2, 12));
            }
            3 if sweet => {
                let _ = write!(
                    s,
                    "Cool completely on a wire rack before cutting into {} squares.",
                    rng.range(12, 36)
                );
            }
            4 => {
                s.push_str("Don't overcook; it will continue to firm up as it cools.");
            }
            _ => {
                let _ = write!(
                    s,
                    "Garnish with {} and serve {}.",
                    rng.word(if sweet {
                        &words().garnish_sweet[..]
                    } else {
                        &words().garnish_savory[..]
                    }),
                    if rng.chance(0.5) {
                        "warm"
                    } else {
                        "immediately"
                    }
                );
            }
        }
        out.push(std::mem::take(&mut s));
    }
}

fn ingredient_step(
    rng: &mut Rng,
    sweet: bool,
    method: Method,
    step: usize,
    group: &[(String, Kind)],
    done: &[&str],
    s: &mut String,
) {
    let hot = matches!(method, Method::Stove | Method::Fry | Method::Simmer);
    if step == 0 && !sweet && hot && rng.chance(0.6) {
        let _ = write!(
            s,
            "Heat a {} {} over {} heat. Add ",
            rng.word(&["large", "medium", "heavy", "deep", "12-inch"]),
            rng.pick(&words().pan[..]),
            rng.pick(&words().heat[..])
        );
        join_names(s, group);
        let _ = write!(
            s,
            " and cook until {}, about {} minutes.",
            rng.pick(done),
            rng.range(2, 10)
        );
        return;
    }
    // Opening steps gather ingredients; sprinkling, folding and seasoning come later.
    let choice = if step == 0 {
        *rng.pick(&[0, 3, 4, 10, 11])
    } else {
        rng.below(12)
    };
    match choice {
        0 => {
            let _ = write!(s, "In a {} bowl, combine ", rng.pick(&words().bowl[..]));
            join_names(s, group);
            s.push('.');
        }
        1 => {
            s.push_str("Add ");
            join_names(s, group);
            let _ = write!(s, " and mix {}.", rng.pick(&words().mix_adverb[..]));
        }
        2 => {
            s.push_str("Stir in ");
            join_names(s, group);
            s.push('.');
        }
        3 => {
            s.push_str("Whisk together ");
            join_names(s, group);
            let _ = write!(
                s,
                " in a {} bowl until smooth.",
                rng.pick(&words().bowl[..])
            );
        }
        4 if !sweet && matches!(method, Method::Cold) => {
            s.push_str("Toss ");
            join_names(s, group);
            s.push_str(" together in a large bowl.");
        }
        4 if !sweet => {
            s.push_str("Add ");
            join_names(s, group);
            let _ = write!(
                s,
                " and cook, stirring often, until {}, about {} minutes.",
                rng.pick(done),
                rng.range(2, 12)
            );
        }
        4 => {
            s.push_str("Cream ");
            join_names(s, group);
            s.push_str(" until light and fluffy.");
        }
        5 => {
            s.push_str("Gradually beat in ");
            join_names(s, group);
            s.push_str(", beating well after each addition.");
        }
        6 => {
            s.push_str("Fold in ");
            join_names(s, group);
            s.push_str(" gently; don't overmix.");
        }
        7 => {
            s.push_str("Sprinkle ");
            join_names(s, group);
            s.push_str(" evenly over the top.");
        }
        8 if !sweet => {
            s.push_str("Season with ");
            join_names(s, group);
            s.push('.');
        }
        8 => {
            let _ = write!(s, "In a separate bowl, sift together ");
            join_names(s, group);
            s.push('.');
        }
        9 => {
            s.push_str("Place ");
            join_names(s, group);
            let _ = write!(s, " in a {} and toss to coat.", rng.pick(&words().dish[..]));
        }
        10 => {
            s.push_str("Mix ");
            join_names(s, group);
            let _ = write!(s, " {}; set aside.", rng.pick(&words().mix_adverb[..]));
        }
        _ => {
            s.push_str("Combine ");
            join_names(s, group);
            let _ = write!(
                s,
                " in a {} {}.",
                rng.word(&["large", "medium", "small"]),
                rng.pick(&words().pan[..])
            );
        }
    }
}

fn filler_step(rng: &mut Rng, sweet: bool, method: Method, done: &[&str], s: &mut String) {
    match rng.below(10) {
        0 => {
            let _ = write!(s, "Pour into a greased {}.", rng.pick(&words().dish[..]));
        }
        1 => {
            let _ = write!(s, "Cover and let stand for {} minutes.", rng.range(5, 30));
        }
        2 if !sweet => {
            let _ = write!(
                s,
                "Reduce heat to {} and simmer, uncovered, until {}.",
                rng.pick(&words().heat[..]),
                rng.pick(done)
            );
        }
        2 => {
            let _ = write!(s, "Chill the dough for {} minutes.", 15 * rng.range(1, 8));
        }
        3 => s.push_str("Drain well and set aside."),
        4 => s.push_str("Remove from heat and let cool slightly."),
        5 => s.push_str("Stir well, scraping the bottom of the pan."),
        6 if matches!(method, Method::Bake) => {
            s.push_str("Spread the mixture evenly in the prepared pan.");
        }
        6 => {
            let _ = write!(s, "Transfer to a {} bowl.", rng.pick(&words().bowl[..]));
        }
        7 => s.push_str("Taste and adjust the seasoning if needed."),
        8 => s.push_str("Repeat the layers with the remaining ingredients."),
        _ => {
            let _ = write!(
                s,
                "Mix {} and set aside.",
                rng.pick(&words().mix_adverb[..])
            );
        }
    }
}

// In the crate's one test binary rather than in tests/: each test binary links arrow, parquet and tokenizers
// under the release profile's LTO, about a minute on a 2-core machine.
#[cfg(test)]
mod loader_reads_samples;

#[cfg(test)]
mod tests {
    use super::*;
    use recipe_core::formats::parse_py_list;
    use std::io::Read;

    fn sample(n: u64, seed: u64, format: SampleFormat) -> Vec<u8> {
        let mut out = Vec::new();
        write_sample(&mut out, n, seed, format).unwrap();
        out
    }

    #[test]
    fn same_seed_same_bytes_and_other_seed_differs() {
        for format in [
            SampleFormat::RecipeNlgCsv,
            SampleFormat::FoodComCsv,
            SampleFormat::Jsonl,
        ] {
            let a = sample(200, 7, format);
            assert_eq!(a, sample(200, 7, format), "{format:?}");
            assert_ne!(a, sample(200, 8, format), "{format:?}");
        }
        // A prefix of a longer run is the shorter run: the stream does not depend on n.
        let short = sample(10, 3, SampleFormat::Jsonl);
        let long = sample(20, 3, SampleFormat::Jsonl);
        assert!(long.starts_with(&short));
    }

    #[test]
    fn recipenlg_csv_parses_back() {
        let data = sample(300, 1, SampleFormat::RecipeNlgCsv);
        let mut rd = csv::Reader::from_reader(&data[..]);
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        assert_eq!(
            header,
            [
                "",
                "title",
                "ingredients",
                "directions",
                "link",
                "source",
                "NER"
            ]
        );
        let mut rows = 0;
        for (i, row) in rd.records().enumerate() {
            let row = row.unwrap();
            assert_eq!(row.len(), 7);
            assert_eq!(row[0], i.to_string());
            let ing: Vec<String> = serde_json::from_str(&row[2]).unwrap();
            let dir: Vec<String> = serde_json::from_str(&row[3]).unwrap();
            let ner: Vec<String> = serde_json::from_str(&row[6]).unwrap();
            assert_eq!(ing.len(), ner.len());
            assert!(!dir.is_empty());
            assert!(!row[1].is_empty());
            assert!(row[5] == *"Gathered" || row[5] == *"Recipes1M");
            rows += 1;
        }
        assert_eq!(rows, 300);
    }

    #[test]
    fn py_repr_quotes_like_python() {
        let mut s = String::new();
        push_py_list(&mut s, &["salt", "cook's salt", "say \"hi\"", "it's \"x\""]);
        assert_eq!(s, r#"['salt', "cook's salt", 'say "hi"', 'it\'s "x"']"#);
        let mut s = String::new();
        push_py_repr(&mut s, "a\\b\nc");
        assert_eq!(s, r"'a\\b\nc'");
    }

    #[test]
    fn foodcom_csv_parses_back() {
        let data = sample(400, 2, SampleFormat::FoodComCsv);
        let mut rd = csv::Reader::from_reader(&data[..]);
        let header: Vec<String> = rd.headers().unwrap().iter().map(String::from).collect();
        assert_eq!(
            header,
            [
                "name",
                "id",
                "minutes",
                "contributor_id",
                "submitted",
                "tags",
                "nutrition",
                "n_steps",
                "steps",
                "description",
                "ingredients",
                "n_ingredients"
            ]
        );
        let mut apostrophes = 0;
        for row in rd.records() {
            let row = row.unwrap();
            assert_eq!(row.len(), 12);
            let steps = parse_py_list(&row[8]).unwrap();
            let ingredients = parse_py_list(&row[10]).unwrap();
            assert_eq!(steps.len(), row[7].parse::<usize>().unwrap());
            assert_eq!(ingredients.len(), row[11].parse::<usize>().unwrap());
            for item in ingredients.iter().chain(&steps) {
                if item.contains('\'') {
                    apostrophes += 1;
                    assert!(
                        row[8].contains(&format!("\"{item}\""))
                            || row[10].contains(&format!("\"{item}\""))
                    );
                }
                // Food.com ingredients are bare names: no leading quantity.
                assert!(!item.is_empty());
            }
            for ing in &ingredients {
                assert!(!ing.starts_with(|c: char| c.is_ascii_digit()), "{ing}");
            }
            let nutrition: Vec<f64> = row[6]
                .trim_matches(['[', ']'])
                .split(", ")
                .map(|x| x.parse().unwrap())
                .collect();
            assert_eq!(nutrition.len(), 7);
            assert_eq!(row[4].len(), 10);
            row[1].parse::<u64>().unwrap();
            row[2].parse::<u32>().unwrap();
        }
        assert!(
            apostrophes > 0,
            "the sample should exercise double-quoted items"
        );
    }

    #[test]
    fn counts_and_content_look_like_recipes() {
        let mut gen = RecipeGen::new(11);
        let n = 5000;
        let (mut long, mut unicode_frac, mut ascii_frac, mut fahrenheit) = (0, 0, 0, 0);
        let mut words = std::collections::HashSet::new();
        for _ in 0..n {
            let r = gen.next_recipe();
            assert!(
                (5..=20).contains(&r.ingredients.len()),
                "{}",
                r.ingredients.len()
            );
            assert_eq!(r.ner.len(), r.ingredients.len());
            assert!(r.directions.len() >= 3 && r.directions.len() <= 60);
            if r.directions.len() > 15 {
                long += 1;
            }
            let text = format!(
                "{} {} {}",
                r.title,
                r.ingredients.join(" "),
                r.directions.join(" ")
            );
            unicode_frac += text.contains(['½', '¼', '¾', '⅓', '⅔', '⅛']) as usize;
            ascii_frac += text.contains("1/2") as usize;
            fahrenheit += text.contains("°F") as usize;
            for w in text.split_whitespace() {
                words.insert(
                    w.trim_matches(|c: char| !c.is_alphanumeric())
                        .to_lowercase(),
                );
            }
            for (line, name) in r.ingredients.iter().zip(&r.ner) {
                assert!(line.contains(name.as_str()), "{line} / {name}");
            }
        }
        assert!((10..=150).contains(&long), "long outliers: {long}");
        assert!(unicode_frac > n / 10 && ascii_frac > n / 10 && fahrenheit > n / 10);
        assert!(words.len() > 2000, "vocabulary: {}", words.len());
    }

    #[test]
    fn compressed_files_round_trip() {
        let dir = std::env::temp_dir().join(format!("recipe_core_sample_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = sample(50, 5, SampleFormat::Jsonl);
        for name in ["s.jsonl.gz", "s.jsonl.zst", "s.jsonl"] {
            let path = dir.join(name);
            write_sample_file(&path, 50, 5, None).unwrap();
            let raw = std::fs::read(&path).unwrap();
            let mut text = Vec::new();
            match Compression::from_path(&path) {
                Compression::Gzip => {
                    flate2::read::GzDecoder::new(&raw[..])
                        .read_to_end(&mut text)
                        .unwrap();
                }
                Compression::Zstd => text = zstd::decode_all(&raw[..]).unwrap(),
                Compression::None => text = raw,
            }
            assert_eq!(text, plain, "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let err = write_sample_file(&dir.join("missing/x.csv"), 1, 0, None).unwrap_err();
        assert!(matches!(err, SampleError::Io { .. }) && err.to_string().contains("missing"));
        assert!(matches!(
            SampleFormat::parse("xml"),
            Err(SampleError::BadFormat(_))
        ));
    }

    #[test]
    fn the_file_name_says_the_format() {
        let of = |name: &str, requested| SampleFormat::for_path(Path::new(name), requested);
        for (name, want) in [
            ("r.csv", SampleFormat::RecipeNlgCsv),
            ("r.CSV.gz", SampleFormat::RecipeNlgCsv),
            ("r.jsonl.zst", SampleFormat::Jsonl),
            ("r.json", SampleFormat::Jsonl),
            ("r.parquet", SampleFormat::Parquet),
            ("r.parquet.zst", SampleFormat::Parquet),
            ("r.arrow", SampleFormat::Arrow),
        ] {
            assert_eq!(of(name, None).unwrap(), want, "{name}");
        }
        let food = Some(SampleFormat::FoodComCsv);
        assert_eq!(of("RAW.csv", food).unwrap(), SampleFormat::FoodComCsv);
        let e = of("recipes.jsonl.zst", Some(SampleFormat::RecipeNlgCsv)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "recipes.jsonl.zst: format recipenlg-csv does not match the file name, which says jsonl; rename \
             the file or drop the format"
        );
        let e = of("recipes.txt", None).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("recipes.txt: the file name says no format; end it in {EXTENSIONS}")
        );
        assert!(of("recipes.parquet", food).is_err());
    }
}
