//! Tokenization with the `tokenizers` crate, with ids identical to
//! `transformers.AutoTokenizer(text, truncation=True, max_length=N)`: the post-processor's `</s>` is kept.
//!
//! Two ways to get the same ids:
//! - per text: the tokenizer with its truncation set to `N` (works for every `tokenizer.json`);
//! - per word (the default where it is exact, about 3x faster on recipes, see docs/loader.md): the text is cut at
//!   ASCII spaces, each distinct word is tokenized once and its ids are cached, the ids are concatenated, cut to
//!   `N - len(suffix)` and the post-processor's suffix (T5: `</s>`) is appended. This is exact when the
//!   tokenizer itself splits words at whitespace before its model runs and its normalizer acts inside words only
//!   (T5's SentencePiece conversion: Precompiled/NFKC normalizer, WhitespaceSplit + Metaspace), which
//!   [`words_are_independent`] checks on the tokenizer.json; any other tokenizer is used per text.
use std::collections::hash_map::Entry;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ahash::AHashMap;
use serde_json::Value;
use tokenizers::{Tokenizer, TruncationParams};

use crate::error::{LoaderError, Result};
use crate::hash::hash_bytes;

/// Words cached per shard; beyond that, new words are tokenized each time (Zipf: the cached ones are the
/// frequent ones, seen early). 64 shards x 8192 words stay under ~50 MB.
const SHARD_WORDS: usize = 8192;
const SHARDS: usize = 64;

/// Word -> ids.
type Shard = RwLock<AHashMap<Box<str>, Box<[u32]>>>;

/// Per-word ids, shared by all threads.
struct WordCache {
    shards: Vec<Shard>,
}

/// How texts are tokenized.
enum Mode {
    PerText {
        source: Box<Tokenizer>,
        target: Box<Tokenizer>,
    },
    PerWord {
        suffix: Vec<u32>,
        cache: WordCache,
    },
}

/// Source and target tokenization (same vocabulary, different truncation lengths).
pub struct Tok {
    base: Tokenizer,
    mode: Mode,
    max_source: usize,
    max_target: usize,
    pub pad_id: u32,
    /// Hash of the tokenizer.json bytes (part of index cache keys).
    pub file_hash: u64,
    pub path: PathBuf,
}

/// `path` itself, or `path/tokenizer.json` when `path` is a directory.
pub fn tokenizer_file(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    }
}

/// Whether tokenizing `a b` gives the ids of `a` followed by those of `b`, judged from the tokenizer.json:
/// a pre-tokenizer that splits at whitespace (`WhitespaceSplit`, or `Metaspace` with `split` and a prefix on
/// every word), a normalizer made of per-character steps (Unicode forms, Precompiled, Lowercase, Strip,
/// StripAccents, collapsing runs of spaces) and no added token that strips or contains spaces.
pub fn words_are_independent(json: &Value) -> bool {
    fn normalizer_ok(n: &Value) -> bool {
        match n["type"].as_str() {
            None => n.is_null(),
            Some("Sequence") => n["normalizers"]
                .as_array()
                .is_some_and(|v| v.iter().all(normalizer_ok)),
            Some(
                "NFC" | "NFD" | "NFKC" | "NFKD" | "Precompiled" | "Lowercase" | "StripAccents",
            ) => true,
            Some("Strip") => true,
            Some("Replace") => {
                n["pattern"]["Regex"] == " {2,}" && matches!(n["content"].as_str(), Some(" " | "▁"))
            }
            Some(_) => false,
        }
    }
    fn metaspace_ok(p: &Value) -> bool {
        let prefix = p["prepend_scheme"] == "always" || p["add_prefix_space"] == true;
        prefix && p["split"] != false
    }
    let pre = &json["pre_tokenizer"];
    let pre_ok = match pre["type"].as_str() {
        Some("Metaspace") => metaspace_ok(pre),
        Some("WhitespaceSplit") => true,
        Some("Sequence") => pre["pretokenizers"].as_array().is_some_and(|v| {
            v.iter().all(|p| match p["type"].as_str() {
                Some("WhitespaceSplit") => true,
                Some("Metaspace") => metaspace_ok(p),
                _ => false,
            })
        }),
        _ => false,
    };
    let added_ok = json["added_tokens"].as_array().is_none_or(|v| {
        v.iter().all(|t| {
            t["lstrip"] != true
                && t["rstrip"] != true
                && t["content"]
                    .as_str()
                    .is_some_and(|c| !c.contains(char::is_whitespace))
        })
    });
    pre_ok && normalizer_ok(&json["normalizer"]) && added_ok
}

impl Tok {
    /// Loads the tokenizer, per word where that is exact (see the module doc).
    pub fn load(path: &Path, max_source: usize, max_target: usize) -> Result<Tok> {
        Self::load_with(path, max_source, max_target, true)
    }

    /// Loads the tokenizer; `per_word: false` forces per-text tokenization (for the measurement).
    pub fn load_with(
        path: &Path,
        max_source: usize,
        max_target: usize,
        per_word: bool,
    ) -> Result<Tok> {
        let file = tokenizer_file(path);
        let bad = |r: String| LoaderError::file(file.display(), r);
        let bytes = std::fs::read(&file)
            .map_err(|e| crate::paths::path_error(&file, "cannot read tokenizer", &e))?;
        let mut base = Tokenizer::from_bytes(&bytes)
            .map_err(|e| bad(format!("not a valid tokenizer.json: {e}")))?;
        let json: Value = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not a valid tokenizer.json: {e}")))?;
        base.with_truncation(None)
            .map_err(|e| bad(format!("cannot reset truncation: {e}")))?;
        base.with_padding(None);
        let pad_id = json["padding"]["pad_id"]
            .as_u64()
            .map(|p| p as u32)
            .or_else(|| base.token_to_id("<pad>"))
            .unwrap_or(0);
        let ids = |text: &str, special: bool| -> Result<Vec<u32>> {
            base.encode_fast(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| bad(format!("tokenizer fails on {text:?}: {e}")))
        };
        // The post-processor must only append (T5: `</s>`) for the per-word path to add it itself.
        let suffix = ids("", true)?;
        let appends_only = ids("", false)?.is_empty()
            && [ids("a b", false)?, suffix.clone()].concat() == ids("a b", true)?;
        let mode = if per_word && appends_only && words_are_independent(&json) {
            Mode::PerWord {
                suffix,
                cache: WordCache {
                    shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
                },
            }
        } else {
            let with_len = |n: usize| -> Result<Box<Tokenizer>> {
                let mut t = base.clone();
                t.with_truncation(Some(TruncationParams {
                    max_length: n,
                    ..Default::default()
                }))
                .map_err(|e| LoaderError::Config(format!("truncation to {n}: {e}")))?;
                Ok(Box::new(t))
            };
            Mode::PerText {
                source: with_len(max_source)?,
                target: with_len(max_target)?,
            }
        };
        Ok(Tok {
            base,
            mode,
            max_source,
            max_target,
            pad_id,
            file_hash: hash_bytes(&bytes),
            path: file,
        })
    }

    /// Whether texts are tokenized per word (with the cache) rather than per text.
    pub fn per_word(&self) -> bool {
        matches!(self.mode, Mode::PerWord { .. })
    }

    /// Ids of `(source, target)`, truncated, with special tokens.
    pub fn encode(
        &self,
        source: &str,
        target: &str,
    ) -> std::result::Result<(Vec<u32>, Vec<u32>), String> {
        match &self.mode {
            Mode::PerText {
                source: st,
                target: tt,
            } => {
                let ids = |t: &Tokenizer, text: &str| {
                    t.encode_fast(text, true)
                        .map(|e| e.get_ids().to_vec())
                        .map_err(|e| e.to_string())
                };
                Ok((ids(st, source)?, ids(tt, target)?))
            }
            Mode::PerWord { suffix, cache } => Ok((
                self.encode_words(cache, suffix, source, self.max_source)?,
                self.encode_words(cache, suffix, target, self.max_target)?,
            )),
        }
    }

    fn encode_words(
        &self,
        cache: &WordCache,
        suffix: &[u32],
        text: &str,
        max_len: usize,
    ) -> std::result::Result<Vec<u32>, String> {
        let keep = max_len.saturating_sub(suffix.len());
        let mut ids = Vec::with_capacity(keep.min(text.len() / 3 + 1) + suffix.len());
        for word in text.split(' ').filter(|w| !w.is_empty()) {
            if ids.len() >= keep {
                break; // the rest would be cut off anyway
            }
            let shard = &cache.shards[hash_bytes(word.as_bytes()) as usize % SHARDS];
            if let Some(w) = shard.read().expect("word cache lock").get(word) {
                ids.extend_from_slice(w);
                continue;
            }
            let enc = self
                .base
                .encode_fast(word, false)
                .map_err(|e| e.to_string())?;
            ids.extend_from_slice(enc.get_ids());
            let mut map = shard.write().expect("word cache lock");
            if map.len() < SHARD_WORDS {
                if let Entry::Vacant(v) = map.entry(word.into()) {
                    v.insert(enc.get_ids().into());
                }
            }
        }
        ids.truncate(keep);
        ids.extend_from_slice(suffix);
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn per_word_ids_equal_per_text_ids() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer.json");
        let words = Tok::load_with(&path, 24, 40, true).unwrap();
        let texts = Tok::load_with(&path, 24, 40, false).unwrap();
        assert!(words.per_word() && !texts.per_word());
        let pieces = [
            "½ cup sugar",
            "crème brûlée",
            "🍰  cake",
            "豆腐 200g",
            "tabs\tand\nnewlines",
            " e\u{301} ",
            "a\u{3000}b\u{200b}c",
            "</s> <pad>x",
            "Mix well.",
            "1/2-inch",
            "   ",
        ];
        for (i, a) in pieces.iter().enumerate() {
            for b in &pieces[i..] {
                let (s, t) = (format!("{a} {b}"), format!("{b}  {a} {a} {b} {a} {b}"));
                assert_eq!(words.encode(&s, &t), texts.encode(&s, &t), "{s:?} / {t:?}");
            }
        }
    }

    #[test]
    fn t5_layout_is_per_word_and_others_are_not() {
        let t5 = json!({
            "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AA=="},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "WhitespaceSplit"},
                {"type": "Metaspace", "replacement": "▁", "add_prefix_space": true}]},
            "added_tokens": [{"content": "</s>", "lstrip": false, "rstrip": false}],
        });
        assert!(words_are_independent(&t5));
        let mut byte_level = t5.clone();
        byte_level["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": false});
        assert!(!words_are_independent(&byte_level));
        let mut first_only = t5.clone();
        first_only["pre_tokenizer"] =
            json!({"type": "Metaspace", "prepend_scheme": "first", "split": true});
        assert!(!words_are_independent(&first_only));
        let mut stripping = t5.clone();
        stripping["added_tokens"] = json!([{"content": "<mask>", "lstrip": true, "rstrip": false}]);
        assert!(!words_are_independent(&stripping));
        let mut other_replace = t5;
        other_replace["normalizer"] =
            json!({"type": "Replace", "pattern": {"String": "a b"}, "content": "c"});
        assert!(!words_are_independent(&other_replace));
    }
}
