//! Parsing one record of each supported dump format.
//!
//! - RecipeNLG CSV: columns found by header name (`title`, `ingredients`, `directions`, optional `NER`); the list
//!   columns hold JSON arrays as strings.
//! - Food.com `RAW_recipes.csv`: `name`, `ingredients`, `steps`; list columns are Python list literals
//!   (single-quoted, items with an apostrophe double-quoted), parsed by [`parse_py_list`].
//! - A CSV of pre-rendered pairs: a `target` (or `output`) column, or `columns` mapping source/target; with
//!   `source` (or `input`), used verbatim.
//! - JSONL: `title`, `ingredients`, `directions`, `NER` as strings or lists, or pre-rendered pairs
//!   `source`/`target` (also `input`/`output`) used verbatim: a record with a `target` is a pair.
//! - Parquet and Arrow IPC ([`crate::columnar`]): the JSONL fields as columns of strings or lists of strings.
//!
//! [`ColumnNames`] renames the fields for any format (the `columns` option: `{ingredients: ingr}`).
use std::collections::BTreeMap;
use std::path::Path;

use csv::ByteRecord;
use serde_json::Value;

use crate::compress::Compression;

/// Records longer than this (raw bytes) are skipped as `over_long`: it catches an unclosed CSV quote that would
/// otherwise swallow the rest of the file into one record.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    RecipeNlg,
    FoodCom,
    Jsonl,
    Parquet,
    /// Arrow IPC, as a file (Feather v2) or a stream (what `datasets` writes).
    Arrow,
}

/// The file names [`Format::from_path`] knows, for messages.
pub const EXTENSIONS: &str =
    ".csv, .jsonl, .json, .ndjson, .parquet, .arrow or .feather, optionally .gz/.zst";

impl Format {
    /// Accepts `recipenlg`/`recipenlg-csv`, `foodcom`/`foodcom-csv`, `jsonl`/`json`, `parquet`, `arrow`.
    pub fn parse(name: &str) -> Option<Format> {
        match name {
            "recipenlg" | "recipenlg-csv" => Some(Format::RecipeNlg),
            "foodcom" | "foodcom-csv" => Some(Format::FoodCom),
            "jsonl" | "json" => Some(Format::Jsonl),
            "parquet" => Some(Format::Parquet),
            "arrow" => Some(Format::Arrow),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::RecipeNlg => "recipenlg-csv",
            Format::FoodCom => "foodcom-csv",
            Format::Jsonl => "jsonl",
            Format::Parquet => "parquet",
            Format::Arrow => "arrow",
        }
    }

    /// Whether records are rows of typed columns (Parquet, Arrow), named by row rather than line.
    pub fn is_columnar(self) -> bool {
        matches!(self, Format::Parquet | Format::Arrow)
    }

    /// The compression and format a file's name says: the extension under a `.gz`/`.zst` suffix
    /// ([`Compression::split`]), any case. `.csv` is [`Format::RecipeNlg`] here: a reader tells the two CSV
    /// layouts apart by the header. The one rule for the loader, the sequential reader and `trainer data sample`.
    pub fn from_path(path: &Path) -> (Compression, Option<Format>) {
        let (compression, stem) = Compression::split(path);
        let ext = Path::new(&stem)
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        let format = match ext.as_deref() {
            Some("jsonl" | "json" | "ndjson") => Some(Format::Jsonl),
            Some("csv") => Some(Format::RecipeNlg),
            Some("parquet" | "pq") => Some(Format::Parquet),
            Some("arrow" | "feather" | "ipc") => Some(Format::Arrow),
            _ => None,
        };
        (compression, format)
    }
}

/// The fields a record has, as the `columns` option names them.
pub const FIELDS: [&str; 6] = [
    "title",
    "ingredients",
    "directions",
    "ner",
    "source",
    "target",
];

/// Where each field of a record is found in a file: the column (CSV header, JSON key, Parquet/Arrow column) that
/// the `columns` option maps it to, else the format's own names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ColumnNames {
    mapped: BTreeMap<&'static str, String>,
}

impl ColumnNames {
    /// From the `columns` option (`{"ingredients": "ingr"}`; `NER` is `ner`); Err names an unknown field or an
    /// empty name.
    pub fn new(columns: &BTreeMap<String, String>) -> Result<ColumnNames, String> {
        let mut mapped = BTreeMap::new();
        for (field, column) in columns {
            let lower = field.to_ascii_lowercase();
            let Some(&known) = FIELDS.iter().find(|f| **f == lower) else {
                return Err(format!(
                    "columns: unknown field {field:?} (known: {})",
                    FIELDS.join(", ")
                ));
            };
            if column.trim().is_empty() {
                return Err(format!("columns: {field} maps to an empty column name"));
            }
            if mapped.insert(known, column.clone()).is_some() {
                return Err(format!("columns: {known} is given twice"));
            }
        }
        Ok(ColumnNames { mapped })
    }

    /// The column `columns` maps `field` to, if any.
    pub fn mapped(&self, field: &str) -> Option<&str> {
        self.mapped.get(field).map(String::as_str)
    }

    /// The names to look `field` up under: the mapped one alone, else `defaults` in order.
    pub fn candidates<'a>(&'a self, field: &str, defaults: &[&'a str]) -> Vec<&'a str> {
        match self.mapped(field) {
            Some(m) => vec![m],
            None => defaults.to_vec(),
        }
    }

    /// `column `ingr` (ingredients, from `columns`)`, or `column `ingredients`` when not mapped.
    pub fn describe(&self, field: &str, column: &str) -> String {
        if self.mapped(field).is_some() {
            format!("column `{column}` ({field}, from `columns`)")
        } else {
            format!("column `{column}`")
        }
    }

    /// Whether the mapping names the pre-rendered pair (`source`/`target`).
    pub fn maps_pair(&self) -> bool {
        self.mapped("source").is_some() || self.mapped("target").is_some()
    }

    /// Every mapped column, `field -> column`.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.mapped.iter().map(|(f, c)| (*f, c.as_str()))
    }
}

/// The names each field is found under where `columns` does not map it: JSONL, Parquet and Arrow.
pub const TITLE: &[&str] = &["title", "name"];
pub const INGREDIENTS: &[&str] = &["ingredients"];
pub const DIRECTIONS: &[&str] = &["directions", "steps"];
pub const NER: &[&str] = &["NER", "ner"];
pub const SOURCE: &[&str] = &["source", "input"];
pub const TARGET: &[&str] = &["target", "output"];

/// A list or free-text field.
#[derive(Clone, Debug, PartialEq)]
pub enum Field {
    Text(String),
    List(Vec<String>),
}

impl Field {
    pub fn is_empty(&self) -> bool {
        match self {
            Field::Text(s) => s.trim().is_empty(),
            Field::List(v) => v.iter().all(|s| s.trim().is_empty()),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    pub title: String,
    pub ingredients: Field,
    pub directions: Field,
    pub ner: Field,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    Recipe(Recipe),
    /// Pre-rendered text used verbatim.
    Pair {
        source: String,
        target: String,
    },
}

/// Why a record was skipped: `reason` is the stats key, `detail` the human explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct Skip {
    pub reason: &'static str,
    pub detail: String,
}

impl Skip {
    pub fn new(reason: &'static str, detail: impl Into<String>) -> Self {
        Skip {
            reason,
            detail: detail.into(),
        }
    }
}

/// Column positions of a CSV file, found by header name.
#[derive(Clone, Debug, PartialEq)]
pub struct Columns {
    pub fields: CsvFields,
    pub n_fields: usize,
}

/// Which columns hold a CSV record's fields: a recipe's, or a pre-rendered pair's.
#[derive(Clone, Debug, PartialEq)]
pub enum CsvFields {
    Recipe {
        title: usize,
        ingredients: usize,
        directions: usize,
        ner: Option<usize>,
    },
    /// Pre-rendered `source`/`target`, used verbatim.
    Pair { source: usize, target: usize },
}

impl Columns {
    /// Finds the columns of `format` in `header` (names compared trimmed, in any case), each under the name
    /// `names` maps it to if any; Err names the missing column and the ones the header has.
    pub fn from_header(
        format: Format,
        header: &[String],
        names: &ColumnNames,
    ) -> Result<Columns, String> {
        let find = |name: &str| {
            header
                .iter()
                .position(|h| h.trim().eq_ignore_ascii_case(name.trim()))
        };
        let (t, i, d, n) = match format {
            Format::RecipeNlg => ("title", "ingredients", "directions", "NER"),
            Format::FoodCom => ("name", "ingredients", "steps", "NER"),
            other => return Err(format!("{} has no CSV header", other.name())),
        };
        let first = |field: &str, defaults: &[&str]| {
            names
                .candidates(field, defaults)
                .iter()
                .find_map(|name| find(name))
        };
        // Pairs when there is a target column: RecipeNLG's `source` column says where a recipe was gathered.
        if is_pair_header(header, names) {
            let pair_need = |field: &str, defaults: &[&str]| {
                first(field, defaults).ok_or_else(|| {
                    let name = names.mapped(field).unwrap_or(defaults[0]);
                    missing_column(names, field, name, header)
                })
            };
            return Ok(Columns {
                fields: CsvFields::Pair {
                    source: pair_need("source", SOURCE)?,
                    target: pair_need("target", TARGET)?,
                },
                n_fields: header.len(),
            });
        }
        let need = |field: &str, default: &str| {
            let name = names.mapped(field).unwrap_or(default);
            find(name).ok_or_else(|| missing_column(names, field, name, header))
        };
        let (title, ingredients, directions) = (
            need("title", t)?,
            need("ingredients", i)?,
            need("directions", d)?,
        );
        let ner = match names.mapped("ner") {
            Some(name) => {
                Some(find(name).ok_or_else(|| missing_column(names, "ner", name, header))?)
            }
            None => find(n),
        };
        Ok(Columns {
            fields: CsvFields::Recipe {
                title,
                ingredients,
                directions,
                ner,
            },
            n_fields: header.len(),
        })
    }
}

/// Whether a CSV header holds pre-rendered pairs: `columns` maps source/target, or the header has a target
/// column (`target`, `output`).
fn is_pair_header(header: &[String], names: &ColumnNames) -> bool {
    names.maps_pair()
        || TARGET
            .iter()
            .any(|t| header.iter().any(|h| h.trim().eq_ignore_ascii_case(t)))
}

/// The message for a column a file lacks: `missing column `ingr` (ingredients, from `columns`); the file has:
/// `a`, `b``.
pub fn missing_column(names: &ColumnNames, field: &str, column: &str, has: &[String]) -> String {
    let has: Vec<String> = has.iter().map(|h| format!("`{}`", h.trim())).collect();
    format!(
        "missing {}; the file has: {}",
        names.describe(field, column),
        if has.is_empty() {
            "no columns".to_string()
        } else {
            has.join(", ")
        }
    )
}

/// Sniffs a CSV header: RecipeNLG if it has `directions`, Food.com if it has `steps`. With `columns` mapping
/// the directions to another column, RecipeNLG (whose list columns may also be Python literals); so for
/// pre-rendered pairs (a target column, or `columns` mapping source/target), whose text is read verbatim.
pub fn sniff_csv(header: &[String], names: &ColumnNames) -> Option<Format> {
    let has = |n: &str| header.iter().any(|h| h.trim().eq_ignore_ascii_case(n));
    if names.mapped("directions").is_some() || has("directions") || is_pair_header(header, names) {
        Some(Format::RecipeNlg)
    } else if has("steps") {
        Some(Format::FoodCom)
    } else {
        None
    }
}

/// What to say of a CSV header [`sniff_csv`] finds no format in; a header of one column holding `;` or a tab
/// is a file separated by another character than the comma, which the reader does not split on.
pub fn unknown_csv_header(header: &[String]) -> String {
    let known = "CSV header has neither `directions` (RecipeNLG) nor `steps` (Food.com) nor `target` (pairs \
                 with `source`)";
    match header {
        [only] if only.contains(';') || only.contains('\t') => {
            let sep = if only.contains(';') { "`;`" } else { "tabs" };
            format!(
                "{known}: its one column `{}` looks separated by {sep}, and only commas separate CSV \
                 columns here; write it again with commas (pandas: pd.read_csv(path, sep=None, \
                 engine=\"python\").to_csv(new_path, index=False))",
                only.chars().take(60).collect::<String>()
            )
        }
        _ => format!("{known}; name the columns with `columns`"),
    }
}

fn utf8<'a>(bytes: &'a [u8], what: &str) -> Result<&'a str, Skip> {
    std::str::from_utf8(bytes)
        .map_err(|e| Skip::new("invalid_utf8", format!("invalid UTF-8 in {what}: {e}")))
}

/// Parses one CSV record of `format` using `cols`.
pub fn parse_csv(rec: &ByteRecord, format: Format, cols: &Columns) -> Result<Parsed, Skip> {
    if rec.len() != cols.n_fields {
        return Err(Skip::new(
            "malformed_csv",
            format!("expected {} fields, found {}", cols.n_fields, rec.len()),
        ));
    }
    let get = |i: usize, what: &str| utf8(rec.get(i).unwrap_or(b""), what);
    let list = |i: usize, what: &str| -> Result<Field, Skip> {
        let s = get(i, what)?;
        if s.trim().is_empty() {
            // An empty cell is an empty list: a column the task renders then skips the record as empty
            // (`empty_directions`), one it does not (NER for the default task) keeps it.
            return Ok(Field::List(Vec::new()));
        }
        // RecipeNLG writes JSON lists; exports re-saved through pandas write Python ones, as Food.com does.
        let parsed = match format {
            Format::RecipeNlg => serde_json::from_str::<Vec<String>>(s)
                .map_err(|e| e.to_string())
                .or_else(|json_err| parse_py_list(s).map_err(|_| json_err)),
            _ => parse_py_list(s),
        };
        parsed
            .map(Field::List)
            .map_err(|e| Skip::new("malformed_csv", format!("column {what} is not a list: {e}")))
    };
    let (title, ingredients, directions, ner) = match cols.fields {
        CsvFields::Pair { source, target } => {
            let (source, target) = (get(source, "source")?, get(target, "target")?);
            return if source.trim().is_empty() {
                Err(Skip::new("empty_source", "empty `source`"))
            } else if target.trim().is_empty() {
                Err(Skip::new("empty_target", "empty `target`"))
            } else {
                Ok(Parsed::Pair {
                    source: source.to_string(),
                    target: target.to_string(),
                })
            };
        }
        CsvFields::Recipe {
            title,
            ingredients,
            directions,
            ner,
        } => (title, ingredients, directions, ner),
    };
    let title = get(title, "title")?.to_string();
    let ingredients = list(ingredients, "ingredients")?;
    let directions = list(directions, "directions")?;
    let ner = match ner {
        Some(i) => list(i, "NER")?,
        None => ingredients.clone(),
    };
    Ok(Parsed::Recipe(Recipe {
        title,
        ingredients,
        directions,
        ner,
    }))
}

fn json_field(obj: &serde_json::Map<String, Value>, keys: &[&str]) -> Result<Option<Field>, Skip> {
    for k in keys {
        match obj.get(*k) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => return Ok(Some(Field::Text(s.clone()))),
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    match it {
                        Value::String(s) => out.push(s.clone()),
                        other => {
                            return Err(Skip::new(
                                "malformed_json",
                                format!("`{k}` holds a non-string item {other}"),
                            ))
                        }
                    }
                }
                return Ok(Some(Field::List(out)));
            }
            Some(other) => {
                return Err(Skip::new(
                    "malformed_json",
                    format!("`{k}` must be a string or a list, got {other}"),
                ))
            }
        }
    }
    Ok(None)
}

/// Parses one JSONL line (without its line end), its fields under `names`.
pub fn parse_jsonl(line: &[u8], names: &ColumnNames) -> Result<Parsed, Skip> {
    parse_jsonl_with(line, names, false)
}

/// Parses one JSONL line like [`parse_jsonl`], but a missing `title`, `ingredients` or `directions` is left
/// empty instead of skipping the record: a prompt to generate from has no directions.
pub fn parse_jsonl_prompt(line: &[u8], names: &ColumnNames) -> Result<Parsed, Skip> {
    parse_jsonl_with(line, names, true)
}

fn parse_jsonl_with(line: &[u8], names: &ColumnNames, missing_ok: bool) -> Result<Parsed, Skip> {
    let s = utf8(line, "line")?;
    let v: Value =
        serde_json::from_str(s).map_err(|e| Skip::new("malformed_json", e.to_string()))?;
    let Value::Object(obj) = v else {
        return Err(Skip::new("malformed_json", "line is not a JSON object"));
    };
    let text = |keys: &[&str]| -> Result<Option<String>, Skip> {
        Ok(json_field(&obj, keys)?.map(|f| match f {
            Field::Text(s) => s,
            Field::List(v) => v.join(" "),
        }))
    };
    let missing = |field: &str, keys: &[&str]| {
        let mut detail = format!("missing field `{}`", keys[0]);
        if names.mapped(field).is_some() {
            let has: Vec<&str> = obj.keys().map(String::as_str).collect();
            detail = format!(
                "missing {}; the record has: {}",
                names.describe(field, keys[0]),
                has.join(", ")
            );
        }
        Skip::new("missing_field", detail)
    };
    let (source_keys, target_keys) = (
        names.candidates("source", SOURCE),
        names.candidates("target", TARGET),
    );
    // A pair when the record has a target: a RecipeNLG record's `source` is where it was gathered from.
    if names.maps_pair() || target_keys.iter().any(|k| obj.contains_key(*k)) {
        let source = text(&source_keys)?;
        let target = text(&target_keys)?;
        return match (source, target) {
            (Some(source), Some(target)) => {
                if source.trim().is_empty() {
                    Err(Skip::new("empty_source", "empty `source`"))
                } else if target.trim().is_empty() {
                    Err(Skip::new("empty_target", "empty `target`"))
                } else {
                    Ok(Parsed::Pair { source, target })
                }
            }
            (None, _) => Err(missing("source", &source_keys)),
            (_, None) => Err(missing("target", &target_keys)),
        };
    }
    let title_keys = names.candidates("title", TITLE);
    let title = match text(&title_keys)? {
        None if missing_ok => String::new(),
        t => t.ok_or_else(|| missing("title", &title_keys))?,
    };
    let list = |field: &str, defaults: &[&str]| -> Result<Field, Skip> {
        let keys = names.candidates(field, defaults);
        match json_field(&obj, &keys)? {
            None if missing_ok => Ok(Field::List(vec![])),
            f => f.ok_or_else(|| missing(field, &keys)),
        }
    };
    let ingredients = list("ingredients", INGREDIENTS)?;
    let directions = list("directions", DIRECTIONS)?;
    let ner_keys = names.candidates("ner", NER);
    let ner = match json_field(&obj, &ner_keys)? {
        Some(f) => f,
        None if names.mapped("ner").is_some() && !missing_ok => {
            return Err(missing("ner", &ner_keys))
        }
        None => ingredients.clone(),
    };
    Ok(Parsed::Recipe(Recipe {
        title,
        ingredients,
        directions,
        ner,
    }))
}

/// A list field given as one string (a Parquet or Arrow column of strings, as a CSV re-saved through pandas
/// writes it): the list it spells as a JSON array or a Python list literal, else the text as it is.
pub fn list_or_text(s: &str) -> Field {
    let t = s.trim_start();
    if t.starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(t) {
            return Field::List(v);
        }
        if let Ok(v) = parse_py_list(t) {
            return Field::List(v);
        }
    }
    Field::Text(s.to_string())
}

/// Parses a Python list of str literals as `repr` writes it: `['a', "b's", 'c\'d']`. Single or double quotes,
/// backslash escapes (`\\ \' \" \n \t \r \xhh \uXXXX \UXXXXXXXX`), optional trailing comma.
pub fn parse_py_list(s: &str) -> Result<Vec<String>, String> {
    let mut it = s.trim().chars().peekable();
    let skip_ws = |it: &mut std::iter::Peekable<std::str::Chars>| {
        while it.peek().is_some_and(|c| c.is_whitespace()) {
            it.next();
        }
    };
    if it.next() != Some('[') {
        return Err("does not start with `[`".into());
    }
    let mut out = Vec::new();
    loop {
        skip_ws(&mut it);
        match it.next() {
            Some(']') => break,
            Some(q @ ('\'' | '"')) => {
                let mut item = String::new();
                loop {
                    match it.next() {
                        None => return Err("unterminated string".into()),
                        Some(c) if c == q => break,
                        Some('\\') => {
                            let c = it.next().ok_or("unterminated escape")?;
                            match c {
                                'n' => item.push('\n'),
                                't' => item.push('\t'),
                                'r' => item.push('\r'),
                                '\\' | '\'' | '"' => item.push(c),
                                'x' | 'u' | 'U' => {
                                    let n = match c {
                                        'x' => 2,
                                        'u' => 4,
                                        _ => 8,
                                    };
                                    let hex: String = (0..n).filter_map(|_| it.next()).collect();
                                    let code = u32::from_str_radix(&hex, 16)
                                        .map_err(|_| format!("bad escape \\{c}{hex}"))?;
                                    item.push(
                                        char::from_u32(code)
                                            .ok_or(format!("bad code point \\{c}{hex}"))?,
                                    );
                                }
                                other => {
                                    item.push('\\');
                                    item.push(other);
                                }
                            }
                        }
                        Some(c) => item.push(c),
                    }
                }
                out.push(item);
                skip_ws(&mut it);
                match it.next() {
                    Some(',') => continue,
                    Some(']') => break,
                    Some(c) => return Err(format!("unexpected `{c}` after an item")),
                    None => return Err("missing `]`".into()),
                }
            }
            Some(c) => return Err(format!("unexpected `{c}`")),
            None => return Err("missing `]`".into()),
        }
    }
    skip_ws(&mut it);
    if it.next().is_some() {
        return Err("text after `]`".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn py_list_quotes_and_escapes() {
        let v = parse_py_list(r#"['a, b', "mom's pie", 'it\'s', 'back\\slash', '\u00bd cup', ]"#)
            .unwrap();
        assert_eq!(
            v,
            vec!["a, b", "mom's pie", "it's", "back\\slash", "\u{bd} cup"]
        );
        assert_eq!(parse_py_list("[]").unwrap(), Vec::<String>::new());
        assert!(parse_py_list("['a'").is_err());
        assert!(parse_py_list("'a'").is_err());
        assert!(parse_py_list("['a' 'b']").is_err());
    }

    #[test]
    fn recipenlg_lists_in_json_or_python_form() {
        let header: Vec<String> = ["title", "ingredients", "directions"]
            .map(String::from)
            .into();
        let cols =
            Columns::from_header(Format::RecipeNlg, &header, &ColumnNames::default()).unwrap();
        let parse = |ingredients: &str| {
            let rec = ByteRecord::from(vec!["Pie", ingredients, r#"["Mix."]"#]);
            parse_csv(&rec, Format::RecipeNlg, &cols).map(|p| match p {
                Parsed::Recipe(r) => r.ingredients,
                _ => panic!("not a recipe"),
            })
        };
        let want = Field::List(vec!["1 egg".into(), "\u{bd} cup".into()]);
        assert_eq!(parse(r#"["1 egg", "\u00bd cup"]"#).unwrap(), want);
        assert_eq!(parse(r#"['1 egg', '\u00bd cup']"#).unwrap(), want);
        assert_eq!(parse(" ").unwrap(), Field::List(Vec::new())); // the renderer says `empty_ingredients`
        let err = parse("not a list").unwrap_err();
        assert_eq!(err.reason, "malformed_csv");
        assert!(
            err.detail.contains("expected"),
            "the JSON error is the one shown: {}",
            err.detail
        );
    }

    #[test]
    fn jsonl_variants() {
        let p = jsonl(br#"{"title":"T","ingredients":["a","b"],"directions":"Mix.","NER":["a"]}"#)
            .unwrap();
        match p {
            Parsed::Recipe(r) => {
                assert_eq!(r.title, "T");
                assert_eq!(r.ingredients, Field::List(vec!["a".into(), "b".into()]));
                assert_eq!(r.directions, Field::Text("Mix.".into()));
            }
            _ => panic!(),
        }
        assert_eq!(
            jsonl(br#"{"input":"x","output":"y"}"#).unwrap(),
            Parsed::Pair {
                source: "x".into(),
                target: "y".into()
            }
        );
        assert_eq!(jsonl(b"{bad").unwrap_err().reason, "malformed_json");
        assert_eq!(
            jsonl(br#"{"title":"T"}"#).unwrap_err().reason,
            "missing_field"
        );
        match parse_jsonl_prompt(br#"{"ingredients":["2 eggs"]}"#, &ColumnNames::default()).unwrap()
        {
            Parsed::Recipe(r) => {
                assert_eq!(r.title, "");
                assert_eq!(r.ingredients, Field::List(vec!["2 eggs".into()]));
                assert!(r.directions.is_empty());
            }
            _ => panic!(),
        }
        assert_eq!(
            jsonl(b"{\"title\":\"\xff\"}").unwrap_err().reason,
            "invalid_utf8"
        );
    }

    fn jsonl(line: &[u8]) -> Result<Parsed, Skip> {
        parse_jsonl(line, &ColumnNames::default())
    }

    #[test]
    fn columns_rename_fields_and_a_missing_one_is_named() {
        let map = |pairs: &[(&str, &str)]| {
            let m = pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            ColumnNames::new(&m)
        };
        let names = map(&[("title", "name"), ("ingredients", "ingr"), ("NER", "tags")]).unwrap();
        let line = br#"{"name":"Pie","ingr":["egg"],"directions":["Mix."],"tags":["egg"]}"#;
        match parse_jsonl(line, &names).unwrap() {
            Parsed::Recipe(r) => {
                assert_eq!(r.title, "Pie");
                assert_eq!(r.ingredients, Field::List(vec!["egg".into()]));
            }
            _ => panic!(),
        }
        // The default name no longer counts once a field is mapped.
        let e = parse_jsonl(
            br#"{"name":"Pie","ingredients":["egg"],"directions":["Mix."]}"#,
            &names,
        )
        .unwrap_err();
        assert_eq!(e.reason, "missing_field");
        assert_eq!(
            e.detail,
            "missing column `ingr` (ingredients, from `columns`); the record has: directions, ingredients, name"
        );
        let header: Vec<String> = ["name", "ingredients", "directions"]
            .map(String::from)
            .into();
        let e = Columns::from_header(Format::RecipeNlg, &header, &names).unwrap_err();
        assert_eq!(
            e,
            "missing column `ingr` (ingredients, from `columns`); the file has: `name`, `ingredients`, `directions`"
        );
        let pair = map(&[("source", "prompt"), ("target", "completion")]).unwrap();
        assert_eq!(
            parse_jsonl(br#"{"prompt":"x","completion":"y"}"#, &pair).unwrap(),
            Parsed::Pair {
                source: "x".into(),
                target: "y".into()
            }
        );
        assert!(map(&[("titel", "x")])
            .unwrap_err()
            .contains("unknown field \"titel\""));
        assert!(map(&[("title", " ")]).is_err());
    }

    #[test]
    fn a_csv_of_pairs_is_read_verbatim_and_recipenlg_source_column_is_not_a_pair() {
        let header =
            |names: &[&str]| -> Vec<String> { names.iter().map(|n| n.to_string()).collect() };
        let defaults = ColumnNames::default();
        let by_header = header(&["id", "Input", "output"]);
        assert_eq!(sniff_csv(&by_header, &defaults), Some(Format::RecipeNlg));
        let cols = Columns::from_header(Format::RecipeNlg, &by_header, &defaults).unwrap();
        let rec = ByteRecord::from(vec!["7", "summarize: [a, b]", "a \"b\""]);
        assert_eq!(
            parse_csv(&rec, Format::RecipeNlg, &cols).unwrap(),
            Parsed::Pair {
                source: "summarize: [a, b]".into(),
                target: "a \"b\"".into()
            }
        );
        let empty = ByteRecord::from(vec!["8", "x", " "]);
        assert_eq!(
            parse_csv(&empty, Format::RecipeNlg, &cols)
                .unwrap_err()
                .reason,
            "empty_target"
        );
        let m = [("source", "article"), ("target", "summary")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let mapped = ColumnNames::new(&m).unwrap();
        let articles = header(&["article", "summary"]);
        assert_eq!(sniff_csv(&articles, &mapped), Some(Format::RecipeNlg));
        let cols = Columns::from_header(Format::RecipeNlg, &articles, &mapped).unwrap();
        assert_eq!(
            cols.fields,
            CsvFields::Pair {
                source: 0,
                target: 1
            }
        );
        let e = Columns::from_header(Format::RecipeNlg, &header(&["article", "text"]), &mapped)
            .unwrap_err();
        assert_eq!(
            e,
            "missing column `summary` (target, from `columns`); the file has: `article`, `text`"
        );
        // RecipeNLG's own `source` column (where a recipe was gathered) makes no pair.
        let recipenlg = header(&[
            "title",
            "ingredients",
            "directions",
            "link",
            "source",
            "NER",
        ]);
        let cols = Columns::from_header(Format::RecipeNlg, &recipenlg, &defaults).unwrap();
        assert!(matches!(cols.fields, CsvFields::Recipe { .. }));
        assert_eq!(sniff_csv(&header(&["article", "summary"]), &defaults), None);
        assert!(unknown_csv_header(&header(&["article", "summary"]))
            .ends_with("nor `target` (pairs with `source`); name the columns with `columns`"));
        let semicolons = unknown_csv_header(&header(&["title;ingredients;directions"]));
        assert!(
            semicolons.contains("looks separated by `;`, and only commas separate CSV columns"),
            "{semicolons}"
        );
    }

    #[test]
    fn list_or_text_reads_lists_written_as_strings() {
        let want = Field::List(vec!["1 egg".into(), "mom's pie".into()]);
        assert_eq!(list_or_text(r#"["1 egg", "mom's pie"]"#), want);
        assert_eq!(list_or_text(r#"['1 egg', "mom's pie"]"#), want);
        assert_eq!(
            list_or_text("[Note] Mix well."),
            Field::Text("[Note] Mix well.".into())
        );
    }
}
