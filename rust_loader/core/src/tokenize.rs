//! Tokenization with the `tokenizers` crate, with truncation identical to
//! `transformers.AutoTokenizer(text, truncation=True, max_length=N)`: the post-processor's `</s>` is kept.
use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams};

use crate::error::{LoaderError, Result};

/// Source and target tokenizers (same vocabulary, different truncation lengths).
pub struct Tok {
    source: Tokenizer,
    target: Tokenizer,
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

impl Tok {
    pub fn load(path: &Path, max_source: usize, max_target: usize) -> Result<Tok> {
        let file = tokenizer_file(path);
        let bytes = std::fs::read(&file).map_err(|e| {
            LoaderError::file(file.display(), format!("cannot read tokenizer: {e}"))
        })?;
        let base = Tokenizer::from_bytes(&bytes).map_err(|e| {
            LoaderError::file(file.display(), format!("not a valid tokenizer.json: {e}"))
        })?;
        let with_len = |n: usize| -> Result<Tokenizer> {
            let mut t = base.clone();
            t.with_truncation(Some(TruncationParams {
                max_length: n,
                ..Default::default()
            }))
            .map_err(|e| LoaderError::Config(format!("truncation to {n}: {e}")))?;
            Ok(t)
        };
        let pad_id = base
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| base.token_to_id("<pad>"))
            .unwrap_or(0);
        Ok(Tok {
            source: with_len(max_source)?,
            target: with_len(max_target)?,
            pad_id,
            file_hash: crate::hash::hash_bytes(&bytes),
            path: file,
        })
    }

    /// Ids of `(source, target)`, truncated, with special tokens.
    pub fn encode(
        &self,
        source: &str,
        target: &str,
    ) -> std::result::Result<(Vec<u32>, Vec<u32>), String> {
        let s = self
            .source
            .encode_fast(source, true)
            .map_err(|e| e.to_string())?;
        let t = self
            .target
            .encode_fast(target, true)
            .map_err(|e| e.to_string())?;
        Ok((s.get_ids().to_vec(), t.get_ids().to_vec()))
    }
}
