//! End-to-end tests of recipe_core: formats, quoting, compression, error paths, plan and stream properties.
use std::io::Write;
use std::path::{Path, PathBuf};

use recipe_core::{Loader, LoaderConfig, LoaderError, LoaderOptions};

fn config(paths: &[&Path], cache: &Path) -> LoaderConfig {
    super::config_with(paths, cache, 2)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

fn all_rows(l: &mut Loader) -> Vec<Vec<i64>> {
    let mut out = vec![];
    while let Some(b) = l.next_batch().unwrap() {
        for r in 0..b.rows {
            let row = &b.labels[r * b.target_len..(r + 1) * b.target_len];
            out.push(row.iter().copied().filter(|&x| x != -100).collect());
        }
    }
    out
}

const RECIPENLG: &str = "\u{feff},title,ingredients,directions,link,source,NER\r\n\
0,\"Mom's \"\"Best\"\" Pie\",\"[\"\"1 cup flour, sifted\"\", \"\"2 eggs\"\"]\",\"[\"\"Mix it.\"\", \"\"Bake\\nwell.\"\"]\",x,y,\"[\"\"flour\"\"]\"\r\n\
1,\"Soup\nwith newline\",\"[\"\"water\"\"]\",\"[\"\"Boil.\"\"]\",x,y,\"[\"\"water\"\"]\"\r\n\
2,Bad,not a list,\"[\"\"x\"\"]\",x,y,\"[]\"\r\n\
3,,\"[\"\"a\"\"]\",\"[\"\"b\"\"]\",x,y,\"[]\"\r\n\
4,Short,\"[\"\"a\"\"]\"\r\n\
5,Tea,\"[\"\"tea\"\"]\",\"[\"\"Steep.\"\"]\",x,y,\"[\"\"tea\"\"]\"\r\n";

#[test]
fn recipenlg_quoting_bom_crlf_and_skips() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = write(dir.path(), "r.csv", RECIPENLG.as_bytes());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    let rows = all_rows(&mut l);
    assert_eq!(rows.len(), 3);
    let st = l.stats();
    assert_eq!(
        st.skipped.get("malformed_csv"),
        Some(&2),
        "{:?}",
        st.skipped
    );
    assert_eq!(st.skipped.get("empty_title"), Some(&1));
    assert!(
        st.examples
            .iter()
            .any(|e| e.contains("r.csv:5: malformed_csv")),
        "{:?}",
        st.examples
    );
    assert!(
        st.examples
            .iter()
            .any(|e| e.contains("r.csv:6: empty_title")),
        "{:?}",
        st.examples
    );
    // The record after a multi-line field is read back at the right offset.
    let mut c = config(&[&p], dir.path());
    c.options.strict = true;
    let e = Loader::new(c).err().unwrap();
    assert!(matches!(e, LoaderError::Data { line: 5, .. }), "{e}");
}

#[test]
fn foodcom_and_jsonl() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let food = "name,id,steps,ingredients,description\n\
pie,1,\"['mix it', \"\"don't stop\"\"]\",\"['flour', \"\"baker's yeast\"\"]\",d\n\
bad,2,\"['unterminated]\",\"['x']\",d\n";
    let p = write(dir.path(), "RAW_recipes.csv", food.as_bytes());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 1);
    assert_eq!(l.stats().skipped.get("malformed_csv"), Some(&1));

    let jsonl = "\u{feff}{\"title\":\"A\",\"ingredients\":[\"x\"],\"directions\":[\"y\"]}\r\n\
\n\
{broken\n\
{\"source\":\"s\",\"target\":\"t\"}\n\
{\"title\":\"B\",\"ingredients\":\"x\"}\n";
    let p = write(dir.path(), "r.jsonl", jsonl.as_bytes());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 2);
    let st = l.stats();
    assert_eq!(st.skipped.get("malformed_json"), Some(&1));
    assert_eq!(st.skipped.get("missing_field"), Some(&1));
    assert!(
        st.examples
            .iter()
            .any(|e| e.contains("r.jsonl:3: malformed_json")),
        "{:?}",
        st.examples
    );
}

#[test]
fn compressed_and_truncated() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(RECIPENLG.as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::encode_all(RECIPENLG.as_bytes(), 3).unwrap();
    let plain = write(dir.path(), "plain.csv", RECIPENLG.as_bytes());
    let mut want = Loader::new(config(&[&plain], dir.path())).unwrap();
    let want = all_rows(&mut want);
    for (name, bytes) in [("a.csv.gz", &gz), ("a.csv.zst", &zst)] {
        let p = write(dir.path(), name, bytes);
        let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
        assert_eq!(all_rows(&mut l), want, "{name}");
        let t = write(
            dir.path(),
            &format!("t{name}"),
            &bytes[..bytes.len() * 2 / 3],
        );
        let e = Loader::new(config(&[&t], dir.path())).err().unwrap();
        assert!(matches!(e, LoaderError::File { .. }), "{name}: {e}");
        assert!(e.to_string().contains(&format!("t{name}")), "{e}");
    }
}

#[test]
fn file_errors_name_the_path() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let missing = dir.path().join("nope.csv");
    let e = Loader::new(config(&[&missing], dir.path())).err().unwrap();
    assert!(matches!(e, LoaderError::File { .. }) && e.to_string().contains("nope.csv"));
    let glob = dir.path().join("*.jsonl");
    let e = Loader::new(config(&[&glob], dir.path())).err().unwrap();
    assert!(e.to_string().contains("glob matches no file"), "{e}");
    let empty = write(dir.path(), "empty.csv", b"");
    let e = Loader::new(config(&[&empty], dir.path())).err().unwrap();
    assert!(e.to_string().contains("empty"), "{e}");
    let nocol = write(dir.path(), "x.csv", b"title,directions\na,b\n");
    let e = Loader::new(config(&[&nocol], dir.path())).err().unwrap();
    assert!(e.to_string().contains("ingredients"), "{e}");
    let p = write(dir.path(), "r.csv", RECIPENLG.as_bytes());
    let mut c = config(&[&p], dir.path());
    c.tokenizer = write(dir.path(), "tok.json", b"{not json");
    let e = Loader::new(c).err().unwrap();
    assert!(
        matches!(e, LoaderError::File { .. }) && e.to_string().contains("tok.json"),
        "{e}"
    );
}

fn many(dir: &Path, n: usize) -> PathBuf {
    let mut s = String::new();
    for i in 0..n {
        let ingr: Vec<String> = (0..(1 + i % 9))
            .map(|j| format!("\"{} cup item{}\"", j + 1, (i * 7 + j) % 50))
            .collect();
        let dirs: Vec<String> = (0..(1 + i % 5))
            .map(|j| format!("\"Step {j} stir well for {i} minutes.\""))
            .collect();
        s.push_str(&format!(
            "{{\"title\":\"Dish {i}\",\"ingredients\":[{}],\"directions\":[{}]}}\n",
            ingr.join(","),
            dirs.join(",")
        ));
    }
    write(dir, "many.jsonl", s.as_bytes())
}

#[test]
fn resume_and_determinism() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 400);
    let mut c = config(&[&p], dir.path());
    c.options.shuffle = true;
    c.options.batch_size = None;
    c.options.max_tokens = Some(600);
    c.options.pad_to_multiple_of = Some(8);
    let mut full = Loader::new(c.clone()).unwrap();
    let n = full.len();
    let mut batches = vec![];
    for _ in 0..2 {
        while let Some(b) = full.next_batch().unwrap() {
            assert!(b.rows * (b.source_len + b.target_len) <= 600 || b.rows == 1);
            batches.push(b);
        }
    }
    assert_eq!(batches.len(), 2 * n);
    assert_ne!(batches[..n], batches[n..]);
    // Resume at several points, including both sides of the epoch boundary.
    let take = |l: &mut Loader| -> Option<recipe_core::Batch> {
        match l.next_batch().unwrap() {
            Some(b) => Some(b),
            None => l.next_batch().unwrap(),
        }
    };
    for at in [0, 1, n / 2, n - 1, n, n + 3] {
        let mut l = Loader::new(c.clone()).unwrap();
        for _ in 0..at {
            take(&mut l).unwrap();
        }
        let mut r = Loader::new(c.clone()).unwrap();
        r.load_state(&l.state()).unwrap();
        for _ in 0..3 {
            let got = take(&mut r).unwrap();
            assert_eq!(got, take(&mut l).unwrap(), "resume at {at}");
        }
    }
    let mut other = c.clone();
    other.options.seed = 1;
    let mut o = Loader::new(other).unwrap();
    assert!(o.load_state(&full.state()).is_err());
}

#[test]
fn csv_lines_count_newlines_inside_fields_once() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let good = "\"[\"\"x\"\"]\",\"[\"\"y\"\"]\"";
    for (name, end, inner) in [
        ("lf.csv", "\n", "\n"),
        ("lf_inner_crlf.csv", "\n", "\r\n"),
        ("crlf.csv", "\r\n", "\n"),
        ("crlf_both.csv", "\r\n", "\r\n"),
        ("cr.csv", "\r", "\r"),
        ("cr_inner_lf.csv", "\r", "\n"),
    ] {
        let rows = [
            "title,ingredients,directions".to_string(),
            format!("\"a{inner}b\",{good}"),
            format!("\"c{inner}d{inner}e\",{good}"),
            "Bad,not a list,\"[]\"".to_string(),
            String::new(), // a blank line
            "  ".to_string(),
            format!("\"f{inner}g\",{good}"),
            "Bad2,not a list,\"[]\"".to_string(),
        ];
        let text = rows.join(end) + end;
        let p = write(dir.path(), name, text.as_bytes());
        let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
        assert_eq!(all_rows(&mut l).len(), 3, "{name}");
        let st = l.stats();
        let lines: Vec<&str> = st
            .examples
            .iter()
            .map(|e| e.split(':').nth(1).unwrap())
            .collect();
        assert_eq!(lines, ["7", "12"], "{name}: {:?}", st.examples);
    }
}

#[test]
fn globs_skip_hidden_files_and_literal_paths_win() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let p = write(&data, "r.csv", RECIPENLG.as_bytes());
    // The index cache is written beside the data as a hidden file; a second run's glob must not pick it up.
    let glob = data.join("*");
    for _ in 0..2 {
        let mut l = Loader::new(config(&[&glob], dir.path())).unwrap();
        assert_eq!(l.stats().files, [p.display().to_string()]);
    }
    assert!(
        std::fs::read_dir(&data).unwrap().count() > 1,
        "no index cache was written"
    );
    // Unless the pattern names hidden files itself.
    let hidden = write(&data, ".hidden.csv", RECIPENLG.as_bytes());
    let mut l = Loader::new(config(&[&data.join(".*.csv")], dir.path())).unwrap();
    assert_eq!(l.stats().files, [hidden.display().to_string()]);
    // A file whose name looks like a glob is read as named.
    let odd = write(dir.path(), "recipes [v2].csv", RECIPENLG.as_bytes());
    let mut l = Loader::new(config(&[&odd], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 3);
    // The same file twice would be read twice per epoch: also through a hard link.
    let e = Loader::new(config(&[&glob, &p], dir.path())).err().unwrap();
    assert!(e.to_string().contains("named twice"), "{e}");
    let linked = dir.path().join("linked.csv");
    std::fs::hard_link(&p, &linked).unwrap();
    let e = Loader::new(config(&[&p, &linked], dir.path()))
        .err()
        .unwrap();
    assert!(e.to_string().contains("named twice"), "{e}");
}

#[test]
fn odd_files_get_clear_errors() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    for (name, bytes) in [
        ("blank.csv", b"\n\r\n  \n".to_vec()),
        ("bom.jsonl", b"\xef\xbb\xbf\n".to_vec()),
        ("nothing.csv.gz", {
            let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            gz.finish().unwrap()
        }),
    ] {
        let p = write(dir.path(), name, &bytes);
        let e = Loader::new(config(&[&p], dir.path())).err().unwrap();
        assert!(
            matches!(e, LoaderError::File { .. }) && e.to_string().ends_with(": empty file"),
            "{name}: {e}"
        );
    }
    let array = write(
        dir.path(),
        "recipes.json",
        b"[\n {\"title\": \"A\"},\n {\"title\": \"B\"}\n]\n",
    );
    let e = Loader::new(config(&[&array], dir.path())).err().unwrap();
    assert!(
        e.to_string().contains("recipes.json:1: a JSON array"),
        "{e}"
    );
    // Upper-case compression suffixes are recognised.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(RECIPENLG.as_bytes()).unwrap();
    let p = write(dir.path(), "R.CSV.GZ", &gz.finish().unwrap());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 3);
}

#[test]
fn over_long_jsonl_line_is_skipped_and_the_next_is_kept() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let long = format!("{{\"title\":\"{}\"}}", "x".repeat(3 << 20));
    let text = format!("{long}\n{{\"source\":\"s\",\"target\":\"t\"}}\n");
    let p = write(dir.path(), "long.jsonl", text.as_bytes());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 1);
    let st = l.stats();
    assert_eq!(st.skipped.get("over_long"), Some(&1), "{:?}", st.skipped);
    assert!(
        st.examples[0].contains("long.jsonl:1: over_long"),
        "{:?}",
        st.examples
    );
}

#[test]
fn all_skipped_says_why() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = write(
        dir.path(),
        "r.csv",
        b"title,ingredients,directions\nPie,not a list,\"['Mix.']\"\n",
    );
    let e = Loader::new(config(&[&p], dir.path()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("no usable records for the all split (0 valid, 1 skipped: malformed_csv: 1)"),
        "{e}"
    );
    assert!(
        e.contains("first skipped: ") && e.contains("r.csv:2: malformed_csv"),
        "{e}"
    );
}

#[test]
fn damaged_index_cache_is_rebuilt() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = write(dir.path(), "r.csv", RECIPENLG.as_bytes());
    let mut want = Loader::new(config(&[&p], dir.path())).unwrap();
    let want = all_rows(&mut want);
    let cache = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "rlidx"))
        .expect("index cache beside the data");
    let good = std::fs::read(&cache).unwrap();
    // A record count that would allocate terabytes, then an offset past the end of the data.
    let mut huge = good.clone();
    huge[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let mut past_end = good.clone();
    past_end[24..32].copy_from_slice(&(1u64 << 30).to_le_bytes());
    // An offset that still fits the data, moved to the next record's: read silently, it would lose a record.
    let mut in_range = good.clone();
    let second: [u8; 8] = good[32..40].try_into().unwrap();
    in_range[24..32].copy_from_slice(&second);
    for bytes in [huge, past_end, in_range, good[..20].to_vec()] {
        std::fs::write(&cache, &bytes).unwrap();
        let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
        assert!(!l.stats().index_cached[0]);
        assert_eq!(all_rows(&mut l), want);
    }
}

#[test]
fn resume_survives_touching_or_moving_the_data_but_not_editing_it() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 60);
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    l.next_batch().unwrap();
    let state = l.state();
    let moved = dir.path().join("elsewhere");
    std::fs::create_dir(&moved).unwrap();
    let q = moved.join("many.jsonl");
    std::fs::copy(&p, &q).unwrap(); // a new path and a new mtime
    let mut r = Loader::new(config(&[&q], dir.path())).unwrap();
    r.load_state(&state).unwrap();
    assert_eq!(r.next_batch().unwrap(), l.next_batch().unwrap());
    let mut text = std::fs::read_to_string(&q).unwrap();
    text = text.replacen("Dish 3", "Dish three", 1);
    std::fs::write(&q, text).unwrap();
    let mut edited = Loader::new(config(&[&q], dir.path())).unwrap();
    let e = edited.load_state(&state).err().unwrap();
    assert!(e.to_string().contains("cannot resume"), "{e}");
}

#[test]
fn csv_record_over_the_limit_is_skipped_without_holding_it() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let good = "\"[\"\"x\"\"]\",\"[\"\"y\"\"]\"";
    // A field of 3 MiB inside quotes, then a good record; then an unclosed quote that runs to the end.
    let text = format!(
        "title,ingredients,directions\n\"{}\",{good}\nok,{good}\n\"open, no closing quote\nlost,a,b\n",
        "long line\n".repeat(300_000)
    );
    let p = write(dir.path(), "r.csv", text.as_bytes());
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(all_rows(&mut l).len(), 1);
    let st = l.stats();
    assert_eq!(st.skipped.get("over_long"), Some(&1), "{:?}", st.examples);
    assert_eq!(
        st.skipped.get("malformed_csv"),
        Some(&1),
        "{:?}",
        st.examples
    );
    assert!(
        st.examples[0].contains("r.csv:2: over_long"),
        "{:?}",
        st.examples
    );
    assert!(
        st.examples[1].contains("r.csv:300004: malformed_csv"),
        "{:?}",
        st.examples
    );
}

/// Rewrites `p` with `text` (same length) and puts its modification time back, as `cp -p` or `rsync -t` do.
fn rewrite_keeping_size_and_mtime(p: &Path, text: &str) {
    let before = std::fs::metadata(p).unwrap();
    assert_eq!(before.len(), text.len() as u64);
    std::thread::sleep(std::time::Duration::from_millis(20)); // a ctime that differs even on coarse clocks
    std::fs::write(p, text).unwrap();
    let f = std::fs::File::options().write(true).open(p).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
    drop(f);
    let after = std::fs::metadata(p).unwrap();
    assert_eq!(
        (after.len(), after.modified().unwrap()),
        (before.len(), before.modified().unwrap())
    );
}

#[test]
fn content_changed_with_size_and_mtime_kept_is_indexed_again() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 60);
    let mut old = Loader::new(config(&[&p], dir.path())).unwrap();
    old.next_batch().unwrap();
    let state = old.state();
    let text = std::fs::read_to_string(&p).unwrap();
    let edited = text.replace("Dish 1", "Dash 1"); // same length, other text
    assert_ne!(edited, text);
    rewrite_keeping_size_and_mtime(&p, &edited);

    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(l.stats().index_cached, [false]);
    let warnings = l.take_warnings();
    assert!(
        warnings.len() == 1 && warnings[0].contains("changed since it was indexed"),
        "{warnings:?}"
    );
    // What it yields is the new text: the same as a first read of a copy.
    let copy_dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let copy = write(copy_dir.path(), "copy.jsonl", edited.as_bytes());
    let mut fresh = Loader::new(config(&[&copy], copy_dir.path())).unwrap();
    assert_eq!(all_rows(&mut l), all_rows(&mut fresh));
    // And a resume from the old content is refused.
    let e = l.load_state(&state).unwrap_err().to_string();
    assert!(e.contains("cannot resume"), "{e}");
}

#[test]
fn metadata_change_without_content_change_reuses_the_index() {
    use std::os::unix::fs::PermissionsExt;
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 40);
    let mut first = Loader::new(config(&[&p], dir.path())).unwrap();
    let want = all_rows(&mut first);
    // chmod changes the ctime but not a byte: the content hash says the cache still fits.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cache = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "rlidx"))
        .expect("index cache beside the data");
    let written = || std::fs::metadata(&cache).unwrap().modified().unwrap();
    let before = written();
    let mut l = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(l.stats().index_cached, [true]);
    assert!(l.take_warnings().is_empty());
    assert_eq!(all_rows(&mut l), want);
    // The cache now holds the new ctime (rewritten once), so the next open needs no hash (not rewritten).
    let refreshed = written();
    assert!(refreshed > before);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut again = Loader::new(config(&[&p], dir.path())).unwrap();
    assert_eq!(again.stats().index_cached, [true]);
    assert_eq!(written(), refreshed);
}

#[test]
fn symlink_loops_and_broken_links_are_named_as_such() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let (a, b) = (dir.path().join("a.csv"), dir.path().join("b.csv"));
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    let e = Loader::new(config(&[&a], dir.path())).err().unwrap();
    assert!(e.to_string().contains("a.csv: symlink loop"), "{e}");
    assert!(
        matches!(
            e,
            LoaderError::File {
                errno: Some(40),
                ..
            }
        ),
        "{e:?}"
    );
    let broken = dir.path().join("broken.csv");
    std::os::unix::fs::symlink(dir.path().join("gone.csv"), &broken).unwrap();
    let e = Loader::new(config(&[&broken], dir.path())).err().unwrap();
    assert!(e.to_string().contains("broken.csv: broken symlink"), "{e}");
}

/// The records of a packed batch, checked against the layout of the packed-batch contract: per row, each
/// segment's `(source ids, target ids)` in segment order.
fn packed_records(b: &recipe_core::Batch, pad_id: i64) -> Vec<(Vec<i64>, Vec<i64>)> {
    let seg = b.segments.as_ref().expect("a packed batch");
    let (sl, tl) = (b.source_len, b.target_len);
    let mut out = vec![];
    for r in 0..b.rows {
        let side = |ids: &[i64], segs: &[i64], pos: &[i64], pad: i64| {
            // Segments contiguous, increasing by one from 1, positions from 0 in each, padding after.
            let mut records: Vec<Vec<i64>> = vec![];
            for j in 0..ids.len() {
                match segs[j] {
                    0 => assert!(ids[j] == pad && pos[j] == 0 && segs[j..].iter().all(|&s| s == 0)),
                    s => {
                        if s as usize == records.len() + 1 {
                            records.push(vec![]);
                        }
                        assert_eq!(
                            s as usize,
                            records.len(),
                            "segments contiguous and in order"
                        );
                        let rec = records.last_mut().unwrap();
                        assert_eq!(pos[j] as usize, rec.len(), "positions restart per segment");
                        rec.push(ids[j]);
                    }
                }
            }
            records
        };
        let rs = r * sl..(r + 1) * sl;
        let rt = r * tl..(r + 1) * tl;
        let src = side(
            &b.input_ids[rs.clone()],
            &seg.encoder_segment_ids[rs.clone()],
            &seg.encoder_positions[rs.clone()],
            pad_id,
        );
        let tgt = side(
            &b.labels[rt.clone()],
            &seg.decoder_segment_ids[rt.clone()],
            &seg.decoder_positions[rt],
            -100,
        );
        assert_eq!(src.len(), tgt.len(), "every segment in both rows");
        for j in rs {
            assert_eq!(b.attention_mask[j], (seg.encoder_segment_ids[j] > 0) as i64);
        }
        out.extend(src.into_iter().zip(tgt));
    }
    out
}

fn epoch_of(l: &mut Loader) -> Vec<recipe_core::Batch> {
    let mut out = vec![];
    while let Some(b) = l.next_batch().unwrap() {
        out.push(b);
    }
    out
}

#[test]
fn packed_batches_follow_the_contract_and_hold_every_record_once() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 700);
    // Unpacked reference: every record's ids.
    let mut c = config(&[&p], dir.path());
    c.options.batch_size = Some(50);
    let mut plain = Loader::new(c.clone()).unwrap();
    let mut want: Vec<(Vec<i64>, Vec<i64>)> = vec![];
    for b in epoch_of(&mut plain) {
        for r in 0..b.rows {
            let ids = &b.input_ids[r * b.source_len..(r + 1) * b.source_len];
            let mask = &b.attention_mask[r * b.source_len..(r + 1) * b.source_len];
            let labels = &b.labels[r * b.target_len..(r + 1) * b.target_len];
            want.push((
                ids.iter()
                    .zip(mask)
                    .filter(|(_, &m)| m == 1)
                    .map(|(&i, _)| i)
                    .collect(),
                labels.iter().copied().filter(|&x| x != -100).collect(),
            ));
        }
    }
    want.sort();
    c.options.packing = true;
    c.options.shuffle = true;
    c.options.batch_size = None;
    c.options.max_tokens = Some(3000);
    let mut l = Loader::new(c.clone()).unwrap();
    let shape = l.stats().packed_shape.expect("packed");
    assert!(shape.source_len >= 64 && shape.target_len >= 128);
    assert_eq!(shape.rows, 3000 / (shape.source_len + shape.target_len));
    let batches = epoch_of(&mut l);
    assert_eq!(batches.len(), l.len());
    let mut got = vec![];
    for b in &batches {
        assert_eq!(
            (b.rows, b.source_len, b.target_len),
            (shape.rows, shape.source_len, shape.target_len)
        );
        got.extend(packed_records(b, 0));
    }
    got.sort();
    assert_eq!(
        got, want,
        "each record once, with the unpacked loader's ids"
    );
    let share = l.stats().real_token_share;
    let real: usize = batches.iter().map(|b| b.real_tokens).sum();
    let total = batches.len() * shape.rows * (shape.source_len + shape.target_len);
    assert!((share - real as f64 / total as f64).abs() < 1e-9);
    // Deterministic per (seed, epoch); another epoch, another order.
    let mut again = Loader::new(c.clone()).unwrap();
    assert_eq!(epoch_of(&mut again), batches);
    assert_ne!(epoch_of(&mut again), batches);
}

#[test]
fn packed_resume_and_shards() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 900);
    let mut c = config(&[&p], dir.path());
    c.options.packing = true;
    c.options.shuffle = true;
    c.options.batch_size = Some(2); // rows per batch
    let mut full = Loader::new(c.clone()).unwrap();
    let n = full.len();
    let reference: Vec<_> = (0..2).flat_map(|_| epoch_of(&mut full)).collect();
    for at in [0, 1, n / 2, n - 1, n, n + 2] {
        let mut l = Loader::new(c.clone()).unwrap();
        for _ in 0..at {
            if l.next_batch().unwrap().is_none() {
                l.next_batch().unwrap();
            }
        }
        let mut r = Loader::new(c.clone()).unwrap();
        r.load_state(&l.state()).unwrap();
        let mut rest = vec![];
        while rest.len() < 3 {
            match r.next_batch().unwrap() {
                Some(b) => rest.push(b),
                None => continue,
            }
        }
        assert_eq!(rest[..], reference[at..at + 3], "resume at {at}");
    }
    // The fingerprint covers packing: an unpacked state, or one of another row shape, is refused.
    let mut other = c.clone();
    other.options.packed_target_length = Some(400);
    for cfg in [
        LoaderConfig {
            options: LoaderOptions {
                packing: false,
                ..c.options.clone()
            },
            ..c.clone()
        },
        other,
    ] {
        let mut o = Loader::new(cfg).unwrap();
        assert!(o.load_state(&full.state()).is_err());
    }
    // Shards: disjoint, the same count per rank, all records but those of the dropped batches.
    let per_batch: Vec<usize> = reference[..n]
        .iter()
        .map(|b| packed_records(b, 0).len())
        .collect();
    assert_eq!(per_batch.iter().sum::<usize>(), 900);
    let most = *per_batch.iter().max().unwrap();
    assert_eq!(
        n, 118,
        "the test wants a world size that divides the batches and one that does not"
    );
    for w in [2, 3] {
        let mut seen = vec![];
        let mut counts = vec![];
        for rank in 0..w {
            let mut s = c.clone();
            (s.options.rank, s.options.world_size) = (rank, w);
            let mut l = Loader::new(s).unwrap();
            let batches = epoch_of(&mut l);
            counts.push(batches.len());
            for b in &batches {
                seen.extend(packed_records(b, 0));
            }
            assert_eq!(l.stats().dropped_batches, (n % w) as u64);
        }
        assert!(counts.iter().all(|&x| x == counts[0]));
        let unique: std::collections::HashSet<_> = seen.iter().cloned().collect();
        assert_eq!(unique.len(), seen.len(), "a record on two ranks");
        let dropped = n % w;
        assert!(900 - seen.len() <= dropped * most && (dropped > 0) == (seen.len() < 900));
    }
}

#[test]
fn packing_settings_are_checked() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 50);
    let mut c = config(&[&p], dir.path());
    c.options.packing = true;
    c.options.packed_source_length = Some(32);
    let e = Loader::new(c.clone()).err().unwrap().to_string();
    assert!(
        e.contains("packed_source_length 32 is shorter than max_source_length 64"),
        "{e}"
    );
    c.options.packed_source_length = None;
    c.options.batch_size = None;
    c.options.max_tokens = Some(100);
    let e = Loader::new(c.clone()).err().unwrap().to_string();
    assert!(e.contains("smaller than one packed row"), "{e}");
    c.options.packing = false;
    c.options.packed_target_length = Some(500);
    let e = Loader::new(c).err().unwrap().to_string();
    assert!(e.contains("packed_target_length is for packing"), "{e}");
}

#[test]
fn a_cancelled_pass_stops_and_caches_nothing() {
    use std::sync::atomic::AtomicBool;
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 3000);
    let c = config(&[&p], dir.path());
    // Set before the pass starts (tests/test_loader_signals.py sets it part-way, through a real signal).
    let cancel = AtomicBool::new(true);
    let result = Loader::new_cancellable(c.clone(), &cancel);
    assert!(matches!(result, Err(LoaderError::Cancelled)));
    let caches = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".rlidx")
        })
        .count();
    assert_eq!(caches, 0);
    // Nothing is left half-done: the next pass indexes the file.
    assert_ne!(Loader::new(c).unwrap().len(), 0);
}

#[test]
fn sampled_records_are_the_split_s_records_as_the_renderer_reads_them() {
    use recipe_core::plan::Split;
    use recipe_core::records::{Prompter, ReadOptions};

    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let p = many(dir.path(), 400);
    let mut c = config(&[&p], dir.path());
    c.options.split = Split::Eval;
    c.options.eval_fraction = 0.2;
    let loader = Loader::new(c.clone()).unwrap();
    let tok = super::tokenizer();
    let prompter = Prompter::new(
        "ingredients-to-recipe",
        None,
        None,
        Some((tok.as_path(), 64, 128)),
    )
    .unwrap();
    let opts = ReadOptions {
        split: Split::Eval,
        eval_fraction: 0.2,
        ..ReadOptions::default()
    };
    let held_out = prompter
        .read(&[p.display().to_string()], &opts)
        .unwrap()
        .records;
    assert!(held_out.len() > 40, "{}", held_out.len());

    let sample = loader.sample_records(10, 7).unwrap();
    assert_eq!(sample.len(), 10);
    for r in &sample {
        let same = held_out
            .iter()
            .find(|h| h.id == r.id)
            .expect("a held-out record");
        assert_eq!(r, same);
    }
    let lines = |rs: &[recipe_core::records::Rendered]| -> Vec<u64> {
        rs.iter()
            .map(|r| r.id.rsplit(':').next().unwrap().parse().unwrap())
            .collect()
    };
    let order = lines(&sample);
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "file order: {order:?}"
    );
    assert_eq!(
        loader.sample_records(10, 7).unwrap(),
        sample,
        "the same seed, the same records"
    );
    assert_ne!(lines(&loader.sample_records(10, 8).unwrap()), order);
    let mut other_rank = c.clone();
    other_rank.options.world_size = 2;
    other_rank.options.rank = 1;
    let other = Loader::new(other_rank).unwrap();
    assert_eq!(
        other.sample_records(10, 7).unwrap(),
        sample,
        "every rank draws the same"
    );
    assert_eq!(
        loader.sample_records(10_000, 7).unwrap(),
        held_out,
        "fewer than asked: all of them"
    );
}
