//! Parsing one record of each supported dump format.
//!
//! - RecipeNLG CSV: columns found by header name (`title`, `ingredients`, `directions`, optional `NER`); the list
//!   columns hold JSON arrays as strings.
//! - Food.com `RAW_recipes.csv`: `name`, `ingredients`, `steps`; list columns are Python list literals
//!   (single-quoted, items with an apostrophe double-quoted), parsed by [`parse_py_list`].
//! - JSONL: `title`, `ingredients`, `directions`, `NER` as strings or lists, or pre-rendered pairs
//!   `source`/`target` (also `input`/`output`) used verbatim.
use csv::ByteRecord;
use serde_json::Value;

/// Records longer than this (raw bytes) are skipped as `over_long`: it catches an unclosed CSV quote that would
/// otherwise swallow the rest of the file into one record.
pub const MAX_RECORD_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    RecipeNlg,
    FoodCom,
    Jsonl,
}

impl Format {
    /// Accepts `recipenlg`/`recipenlg-csv`, `foodcom`/`foodcom-csv`, `jsonl`/`json`.
    pub fn parse(name: &str) -> Option<Format> {
        match name {
            "recipenlg" | "recipenlg-csv" => Some(Format::RecipeNlg),
            "foodcom" | "foodcom-csv" => Some(Format::FoodCom),
            "jsonl" | "json" => Some(Format::Jsonl),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::RecipeNlg => "recipenlg-csv",
            Format::FoodCom => "foodcom-csv",
            Format::Jsonl => "jsonl",
        }
    }
}

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
    pub title: usize,
    pub ingredients: usize,
    pub directions: usize,
    pub ner: Option<usize>,
    pub n_fields: usize,
}

impl Columns {
    /// Finds the columns of `format` in `header`; Err names the missing column.
    pub fn from_header(format: Format, header: &[String]) -> Result<Columns, String> {
        let find = |name: &str| {
            header
                .iter()
                .position(|h| h.trim().eq_ignore_ascii_case(name))
        };
        let need = |name: &str| {
            find(name).ok_or_else(|| format!("missing column `{name}` in the CSV header"))
        };
        let (t, i, d, n) = match format {
            Format::RecipeNlg => ("title", "ingredients", "directions", "NER"),
            Format::FoodCom => ("name", "ingredients", "steps", "NER"),
            Format::Jsonl => return Err("JSONL has no CSV header".into()),
        };
        Ok(Columns {
            title: need(t)?,
            ingredients: need(i)?,
            directions: need(d)?,
            ner: find(n),
            n_fields: header.len(),
        })
    }
}

/// Sniffs a CSV header: RecipeNLG if it has `directions`, Food.com if it has `steps`.
pub fn sniff_csv(header: &[String]) -> Option<Format> {
    let has = |n: &str| header.iter().any(|h| h.trim().eq_ignore_ascii_case(n));
    if has("directions") {
        Some(Format::RecipeNlg)
    } else if has("steps") {
        Some(Format::FoodCom)
    } else {
        None
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
    let title = get(cols.title, "title")?.to_string();
    let ingredients = list(cols.ingredients, "ingredients")?;
    let directions = list(cols.directions, "directions")?;
    let ner = match cols.ner {
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

/// Parses one JSONL line (without its line end).
pub fn parse_jsonl(line: &[u8]) -> Result<Parsed, Skip> {
    parse_jsonl_with(line, false)
}

/// Parses one JSONL line like [`parse_jsonl`], but a missing `title`, `ingredients` or `directions` is left
/// empty instead of skipping the record: a prompt to generate from has no directions.
pub fn parse_jsonl_prompt(line: &[u8]) -> Result<Parsed, Skip> {
    parse_jsonl_with(line, true)
}

fn parse_jsonl_with(line: &[u8], missing_ok: bool) -> Result<Parsed, Skip> {
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
    if obj.contains_key("source") || obj.contains_key("input") {
        let source = text(&["source", "input"])?;
        let target = text(&["target", "output"])?;
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
            _ => Err(Skip::new(
                "missing_field",
                "pre-rendered record needs both `source` and `target`",
            )),
        };
    }
    let missing = |k: &str| Skip::new("missing_field", format!("missing field `{k}`"));
    let title = match text(&["title", "name"])? {
        None if missing_ok => String::new(),
        t => t.ok_or_else(|| missing("title"))?,
    };
    let list = |keys: &[&str]| -> Result<Field, Skip> {
        match json_field(&obj, keys)? {
            None if missing_ok => Ok(Field::List(vec![])),
            f => f.ok_or_else(|| missing(keys[0])),
        }
    };
    let ingredients = list(&["ingredients"])?;
    let directions = list(&["directions", "steps"])?;
    let ner = json_field(&obj, &["NER", "ner"])?.unwrap_or_else(|| ingredients.clone());
    Ok(Parsed::Recipe(Recipe {
        title,
        ingredients,
        directions,
        ner,
    }))
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
        let cols = Columns::from_header(Format::RecipeNlg, &header).unwrap();
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
        let p = parse_jsonl(
            br#"{"title":"T","ingredients":["a","b"],"directions":"Mix.","NER":["a"]}"#,
        )
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
            parse_jsonl(br#"{"input":"x","output":"y"}"#).unwrap(),
            Parsed::Pair {
                source: "x".into(),
                target: "y".into()
            }
        );
        assert_eq!(parse_jsonl(b"{bad").unwrap_err().reason, "malformed_json");
        assert_eq!(
            parse_jsonl(br#"{"title":"T"}"#).unwrap_err().reason,
            "missing_field"
        );
        match parse_jsonl_prompt(br#"{"ingredients":["2 eggs"]}"#).unwrap() {
            Parsed::Recipe(r) => {
                assert_eq!(r.title, "");
                assert_eq!(r.ingredients, Field::List(vec!["2 eggs".into()]));
                assert!(r.directions.is_empty());
            }
            _ => panic!(),
        }
        assert_eq!(
            parse_jsonl(b"{\"title\":\"\xff\"}").unwrap_err().reason,
            "invalid_utf8"
        );
    }
}
