//! The loader's options, declared once: [`LoaderOptions`] (fields, defaults, docs), how a keyword argument sets
//! one ([`LoaderOptions::set`], unknown names and wrong types refused), the checks on their values
//! ([`LoaderOptions::check`]) and the table the Python binding exports ([`LoaderOptions::table`]: name, Python
//! type, default, doc), against which the `.pyi` stub and the docs are tested. Adding an option is one line in
//! the `options!` list below, plus its use.
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::error::{LoaderError, Result};
use crate::formats::{ColumnNames, Format};
use crate::pack;
use crate::plan::{PackShape, PlanConfig, Split};

/// A type an option can have: read from a JSON-like value, named for Python users.
pub trait OptionType: DeserializeOwned + Serialize {
    /// The annotation in the Python stub.
    fn python() -> String;
    /// What a value must be, for error messages.
    fn expected() -> String;
}

macro_rules! option_type {
    ($($ty:ty => $python:literal, $expected:literal;)+) => {
        $(impl OptionType for $ty {
            fn python() -> String {
                $python.into()
            }
            fn expected() -> String {
                $expected.into()
            }
        })+
    };
}

option_type! {
    usize => "int", "an integer >= 0";
    u64 => "int", "an integer >= 0";
    f64 => "float", "a number";
    bool => "bool", "True or False";
    String => "str", "a string";
    PathBuf => "str | PathLike[str]", "a path";
    Split => "str", "'all', 'train' or 'eval'";
    Vec<f64> => "list[float]", "a list of numbers";
    BTreeMap<String, String> => "dict[str, str]", "a mapping of field names to column names";
}

impl<T: OptionType> OptionType for Option<T> {
    fn python() -> String {
        format!("{} | None", T::python())
    }
    fn expected() -> String {
        format!("{} or None", T::expected())
    }
}

/// One row of [`LoaderOptions::table`].
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OptionSpec {
    pub name: &'static str,
    /// The Python annotation, as the stub writes it.
    #[serde(rename = "type")]
    pub python_type: String,
    pub default: Value,
    pub doc: &'static str,
}

macro_rules! options {
    ($($name:ident: $ty:ty = $default:expr, $doc:literal;)+) => {
        /// Every setting of a [`crate::Loader`] besides its paths and tokenizer.
        #[derive(Clone, Debug, PartialEq, Serialize)]
        pub struct LoaderOptions {
            $(#[doc = $doc] pub $name: $ty,)+
        }

        impl Default for LoaderOptions {
            fn default() -> Self {
                LoaderOptions { $($name: $default,)+ }
            }
        }

        impl LoaderOptions {
            /// Sets option `name` from `value` (None is JSON null); an unknown name or a value of the wrong type
            /// is a [`LoaderError::Config`] naming the option.
            pub fn set(&mut self, name: &str, value: Value) -> Result<()> {
                match name {
                    $(stringify!($name) => self.$name = parse::<$ty>(name, value)?,)+
                    _ => return Err(unknown_option(name)),
                }
                Ok(())
            }

            /// Name, Python type, default and doc of every option, in declaration order.
            pub fn table() -> Vec<OptionSpec> {
                let d = LoaderOptions::default();
                vec![$(OptionSpec {
                    name: stringify!($name),
                    python_type: <$ty as OptionType>::python(),
                    default: serde_json::to_value(&d.$name).expect("an option's default serializes"),
                    doc: $doc,
                },)+]
            }
        }
    };
}

options! {
    task: String = "ingredients-to-recipe".into(),
        "Preset templates: `ingredients-to-recipe` or `title-to-recipe`.";
    source_template: Option<String> = None,
        "Source template (`{title}`, `{ingredients}`, `{directions}`, `{ner}`); None: the task's.";
    target_template: Option<String> = None,
        "Target template; None: the task's.";
    max_source_length: usize = 512,
        "Source tokens kept per record (`</s>` included), as `truncation=True, max_length=N`.";
    max_target_length: usize = 512,
        "Target tokens kept per record (`</s>` included).";
    batch_size: Option<usize> = None,
        "Rows per batch; give this or `max_tokens`.";
    max_tokens: Option<usize> = None,
        "Token budget per batch: rows x (longest source + longest target), length-bucketed.";
    pad_to_multiple_of: Option<usize> = None,
        "Round padded lengths up to a multiple of this (packed row lengths chosen from the data: of this, else of 8).";
    packing: bool = false,
        "Pack several records into each row: sources into encoder rows, targets into decoder rows, with segment ids \
         and positions (docs/loader.md); rows per batch: `batch_size`, or `max_tokens // (packed_source_length + \
         packed_target_length)`.";
    packed_source_length: Option<usize> = None,
        "Encoder row length when packing (>= max_source_length); None: chosen from the data.";
    packed_target_length: Option<usize> = None,
        "Decoder row length when packing (>= max_target_length); None: chosen from the data.";
    shuffle: bool = false,
        "Seeded whole-dataset shuffle for (seed, epoch).";
    seed: u64 = 0,
        "Seed of the shuffle.";
    epoch: u64 = 0,
        "Epoch to start at.";
    rank: usize = 0,
        "This process's rank: it reads global batches rank, rank + world_size, ...";
    world_size: usize = 1,
        "Number of ranks.";
    split: Split = Split::All,
        "`all`, or `train`/`eval`: the records whose content hash falls outside/inside `eval_fraction`.";
    eval_fraction: f64 = 0.0,
        "Share of records held out for `split=\"eval\"`.";
    strict: bool = false,
        "Raise on the first bad record instead of skipping and counting it.";
    dedup: bool = false,
        "Drop records whose rendered source and target repeat an earlier one.";
    data_format: Option<String> = None,
        "`recipenlg-csv`, `foodcom-csv`, `jsonl`, `parquet` or `arrow`; None: from each file's extension.";
    columns: Option<BTreeMap<String, String>> = None,
        "The column (CSV header, JSON key, Parquet/Arrow column) each field is in, e.g. `{\"title\": \"name\", \
         \"ingredients\": \"ingr\"}`; fields: title, ingredients, directions, ner, source, target; None: each \
         format's own names.";
    weights: Option<Vec<f64>> = None,
        "Mixing weight of each path (or glob) in order: an epoch draws weight x its records (2.0: each twice; \
         0.5: a seeded half); None: each record once.";
    num_threads: Option<usize> = None,
        "Worker threads; None: one per core.";
    prefetch: usize = 8,
        "Batches built ahead of the consumer.";
    cache_dir: Option<PathBuf> = None,
        "Where index caches and decompressed copies go when the data's directory is not writable; None: \
         $XDG_CACHE_HOME/recipe-trainer, else ~/.cache/recipe-trainer.";
}

fn parse<T: OptionType>(name: &str, value: Value) -> Result<T> {
    serde_json::from_value(value.clone()).map_err(|_| {
        LoaderError::Config(format!(
            "loader option {name} must be {}, got {}",
            T::expected(),
            python_repr(&value)
        ))
    })
}

/// `value` as Python would print it (the user passed a Python value).
fn python_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_repr).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

fn unknown_option(name: &str) -> LoaderError {
    let table = LoaderOptions::table();
    let close = table
        .iter()
        .map(|o| (edit_distance(name, o.name), o.name))
        .min()
        .filter(|&(d, _)| d <= 3)
        .map(|(_, n)| format!(" (did you mean {n:?}?)"))
        .unwrap_or_default();
    LoaderError::Config(format!("unknown loader option {name:?}{close}"))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + (ca != cb) as usize).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

impl LoaderOptions {
    /// Options from `(name, value)` pairs over the defaults.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, Value)>) -> Result<LoaderOptions> {
        let mut o = LoaderOptions::default();
        for (name, value) in pairs {
            o.set(&name, value)?;
        }
        Ok(o)
    }

    /// Checks the values and how they combine; every rule on the options lives here.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(LoaderError::Config(m));
        match (self.batch_size, self.max_tokens) {
            (None, None) => return bad("give batch_size or max_tokens".into()),
            (Some(_), Some(_)) => return bad("give batch_size or max_tokens, not both".into()),
            _ => {}
        }
        for (name, value) in [
            ("batch_size", self.batch_size),
            ("max_tokens", self.max_tokens),
            ("pad_to_multiple_of", self.pad_to_multiple_of),
            ("num_threads", self.num_threads),
            ("prefetch", Some(self.prefetch)),
            ("world_size", Some(self.world_size)),
        ] {
            if value == Some(0) {
                return bad(format!("{name} must be >= 1, got 0"));
            }
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} must be in [0, world_size={})",
                self.rank, self.world_size
            ));
        }
        if !(0.0..1.0).contains(&self.eval_fraction) {
            return bad(format!(
                "eval_fraction must be in [0, 1), got {}",
                self.eval_fraction
            ));
        }
        if self.split != Split::All && self.eval_fraction == 0.0 {
            return bad(format!(
                "split={:?} needs 0 < eval_fraction < 1, got {}",
                self.split.to_string(),
                self.eval_fraction
            ));
        }
        for (name, value) in [
            ("max_source_length", self.max_source_length),
            ("max_target_length", self.max_target_length),
        ] {
            if value == 0 || value > u16::MAX as usize {
                return bad(format!("{name} must be in 1..=65535, got {value}"));
            }
        }
        let packed = [
            (
                "packed_source_length",
                self.packed_source_length,
                self.max_source_length,
                "source",
            ),
            (
                "packed_target_length",
                self.packed_target_length,
                self.max_target_length,
                "target",
            ),
        ];
        for (name, value, longest, side) in packed {
            match value {
                Some(_) if !self.packing => {
                    return bad(format!(
                        "{name} is for packing: set packing=True or leave it None"
                    ));
                }
                Some(v) if v < longest => {
                    return bad(format!(
                        "{name} {v} is shorter than max_{side}_length {longest}: a record's {side} must fit \
                         one row"
                    ));
                }
                _ => {}
            }
        }
        self.format()?;
        self.column_names()?;
        if let Some(w) = &self.weights {
            crate::mixture::check_weights(w).map_err(LoaderError::Config)?;
        }
        Ok(())
    }

    /// The `columns` mapping, checked.
    pub fn column_names(&self) -> Result<ColumnNames> {
        ColumnNames::new(self.columns.as_ref().unwrap_or(&BTreeMap::new()))
            .map_err(LoaderError::Config)
    }

    /// The packed batch shape (None without `packing`): the row lengths given, or chosen from the token lengths
    /// of all records (`src`, `tgt`: the proportion of source to target, see [`pack::suggest_shape`]); rows per
    /// batch from `batch_size` or `max_tokens`.
    pub fn pack_shape(&self, src: &[u16], tgt: &[u16]) -> Result<Option<PackShape>> {
        if !self.packing {
            return Ok(None);
        }
        let m = self.pad_to_multiple_of.unwrap_or(8);
        let longest = (
            self.max_source_length.div_ceil(m) * m,
            self.max_target_length.div_ceil(m) * m,
        );
        let share = pack::target_share(src, tgt);
        let down = |x: f64| (x as usize / m * m).max(m);
        let (source_len, target_len) = match (self.packed_source_length, self.packed_target_length)
        {
            (Some(s), Some(t)) => (s, t),
            (Some(s), None) => (s, down(s as f64 * share / (1.0 - share)).max(longest.1)),
            (None, Some(t)) => (down(t as f64 * (1.0 - share) / share).max(longest.0), t),
            (None, None) => match self.max_tokens {
                Some(budget) => {
                    let (max_s, max_t) = (self.max_source_length, self.max_target_length);
                    let (rows, s, t) = pack::suggest_shape(src, tgt, max_s, max_t, budget, m)
                        .map_err(LoaderError::Config)?;
                    return Ok(Some(PackShape {
                        rows,
                        source_len: s,
                        target_len: t,
                    }));
                }
                None => {
                    let row = pack::shortest_row(src, tgt, longest);
                    let limits = (self.max_source_length, self.max_target_length);
                    pack::choose_split(src, tgt, row, limits, m)
                }
            },
        };
        let rows = match (self.batch_size, self.max_tokens) {
            (Some(r), _) => r,
            (None, budget) => budget.unwrap_or(0) / (source_len + target_len),
        };
        if rows == 0 {
            return Err(LoaderError::Config(format!(
                "max_tokens {} is smaller than one packed row of {source_len} + {target_len} tokens",
                self.max_tokens.unwrap_or(0)
            )));
        }
        Ok(Some(PackShape {
            rows,
            source_len,
            target_len,
        }))
    }

    /// The data format named by `data_format`, if any.
    pub fn format(&self) -> Result<Option<Format>> {
        match &self.data_format {
            None => Ok(None),
            Some(f) => Format::parse(f).map(Some).ok_or_else(|| {
                LoaderError::Config(format!(
                    "unknown data_format {f:?} (recipenlg-csv, foodcom-csv, jsonl, parquet, arrow)"
                ))
            }),
        }
    }

    /// What the epoch plan depends on (`pack`: from [`LoaderOptions::pack_shape`]).
    pub fn plan_config(&self, pack: Option<PackShape>) -> PlanConfig {
        PlanConfig {
            batch_size: self.batch_size,
            max_tokens: self.max_tokens,
            pack,
            pad_to_multiple_of: self.pad_to_multiple_of.unwrap_or(1),
            shuffle: self.shuffle,
            seed: self.seed,
            rank: self.rank,
            world_size: self.world_size,
            split: self.split,
            eval_fraction: self.eval_fraction,
            dedup: self.dedup,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn set_checks_names_and_types() {
        let mut o = LoaderOptions::default();
        o.set("batch_size", json!(8)).unwrap();
        o.set("split", json!("eval")).unwrap();
        o.set("cache_dir", json!("/tmp/c")).unwrap();
        assert_eq!(o.batch_size, Some(8));
        assert_eq!(o.split, Split::Eval);
        let e = o.set("batch_sise", json!(8)).unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown loader option \"batch_sise\" (did you mean \"batch_size\"?)"
        );
        let e = o.set("seed", json!(-1)).unwrap_err().to_string();
        assert_eq!(e, "loader option seed must be an integer >= 0, got -1");
        let e = o.set("max_tokens", json!(true)).unwrap_err().to_string();
        assert_eq!(
            e,
            "loader option max_tokens must be an integer >= 0 or None, got True"
        );
        let e = o.set("split", json!("test")).unwrap_err().to_string();
        assert!(e.contains("'all', 'train' or 'eval'"), "{e}");
    }

    #[test]
    fn table_has_every_option_with_its_default() {
        let t = LoaderOptions::table();
        let names: Vec<&str> = t.iter().map(|o| o.name).collect();
        assert_eq!(names[..2], ["task", "source_template"]);
        let get = |n: &str| t.iter().find(|o| o.name == n).unwrap();
        assert_eq!(get("max_source_length").default, json!(512));
        assert_eq!(get("batch_size").python_type, "int | None");
        assert_eq!(get("split").default, json!("all"));
        assert_eq!(get("cache_dir").python_type, "str | PathLike[str] | None");
    }

    #[test]
    fn check_combinations() {
        let with = |pairs: Value| {
            let Value::Object(m) = pairs else { panic!() };
            LoaderOptions::from_pairs(m).and_then(|o| o.check())
        };
        assert!(with(json!({"batch_size": 4})).is_ok());
        let err = |pairs| with(pairs).unwrap_err().to_string();
        assert_eq!(err(json!({})), "give batch_size or max_tokens");
        assert!(err(json!({"batch_size": 4, "max_tokens": 9})).contains("not both"));
        assert!(err(json!({"batch_size": 0})).contains("batch_size must be >= 1"));
        assert!(err(json!({"batch_size": 4, "rank": 2, "world_size": 2})).contains("rank 2"));
        assert!(err(json!({"batch_size": 4, "split": "eval"})).contains("eval_fraction"));
        assert!(err(json!({"batch_size": 4, "data_format": "xml"})).contains("data_format"));
    }
}
