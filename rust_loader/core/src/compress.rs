//! Which compression a file name means: the one rule shared by the sample writer and the loader.
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Compression picked from a file name's suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// Suffixes and what they mean, compared without regard to case.
const SUFFIXES: [(&str, Compression); 3] = [
    (".gz", Compression::Gzip),
    (".zst", Compression::Zstd),
    (".zstd", Compression::Zstd),
];

impl Compression {
    /// `.gz` is gzip, `.zst` or `.zstd` is zstd (any case: `R.CSV.GZ`), anything else is plain text; with the
    /// file name without that suffix (`recipes.csv.zst` -> `recipes.csv`).
    pub fn split(path: &Path) -> (Compression, String) {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let lower = name.to_ascii_lowercase();
        for (suffix, comp) in SUFFIXES {
            if lower.ends_with(suffix) && lower.len() > suffix.len() {
                return (comp, name[..name.len() - suffix.len()].to_string());
            }
        }
        (Compression::None, name)
    }

    /// The compression of `path` (see [`Compression::split`]).
    pub fn from_path(path: &Path) -> Compression {
        Self::split(path).0
    }

    /// `file` decompressed while it is read (gzip members concatenated as `gzip -d` reads them).
    pub fn reader(self, file: File) -> std::io::Result<Box<dyn Read>> {
        Ok(match self {
            Compression::None => Box::new(file),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(file))),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(file)?),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "plain",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_in_any_case() {
        for (name, comp, stem) in [
            ("r.csv.gz", Compression::Gzip, "r.csv"),
            ("R.CSV.GZ", Compression::Gzip, "R.CSV"),
            ("r.jsonl.zst", Compression::Zstd, "r.jsonl"),
            ("r.csv.zstd", Compression::Zstd, "r.csv"),
            ("r.csv.ZSTD", Compression::Zstd, "r.csv"),
            ("r.csv", Compression::None, "r.csv"),
            ("r.gzip", Compression::None, "r.gzip"),
            (".gz", Compression::None, ".gz"),
        ] {
            assert_eq!(
                Compression::split(Path::new(name)),
                (comp, stem.to_string()),
                "{name}"
            );
        }
    }
}
