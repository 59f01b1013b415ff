//! Parquet and Arrow input and mixing weights, end to end: the same records as JSONL give the same batches, with
//! the guarantees of the text formats (shuffle, resume, rank shards, changed data, bad rows).
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{BinaryBuilder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_ipc::writer::{FileWriter, IpcWriteOptions, StreamWriter};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use recipe_core::{Batch, Loader, LoaderConfig};

fn config(paths: &[&Path], cache: &Path) -> LoaderConfig {
    super::config_with(paths, cache, 3)
}

/// A recipe: title, ingredients, directions; `None` where the column is null.
type Row = (Option<String>, Option<Vec<String>>, Vec<String>);

fn recipes(n: usize, tag: &str) -> Vec<Row> {
    (0..n)
        .map(|i| {
            let ingr = (0..1 + i % 7)
                .map(|j| format!("{} cup {tag}item{}", j + 1, (i * 5 + j) % 40))
                .collect();
            let dirs = (0..1 + i % 4)
                .map(|j| format!("Step {j}: stir for {i} minutes."))
                .collect();
            (Some(format!("{tag}Dish {i}")), Some(ingr), dirs)
        })
        .collect()
}

fn jsonl(dir: &Path, name: &str, rows: &[Row]) -> PathBuf {
    let p = dir.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    for (t, i, d) in rows {
        let line = serde_json::json!({"title": t, "ingredients": i, "directions": d});
        writeln!(f, "{line}").unwrap();
    }
    p
}

fn list_column(rows: &[Row], get: impl Fn(&Row) -> Option<Vec<String>>) -> ArrayRef {
    let mut b = ListBuilder::new(StringBuilder::new());
    for r in rows {
        match get(r) {
            Some(items) => {
                for it in items {
                    b.values().append_value(it);
                }
                b.append(true);
            }
            None => b.append(false),
        }
    }
    Arc::new(b.finish())
}

/// The rows as a record batch: lists as `list<string>`, or (`as_strings`) as JSON arrays in string columns, as
/// a CSV re-saved through pandas holds them. `names`: the title, ingredients and directions columns' names.
fn batch(rows: &[Row], as_strings: bool, names: [&str; 3]) -> RecordBatch {
    let title: ArrayRef = Arc::new(
        rows.iter()
            .map(|r| r.0.clone())
            .collect::<arrow_array::StringArray>(),
    );
    let (ingredients, directions): (ArrayRef, ArrayRef) = if as_strings {
        let json = |v: Option<Vec<String>>| v.map(|v| serde_json::to_string(&v).unwrap());
        (
            Arc::new(
                rows.iter()
                    .map(|r| json(r.1.clone()))
                    .collect::<arrow_array::StringArray>(),
            ),
            Arc::new(
                rows.iter()
                    .map(|r| json(Some(r.2.clone())))
                    .collect::<arrow_array::StringArray>(),
            ),
        )
    } else {
        (
            list_column(rows, |r| r.1.clone()),
            list_column(rows, |r| Some(r.2.clone())),
        )
    };
    let fields: Vec<Field> = [&title, &ingredients, &directions]
        .iter()
        .zip(names)
        .map(|(a, n)| Field::new(n, a.data_type().clone(), true))
        .collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        vec![title, ingredients, directions],
    )
    .unwrap()
}

const NAMES: [&str; 3] = ["title", "ingredients", "directions"];

fn parquet_with(
    dir: &Path,
    name: &str,
    batches: &[RecordBatch],
    props: WriterProperties,
) -> PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    let mut w = ArrowWriter::try_new(f, batches[0].schema(), Some(props)).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
    p
}

/// A Parquet file of `rows`, in row groups of 50.
fn parquet(dir: &Path, name: &str, rows: &[Row], as_strings: bool) -> PathBuf {
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(50))
        .build();
    let batches: Vec<RecordBatch> = rows
        .chunks(50)
        .map(|c| batch(c, as_strings, NAMES))
        .collect();
    parquet_with(dir, name, &batches, props)
}

fn arrow_file(dir: &Path, name: &str, rows: &[Row], options: IpcWriteOptions) -> PathBuf {
    let p = dir.join(name);
    let b = batch(rows, false, NAMES);
    let mut w =
        FileWriter::try_new_with_options(std::fs::File::create(&p).unwrap(), &b.schema(), options)
            .unwrap();
    for c in (0..rows.len()).step_by(40) {
        w.write(&b.slice(c, 40.min(rows.len() - c))).unwrap();
    }
    w.finish().unwrap();
    p
}

fn arrow_stream(dir: &Path, name: &str, rows: &[Row]) -> PathBuf {
    let p = dir.join(name);
    let b = batch(rows, false, NAMES);
    let mut w = StreamWriter::try_new(std::fs::File::create(&p).unwrap(), &b.schema()).unwrap();
    for c in (0..rows.len()).step_by(33) {
        w.write(&b.slice(c, 33.min(rows.len() - c))).unwrap();
    }
    w.finish().unwrap();
    p
}

/// Every row of an epoch: its source ids then its labels, padding dropped.
fn all_rows(l: &mut Loader) -> Vec<Vec<i64>> {
    let mut out = vec![];
    while let Some(b) = l.next_batch().unwrap() {
        out.extend(rows_of(&b));
    }
    out
}

fn rows_of(b: &Batch) -> Vec<Vec<i64>> {
    (0..b.rows)
        .map(|r| {
            let mut row: Vec<i64> = b.input_ids[r * b.source_len..(r + 1) * b.source_len]
                .iter()
                .zip(&b.attention_mask[r * b.source_len..(r + 1) * b.source_len])
                .filter(|(_, &m)| m == 1)
                .map(|(&x, _)| x)
                .collect();
            row.extend(
                b.labels[r * b.target_len..(r + 1) * b.target_len]
                    .iter()
                    .filter(|&&x| x != -100),
            );
            row
        })
        .collect()
}

#[test]
fn parquet_and_arrow_read_as_the_same_records_as_jsonl() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let rows = recipes(230, "");
    let want = all_rows(
        &mut Loader::new(config(&[&jsonl(dir.path(), "r.jsonl", &rows)], dir.path())).unwrap(),
    );
    assert_eq!(want.len(), 230);
    let lz4 = IpcWriteOptions::default()
        .try_with_compression(Some(arrow_ipc::CompressionType::LZ4_FRAME))
        .unwrap();
    for p in [
        parquet(dir.path(), "lists.parquet", &rows, false),
        parquet(dir.path(), "strings.parquet", &rows, true),
        arrow_file(dir.path(), "file.arrow", &rows, IpcWriteOptions::default()),
        arrow_file(dir.path(), "lz4.feather", &rows, lz4),
        arrow_stream(dir.path(), "stream.arrow", &rows),
    ] {
        let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
        assert_eq!(all_rows(&mut l), want, "{}", p.display());
        // The second open uses the cached index (and the decoded copy of a Parquet file).
        let mut again = Loader::new(config(&[&p], dir.path())).unwrap();
        assert_eq!(again.stats().index_cached, [true], "{}", p.display());
        assert_eq!(all_rows(&mut again), want, "{}", p.display());
    }
    // One decoded copy per file that needs one (Parquet, compressed Arrow), made once.
    let copies: Vec<String> = std::fs::read_dir(dir.path().join("cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".arrow"))
        .collect();
    assert_eq!(copies.len(), 3, "{copies:?}");
}

#[test]
fn parquet_shuffles_resumes_and_shards_like_the_text_formats() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let rows = recipes(300, "");
    let p = parquet(dir.path(), "r.parquet", &rows, false);
    let mut c = config(&[&p], dir.path());
    c.options.shuffle = true;
    c.options.batch_size = None;
    c.options.max_tokens = Some(700);
    let mut full = Loader::new(c.clone()).unwrap();
    let n = full.len();
    let epoch: Vec<Batch> = std::iter::from_fn(|| full.next_batch().unwrap()).collect();
    assert_eq!(epoch.len(), n);
    // The whole-dataset shuffle: not the file order, every record once.
    let natural = all_rows(&mut Loader::new(config(&[&p], dir.path())).unwrap());
    let mut shuffled: Vec<Vec<i64>> = epoch.iter().flat_map(rows_of).collect();
    assert_ne!(shuffled, natural);
    shuffled.sort();
    let mut sorted = natural.clone();
    sorted.sort();
    assert_eq!(shuffled, sorted);
    // Resume mid-epoch: the batches the uninterrupted stream yields next.
    for at in [1, n / 2, n - 1] {
        let mut l = Loader::new(c.clone()).unwrap();
        for _ in 0..at {
            l.next_batch().unwrap().unwrap();
        }
        let mut r = Loader::new(c.clone()).unwrap();
        r.load_state(&l.state()).unwrap();
        assert_eq!(
            r.next_batch().unwrap().unwrap(),
            epoch[at],
            "resume at {at}"
        );
    }
    // Rank shards partition the epoch's batches.
    let mut seen: Vec<Vec<i64>> = vec![];
    for rank in 0..3 {
        let mut s = c.clone();
        s.options.rank = rank;
        s.options.world_size = 3;
        let mut l = Loader::new(s).unwrap();
        let mine: Vec<Batch> = std::iter::from_fn(|| l.next_batch().unwrap()).collect();
        for (k, b) in mine.iter().enumerate() {
            assert_eq!(*b, epoch[rank + 3 * k]);
        }
        seen.extend(mine.iter().flat_map(rows_of));
    }
    let dropped: usize = epoch[epoch.len() / 3 * 3..].iter().map(|b| b.rows).sum();
    assert_eq!(seen.len() + dropped, 300);
}

#[test]
fn bad_rows_are_counted_or_named() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let mut rows = recipes(20, "");
    rows[3].1 = None; // null ingredients
    rows[7].0 = Some("  ".into()); // empty title
    let p = parquet(dir.path(), "bad.parquet", &rows, false);
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 18);
    let st = l.stats();
    assert_eq!(st.skipped.get("missing_field"), Some(&1));
    assert_eq!(st.skipped.get("empty_title"), Some(&1));
    let shown = p.display().to_string();
    assert_eq!(
        st.examples[0],
        format!("{shown}:row 3: missing_field (`ingredients` is null)")
    );
    assert!(st.examples[1].starts_with(&format!("{shown}:row 7: empty_title")));
    // Strict: the first bad row is the error, also when the index comes from the cache.
    for _ in 0..2 {
        let mut strict = config(&[&p], dir.path());
        strict.options.strict = true;
        let e = Loader::new(strict).err().unwrap().to_string();
        assert_eq!(
            e,
            format!("{shown}:row 3: missing_field (`ingredients` is null)")
        );
    }
    // Bytes that are not UTF-8 in a binary column: that row skipped as invalid_utf8.
    let mut title = BinaryBuilder::new();
    title.append_value(b"Pie");
    title.append_value(b"\xffPie");
    let title: ArrayRef = Arc::new(title.finish());
    let two = batch(&recipes(2, ""), false, NAMES);
    let schema = Schema::new(vec![
        Field::new("title", DataType::Binary, true),
        two.schema().field(1).clone(),
        two.schema().field(2).clone(),
    ]);
    let b = RecordBatch::try_new(
        Arc::new(schema),
        vec![title, two.column(1).clone(), two.column(2).clone()],
    )
    .unwrap();
    let p = parquet_with(
        dir.path(),
        "binary.parquet",
        &[b],
        WriterProperties::default(),
    );
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 1);
    assert!(l.stats().examples[0].contains("binary.parquet:row 1: invalid_utf8"));
}

#[test]
fn columns_map_fields_and_a_missing_column_is_named() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let rows = recipes(40, "");
    let want = all_rows(
        &mut Loader::new(config(&[&jsonl(dir.path(), "r.jsonl", &rows)], dir.path())).unwrap(),
    );
    let renamed = batch(&rows, false, ["name", "ingr", "steps"]);
    let p = parquet_with(
        dir.path(),
        "renamed.parquet",
        &[renamed],
        WriterProperties::default(),
    );
    let mapping = |pairs: &[(&str, &str)]| {
        Some(
            pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        )
    };
    let mut c = config(&[&p], dir.path());
    c.options.columns = mapping(&[("ingredients", "ingr")]); // name and steps are JSONL's own fallbacks
    assert_eq!(all_rows(&mut Loader::new(c.clone()).unwrap()), want);
    c.options.columns = mapping(&[("ingredients", "ingredient_list")]);
    let e = Loader::new(c).err().unwrap().to_string();
    assert_eq!(
        e,
        format!(
            "{}: missing column `ingredient_list` (ingredients, from `columns`); the file has: `name`, `ingr`, \
             `steps`",
            p.display()
        )
    );
    // The same mapping for a CSV.
    let csv = dir.path().join("r.csv");
    let mut text = String::from("name,ingr,steps\n");
    for (t, i, d) in &rows {
        let q = |v: &Vec<String>| serde_json::to_string(v).unwrap().replace('"', "\"\"");
        text += &format!(
            "\"{}\",\"{}\",\"{}\"\n",
            t.as_ref().unwrap(),
            q(i.as_ref().unwrap()),
            q(d)
        );
    }
    std::fs::write(&csv, text).unwrap();
    let mut c = config(&[&csv], dir.path());
    c.options.columns = mapping(&[
        ("title", "name"),
        ("ingredients", "ingr"),
        ("directions", "steps"),
    ]);
    assert_eq!(all_rows(&mut Loader::new(c).unwrap()), want);
}

#[test]
fn a_rewritten_parquet_file_is_indexed_again() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let props = || {
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::UNCOMPRESSED)
            .set_dictionary_enabled(false)
            .set_statistics_enabled(parquet::file::properties::EnabledStatistics::None)
            .build()
    };
    let rows = recipes(60, "");
    let p = parquet_with(
        dir.path(),
        "r.parquet",
        &[batch(&rows, false, NAMES)],
        props(),
    );
    let mut old = Loader::new(config(&[&p], dir.path())).unwrap();
    old.next_batch().unwrap();
    let state = old.state();
    // Same length, other text, then the size and modification time put back (cp -p, rsync -t).
    let mut edited = rows.clone();
    edited[1].0 = Some("Dash 1".into());
    let before = std::fs::metadata(&p).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let tmp = parquet_with(
        dir.path(),
        "tmp.parquet",
        &[batch(&edited, false, NAMES)],
        props(),
    );
    std::fs::write(&p, std::fs::read(&tmp).unwrap()).unwrap();
    std::fs::remove_file(&tmp).unwrap();
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), before.len());

    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(l.stats().index_cached, [false]);
    let warnings = l.take_warnings();
    assert!(
        warnings.len() == 1 && warnings[0].contains("changed since it was indexed"),
        "{warnings:?}"
    );
    let fresh_dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let fresh = jsonl(fresh_dir.path(), "e.jsonl", &edited);
    assert_eq!(
        all_rows(&mut l),
        all_rows(&mut Loader::new(config(&[&fresh], fresh_dir.path())).unwrap())
    );
    let e = l.load_state(&state).unwrap_err().to_string();
    assert!(e.contains("cannot resume"), "{e}");
}

#[test]
fn weights_draw_each_source_in_proportion() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let big = jsonl(dir.path(), "big.jsonl", &recipes(200, "big"));
    let small = parquet(dir.path(), "small.parquet", &recipes(50, "small"), false);
    let mut c = config(&[&big, &small], dir.path());
    c.options.weights = Some(vec![0.5, 3.0]);
    c.options.shuffle = true;
    let mut l = Loader::new(c.clone()).unwrap();
    let st = l.stats();
    let counts: Vec<(u64, u64)> = st
        .sources
        .iter()
        .map(|s| (s.count.records, s.count.drawn))
        .collect();
    assert_eq!(counts, [(200, 100), (50, 150)]);
    assert_eq!(st.epoch_records, 250);
    assert_eq!(st.sources[1].files, [small.display().to_string()]);
    let (src, _) = l.lengths();
    assert_eq!(src.len(), 250);
    let epoch: Vec<Batch> = std::iter::from_fn(|| l.next_batch().unwrap()).collect();
    let rows: Vec<Vec<i64>> = epoch.iter().flat_map(rows_of).collect();
    assert_eq!(rows.len(), 250);
    // Every small record three times; half the big records, once.
    let mut distinct = rows.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 50 + 100);
    // Any world size: rank r's batches are batches r, r + W, ... of the one-rank epoch.
    for w in [2, 3] {
        for rank in 0..w {
            let mut s = c.clone();
            s.options.rank = rank;
            s.options.world_size = w;
            let mut l = Loader::new(s).unwrap();
            let mine: Vec<Batch> = std::iter::from_fn(|| l.next_batch().unwrap()).collect();
            assert_eq!(mine.len(), epoch.len() / w);
            for (k, b) in mine.iter().enumerate() {
                assert_eq!(*b, epoch[rank + w * k], "world size {w}, rank {rank}");
            }
        }
    }
    // Resume mid-epoch, and the next epoch draws another half of the big file.
    let mut a = Loader::new(c.clone()).unwrap();
    for _ in 0..10 {
        a.next_batch().unwrap();
    }
    let mut r = Loader::new(c.clone()).unwrap();
    r.load_state(&a.state()).unwrap();
    assert_eq!(r.next_batch().unwrap().unwrap(), epoch[10]);
    while a.next_batch().unwrap().is_some() {}
    let next: Vec<Vec<i64>> = std::iter::from_fn(|| a.next_batch().unwrap())
        .flat_map(|b| rows_of(&b))
        .collect();
    assert_eq!(next.len(), 250);
    let mut next_distinct = next;
    next_distinct.sort();
    next_distinct.dedup();
    assert_ne!(next_distinct, distinct);
    // Another mixture is another plan: a state of this one is refused.
    let mut other = c.clone();
    other.options.weights = Some(vec![1.0, 3.0]);
    let e = Loader::new(other)
        .unwrap()
        .load_state(&a.state())
        .unwrap_err();
    assert!(e.to_string().contains("cannot resume"), "{e}");
    // Weights of 1 are the plain concatenation, with its fingerprint.
    let mut ones = c.clone();
    ones.options.weights = Some(vec![1.0, 1.0]);
    let mut plain = c.clone();
    plain.options.weights = None;
    assert_eq!(
        Loader::new(ones).unwrap().state(),
        Loader::new(plain).unwrap().state()
    );
    let mut wrong = c;
    wrong.options.weights = Some(vec![1.0]);
    let e = Loader::new(wrong).err().unwrap().to_string();
    assert_eq!(
        e,
        "weights: 1 given for 2 paths; give one per path (or glob)"
    );
}

#[test]
fn held_out_records_are_never_drawn() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let a = jsonl(dir.path(), "a.jsonl", &recipes(300, "a"));
    let b = jsonl(dir.path(), "b.jsonl", &recipes(100, "b"));
    let mut c = config(&[&a, &b], dir.path());
    c.options.eval_fraction = 0.2;
    c.options.split = recipe_core::plan::Split::Eval;
    let held_out: Vec<Vec<i64>> = all_rows(&mut Loader::new(c.clone()).unwrap());
    c.options.split = recipe_core::plan::Split::Train;
    c.options.weights = Some(vec![2.5, 4.0]);
    let mut l = Loader::new(c).unwrap();
    let st = l.stats();
    let records: u64 = st.sources.iter().map(|s| s.count.records).sum();
    assert_eq!(records as usize + held_out.len(), 400);
    let trained = all_rows(&mut l);
    assert_eq!(trained.len() as u64, st.epoch_records);
    assert!(trained.iter().all(|r| !held_out.contains(r)));
}
