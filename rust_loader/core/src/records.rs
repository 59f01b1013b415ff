//! Reading recipe records to generate from and to evaluate on: the training loader's files, formats, rendering
//! and tokenization, read once in file order.
//!
//! A record needs only the fields the *source* template uses: its rendered source is the prompt, and its
//! rendered target, when the fields the target template uses are present, is the reference. A record whose
//! source cannot be rendered is skipped and counted under the reason the training loader gives. With a
//! tokenizer, prompt and reference are also tokenized exactly as the training loader tokenizes them (same
//! truncation), so the model is prompted with the ids it was trained on. `Split::Eval` / `Split::Train` keep the
//! share that training held out / trained on (by the hash of the rendered source and target, as in
//! [`crate::plan::is_eval`]); those records need a target, as in training.
//!
//! Files are read sequentially (a `.gz`/`.zst` is decompressed while reading, without a cached copy), with the
//! loader's record boundaries and `file:line` numbers: CSV split by `csv_core` keeping at most
//! [`MAX_RECORD_BYTES`] of a record, the line of a record being its first physical line (`\n`, `\r\n` or a lone
//! `\r` end a line); JSONL one object per line.
use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use crate::columnar;
use crate::compress::Compression;
use crate::error::{LoaderError, Result};
use crate::formats::{
    self, ColumnNames, Columns, Field, Format, Parsed, Recipe, Skip, MAX_RECORD_BYTES,
};
use crate::hash::hash_parts;
use crate::index::{decompressed_copy, place, Example, MAX_EXAMPLES};
use crate::paths::{cache_root, expand_paths, path_error};
use crate::plan::{is_eval, Split};
use crate::render::Renderer;
use crate::split::{read_line_bounded, CsvRecords};
use crate::tokenize::Tok;

/// One usable record: its place, its prompt and, where the record has one, its reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    /// `file:line` (the record's first line).
    pub id: String,
    pub source: String,
    pub reference: Option<String>,
    /// The prompt's ids as the training loader makes them (empty without a tokenizer).
    pub source_ids: Vec<u32>,
    /// The reference's ids as the training loader makes them (None without a reference or a tokenizer).
    pub target_ids: Option<Vec<u32>>,
}

/// The usable records of some files, in file order, and what was skipped.
#[derive(Clone, Debug, Default)]
pub struct RecordSet {
    pub records: Vec<Rendered>,
    /// Skipped records by reason.
    pub skipped: BTreeMap<String, u64>,
    /// The first skipped records per file.
    pub examples: Vec<Example>,
}

/// Where records are read from and which share of them is kept.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    pub format: Option<Format>,
    /// The columns the fields are in (the `columns` option).
    pub names: ColumnNames,
    pub split: Split,
    pub eval_fraction: f64,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            format: None,
            names: ColumnNames::default(),
            split: Split::All,
            eval_fraction: 0.0,
        }
    }
}

/// Renders (and, with a tokenizer, tokenizes) records as the training loader does.
pub struct Prompter {
    pub renderer: Renderer,
    tok: Option<Tok>,
}

impl Prompter {
    /// `task` and the optional template overrides as for the loader; `tokenizer`: a tokenizer.json or a
    /// directory holding one, with the training lengths.
    pub fn new(
        task: &str,
        source_template: Option<&str>,
        target_template: Option<&str>,
        tokenizer: Option<(&Path, usize, usize)>,
    ) -> Result<Prompter> {
        let renderer = Renderer::new(task, source_template, target_template)?;
        let tok = match tokenizer {
            None => None,
            Some((path, max_source, max_target)) => {
                for (name, v) in [
                    ("max_source_length", max_source),
                    ("max_target_length", max_target),
                ] {
                    if v == 0 || v > u16::MAX as usize {
                        return Err(LoaderError::Config(format!(
                            "{name} must be in 1..=65535, got {v}"
                        )));
                    }
                }
                Some(Tok::load(path, max_source, max_target)?)
            }
        };
        Ok(Prompter { renderer, tok })
    }

    /// Renders one parsed record; `id` names it in the result. `split` other than `All` needs the target too
    /// (training skips a record without one) and keeps only that share.
    pub fn render(
        &self,
        id: String,
        parsed: &Parsed,
        opts: &ReadOptions,
    ) -> std::result::Result<Option<Rendered>, Skip> {
        let (source, reference) = if opts.split == Split::All {
            let source = self.renderer.render_source(parsed)?;
            (source, self.renderer.render_target(parsed).ok())
        } else {
            let (source, target) = self.renderer.render(parsed)?;
            let held_out = is_eval(
                hash_parts(&[source.as_bytes(), target.as_bytes()]),
                opts.eval_fraction,
            );
            if held_out != (opts.split == Split::Eval) {
                return Ok(None);
            }
            (source, Some(target))
        };
        let (source_ids, target_ids) = match &self.tok {
            None => (vec![], None),
            Some(tok) => {
                let (s, t) = tok
                    .encode(&source, reference.as_deref().unwrap_or(""))
                    .map_err(|e| Skip::new("tokenizer_error", e))?;
                (s, reference.as_ref().map(|_| t))
            }
        };
        Ok(Some(Rendered {
            id,
            source,
            reference,
            source_ids,
            target_ids,
        }))
    }

    /// Renders a recipe given as fields (a prompt typed on the command line); a field the source template
    /// needs and the recipe lacks is a `Data` error naming it.
    pub fn render_fields(
        &self,
        id: &str,
        title: &str,
        ingredients: Vec<String>,
        directions: Vec<String>,
        ner: Option<Vec<String>>,
    ) -> Result<Rendered> {
        let recipe = Parsed::Recipe(Recipe {
            title: title.to_string(),
            ner: Field::List(ner.unwrap_or_else(|| ingredients.clone())),
            ingredients: Field::List(ingredients),
            directions: Field::List(directions),
        });
        let rendered = self
            .render(id.to_string(), &recipe, &ReadOptions::default())
            .map_err(|s| LoaderError::data(id, 0, format!("{} ({})", s.reason, s.detail)))?;
        Ok(rendered.expect("split all keeps every record"))
    }

    /// Reads every usable record of `paths` (files or globs, as the loader expands them), in order. No usable
    /// record at all is a `Data` error with the skip counts and the first skipped record.
    pub fn read(&self, paths: &[String], opts: &ReadOptions) -> Result<RecordSet> {
        let files = expand_paths(paths)?;
        let mut set = RecordSet::default();
        for path in &files {
            read_file(self, path, opts, &mut set)?;
        }
        if set.records.is_empty() {
            let mut reason = format!("no usable records for the {} split", opts.split);
            if !set.skipped.is_empty() {
                let counts: Vec<String> = set
                    .skipped
                    .iter()
                    .map(|(r, n)| format!("{r}: {n}"))
                    .collect();
                reason += &format!(" (skipped {})", counts.join(", "));
            }
            if let Some(ex) = set.examples.first() {
                reason += &format!("; first skipped: {ex}");
            }
            let shown: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
            return Err(LoaderError::data(shown.join(", "), 0, reason));
        }
        Ok(set)
    }
}

fn read_file(p: &Prompter, path: &Path, opts: &ReadOptions, set: &mut RecordSet) -> Result<()> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| path_error(path, "", &e))?;
    if meta.len() == 0 {
        return Err(LoaderError::file(&shown, "empty file"));
    }
    let (compression, by_ext) = Format::from_path(path);
    let io_err = |e: std::io::Error| match compression {
        Compression::None => LoaderError::io(&shown, "read error", &e),
        kind => LoaderError::io(
            &shown,
            &format!("corrupt or truncated {} file", kind.name()),
            &e,
        ),
    };
    let format = opts.format.or(by_ext).ok_or_else(|| {
        LoaderError::file(
            &shown,
            format!(
                "cannot tell the format from the extension ({}); pass data_format",
                formats::EXTENSIONS
            ),
        )
    })?;
    let (mut seen, mut file_examples) = (0u64, 0);
    // `prompt`: the record read leniently where the training parser refused it (a JSONL line without
    // directions), still usable as a prompt.
    let mut take =
        |line: u64, parsed: std::result::Result<Parsed, Skip>, prompt: Option<Parsed>| {
            seen += 1;
            let id = place(&shown, line, format.is_columnar());
            let mut rendered = parsed.and_then(|parsed| p.render(id.clone(), &parsed, opts));
            if let (Err(skip), Some(lenient), Split::All) = (&rendered, &prompt, opts.split) {
                rendered = p.render(id, lenient, opts).map_err(|_| skip.clone());
            }
            match rendered {
                Ok(Some(r)) => set.records.push(r),
                Ok(None) => {}
                Err(skip) => {
                    *set.skipped.entry(skip.reason.to_string()).or_default() += 1;
                    if file_examples < MAX_EXAMPLES {
                        file_examples += 1;
                        set.examples.push(Example {
                            path: shown.clone(),
                            line,
                            row: format.is_columnar(),
                            reason: skip.reason.to_string(),
                            detail: skip.detail,
                        });
                    }
                }
            }
        };
    if format.is_columnar() {
        // Parquet and Arrow need random access: a compressed one is read from its decompressed copy.
        let plain = match compression {
            Compression::None => path.to_path_buf(),
            kind => {
                let (_, stem) = Compression::split(path);
                decompressed_copy(
                    path,
                    kind,
                    &stem,
                    &cache_root(None),
                    &AtomicBool::new(false),
                )?
            }
        };
        columnar::for_each_row(&plain, format, &opts.names, &shown, |row, parsed| {
            take(row, parsed, None)
        })?;
        if seen == 0 {
            return Err(LoaderError::file(&shown, "empty file: no records"));
        }
        return Ok(());
    }
    let file = File::open(path).map_err(|e| path_error(path, "", &e))?;
    let input = compression.reader(file).map_err(io_err)?;
    match format {
        Format::Jsonl => {
            let mut r = BufReader::with_capacity(1 << 20, input);
            let mut line = 0u64;
            let mut buf = Vec::new();
            let mut first_content = true;
            loop {
                buf.clear();
                let n =
                    read_line_bounded(&mut r, &mut buf, MAX_RECORD_BYTES + 1).map_err(io_err)?;
                if n == 0 {
                    break;
                }
                line += 1;
                let mut body: &[u8] = &buf;
                if line == 1 && body.starts_with(b"\xef\xbb\xbf") {
                    body = &body[3..];
                }
                while body.last().is_some_and(|&c| c == b'\n' || c == b'\r') {
                    body = &body[..body.len() - 1];
                }
                if body.iter().all(|c| c.is_ascii_whitespace()) {
                    continue;
                }
                if first_content && body.trim_ascii_start().starts_with(b"[") {
                    return Err(LoaderError::data(
                        &shown,
                        line,
                        "a JSON array, not JSON Lines (one object per line); convert it with `jq -c '.[]' FILE > FILE.jsonl`",
                    ));
                }
                first_content = false;
                if n > MAX_RECORD_BYTES {
                    let skip = Skip::new(
                        "over_long",
                        format!("record of {n} bytes (limit {MAX_RECORD_BYTES})"),
                    );
                    take(line, Err(skip), None);
                    continue;
                }
                let strict = formats::parse_jsonl(body, &opts.names);
                let lenient = match &strict {
                    Err(s) if s.reason == "missing_field" => {
                        formats::parse_jsonl_prompt(body, &opts.names).ok()
                    }
                    _ => None,
                };
                take(line, strict, lenient);
            }
        }
        _ => {
            let mut rdr = CsvRecords::new(input);
            let header = rdr.next_record().map_err(io_err)?;
            let Some(header) = header else {
                return Err(LoaderError::file(&shown, "empty file"));
            };
            let header: Vec<String> = header
                .fields
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let h = String::from_utf8_lossy(h);
                    if i == 0 {
                        h.trim_start_matches('\u{feff}').to_string()
                    } else {
                        h.into_owned()
                    }
                })
                .collect();
            let format = match opts.format {
                Some(f) => f,
                None => formats::sniff_csv(&header, &opts.names).ok_or_else(|| {
                    LoaderError::data(&shown, 1, formats::unknown_csv_header(&header))
                })?,
            };
            let cols = Columns::from_header(format, &header, &opts.names)
                .map_err(|e| LoaderError::data(&shown, 1, e))?;
            while let Some(rec) = rdr.next_record().map_err(io_err)? {
                if rec.is_blank() {
                    continue;
                }
                let parsed = if rec.over_long() {
                    Err(Skip::new(
                        "over_long",
                        format!("record of {} bytes (limit {MAX_RECORD_BYTES})", rec.len),
                    ))
                } else {
                    formats::parse_csv(&rec.fields, format, &cols)
                };
                take(rec.line, parsed, None);
            }
        }
    }
    if seen == 0 {
        return Err(LoaderError::file(&shown, "empty file: no records"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;

    fn tokenizer() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer.json")
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
        let p = dir.join(name);
        File::create(&p).unwrap().write_all(bytes).unwrap();
        p.display().to_string()
    }

    fn prompter(tok: bool) -> Prompter {
        let t = tokenizer();
        Prompter::new(
            "ingredients-to-recipe",
            None,
            None,
            tok.then_some((t.as_path(), 64, 128)),
        )
        .unwrap()
    }

    fn lines(set: &RecordSet) -> Vec<u64> {
        set.records
            .iter()
            .map(|r| r.id.rsplit(':').next().unwrap().parse().unwrap())
            .collect()
    }

    // BOM, CRLF, a quoted newline, a blank line, a record without directions, one without ingredients.
    const CSV: &str = "\u{feff}title,ingredients,directions,NER\r\n\
\"Soup\nwith newline\",\"[\"\"water\"\"]\",\"[\"\"Boil.\"\"]\",\"[]\"\r\n\
\r\n\
Toast,\"[\"\"bread\"\", \"\"butter\"\"]\",\"[]\",\"[]\"\r\n\
Nothing,\"[]\",\"[\"\"Wait.\"\"]\",\"[]\"\r\n\
Tea,\"[\"\"tea\"\"]\",\"[\"\"Steep.\"\"]\",\"[]\"\r\n";

    #[test]
    fn csv_prompts_references_lines_and_skips() {
        let dir = crate::scratch::ScratchDir::new().unwrap();
        let path = write(dir.path(), "r.csv", CSV.as_bytes());
        let set = prompter(false)
            .read(std::slice::from_ref(&path), &ReadOptions::default())
            .unwrap();
        assert_eq!(lines(&set), vec![2, 5, 7]);
        let r = &set.records;
        assert_eq!(r[0].id, format!("{path}:2"));
        assert_eq!(r[0].source, "Write a recipe with these ingredients: water");
        assert_eq!(
            r[0].reference.as_deref(),
            Some("title: Soup\nwith newline | ingredients: water | directions: 1. Boil.")
        );
        // No directions: still a prompt, without a reference.
        assert_eq!(
            r[1].source,
            "Write a recipe with these ingredients: bread; butter"
        );
        assert_eq!(r[1].reference, None);
        assert!(r[0].source_ids.is_empty() && r[0].target_ids.is_none());
        // No ingredients: skipped as training skips it, with its line.
        assert_eq!(
            set.skipped,
            BTreeMap::from([("empty_ingredients".into(), 1)])
        );
        assert_eq!(set.examples[0].line, 6);
    }

    #[test]
    fn jsonl_needs_only_the_source_fields() {
        let dir = crate::scratch::ScratchDir::new().unwrap();
        let path = write(
            dir.path(),
            "p.jsonl",
            b"\xef\xbb\xbf{\"ingredients\": [\"2 eggs\", \"1 cup flour\"]}\n\
\n\
{\"title\": \"Pie\", \"ingredients\": [\"1 egg\"], \"directions\": [\"Mix.\", \"Bake.\"]}\n\
{\"title\": \"No ingredients\"}\n\
{not json\n\
{\"source\": \"Make tea\", \"target\": \"title: Tea\"}\n",
        );
        let p = prompter(true);
        let set = p
            .read(std::slice::from_ref(&path), &ReadOptions::default())
            .unwrap();
        assert_eq!(lines(&set), vec![1, 3, 6]);
        let r = &set.records;
        assert_eq!(
            r[0].source,
            "Write a recipe with these ingredients: 2 eggs; 1 cup flour"
        );
        assert_eq!(r[0].reference, None);
        assert!(!r[0].source_ids.is_empty() && r[0].target_ids.is_none());
        assert_eq!(
            r[1].reference.as_deref(),
            Some("title: Pie | ingredients: 1 egg | directions: 1. Mix. 2. Bake.")
        );
        // The ids are the training loader's: the same tokenizer, the same truncation.
        let tok = Tok::load(&tokenizer(), 64, 128).unwrap();
        let want = tok
            .encode(&r[1].source, r[1].reference.as_deref().unwrap())
            .unwrap();
        assert_eq!(
            (r[1].source_ids.clone(), r[1].target_ids.clone().unwrap()),
            want
        );
        assert_eq!(
            (r[2].source.as_str(), r[2].reference.as_deref()),
            ("Make tea", Some("title: Tea"))
        );
        // The training parser's reasons: a line without the prompt's field is `missing_field`.
        assert_eq!(
            set.skipped,
            BTreeMap::from([("malformed_json".into(), 1), ("missing_field".into(), 1)])
        );
        let ex: Vec<String> = set.examples.iter().map(|e| e.to_string()).collect();
        assert!(
            ex[0].starts_with(&format!("{path}:4: missing_field")),
            "{ex:?}"
        );
    }

    #[test]
    fn compressed_files_read_the_same() {
        let dir = crate::scratch::ScratchDir::new().unwrap();
        let plain = write(dir.path(), "r.csv", CSV.as_bytes());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(CSV.as_bytes()).unwrap();
        let gz = write(dir.path(), "r.CSV.gz", &gz.finish().unwrap());
        let zst = write(
            dir.path(),
            "r.csv.zst",
            &zstd::encode_all(CSV.as_bytes(), 3).unwrap(),
        );
        let p = prompter(true);
        let read = |path: &String| {
            p.read(std::slice::from_ref(path), &ReadOptions::default())
                .unwrap()
        };
        let want = read(&plain);
        for path in [&gz, &zst] {
            let got = read(path);
            assert_eq!(lines(&got), lines(&want));
            for (a, b) in got.records.iter().zip(&want.records) {
                assert_eq!(
                    (&a.source, &a.reference, &a.source_ids),
                    (&b.source, &b.reference, &b.source_ids)
                );
            }
        }
        let truncated = write(dir.path(), "t.csv.gz", &std::fs::read(&gz).unwrap()[..40]);
        let e = p.read(&[truncated], &ReadOptions::default()).unwrap_err();
        assert!(e.to_string().contains("corrupt or truncated gzip"), "{e}");
    }

    #[test]
    fn splits_partition_the_records_that_have_a_target() {
        let dir = crate::scratch::ScratchDir::new().unwrap();
        let mut text = String::new();
        for i in 0..200 {
            text += &format!(
                "{{\"title\": \"Dish {i}\", \"ingredients\": [\"{i} eggs\"], \"directions\": [\"Cook {i}.\"]}}\n"
            );
        }
        text += "{\"ingredients\": [\"no directions\"]}\n";
        let path = write(dir.path(), "s.jsonl", text.as_bytes());
        let p = prompter(false);
        let read = |split, eval_fraction| {
            let opts = ReadOptions {
                split,
                eval_fraction,
                ..ReadOptions::default()
            };
            p.read(std::slice::from_ref(&path), &opts).unwrap()
        };
        let (all, eval, train) = (
            read(Split::All, 0.0),
            read(Split::Eval, 0.2),
            read(Split::Train, 0.2),
        );
        assert_eq!(all.records.len(), 201);
        assert_eq!(eval.records.len() + train.records.len(), 200);
        assert!(
            (20..=60).contains(&eval.records.len()),
            "{}",
            eval.records.len()
        );
        let held_out = |r: &Rendered| {
            is_eval(
                hash_parts(&[
                    r.source.as_bytes(),
                    r.reference.as_deref().unwrap().as_bytes(),
                ]),
                0.2,
            )
        };
        assert!(eval.records.iter().all(held_out));
        assert!(!train.records.iter().any(held_out));
        // In a split, a record without a target is skipped, as training skips it.
        assert_eq!(eval.skipped, BTreeMap::from([("missing_field".into(), 1)]));
    }

    #[test]
    fn fields_typed_by_a_user() {
        let p = prompter(true);
        let r = p
            .render_fields(
                "cli:1",
                "",
                vec!["2 eggs".into(), " 1 cup flour ".into()],
                vec![],
                None,
            )
            .unwrap();
        assert_eq!(
            r.source,
            "Write a recipe with these ingredients: 2 eggs; 1 cup flour"
        );
        assert_eq!((r.id.as_str(), r.reference.as_ref()), ("cli:1", None));
        let e = p
            .render_fields("cli:2", "Pie", vec![], vec![], None)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cli:2: empty_ingredients (empty ingredients)"
        );
    }

    #[test]
    fn bad_files_are_one_clear_error() {
        let dir = crate::scratch::ScratchDir::new().unwrap();
        let p = prompter(false);
        let read = |path: String| {
            p.read(&[path], &ReadOptions::default())
                .unwrap_err()
                .to_string()
        };
        let empty = write(dir.path(), "e.jsonl", b"");
        assert!(read(empty.clone()).contains("empty file"));
        let blank = write(dir.path(), "b.jsonl", b"\n \n");
        assert!(read(blank).contains("empty file"));
        let array = write(dir.path(), "a.json", b" [{\"title\": \"x\"}]\n");
        assert!(read(array.clone()).contains("jq -c"), "{}", read(array));
        let other = write(dir.path(), "x.txt", b"hello\n");
        assert!(read(other).contains("cannot tell the format"));
        assert!(read(dir.path().join("missing.csv").display().to_string()).contains("no such file"));
        let header = write(dir.path(), "h.csv", b"a,b\n1,2\n");
        assert!(read(header).contains("neither `directions`"));
        let useless = write(dir.path(), "u.jsonl", b"{\"title\": \"T\"}\n");
        let e = read(useless);
        assert!(
            e.contains("no usable records") && e.contains("missing_field: 1"),
            "{e}"
        );
    }
}
