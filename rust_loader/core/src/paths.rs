//! Data paths: expanding the paths and globs a user gives, saying why one cannot be opened, and where caches go.
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{LoaderError, Result};

/// Expands paths and globs, in the given order (each glob sorted). An existing path is taken as it is, even with
/// `[`, `*` or `?` in its name; a glob skips hidden files (the loader's own `.<name>.<key>.rlidx` caches live
/// beside the data). A file named twice, literally or through overlapping globs, is an error: it would be read
/// twice per epoch.
pub fn expand_paths(patterns: &[String]) -> Result<Vec<PathBuf>> {
    Ok(expand_sources(patterns)?.into_iter().flatten().collect())
}

/// [`expand_paths`], the files of each pattern apart: the files of `patterns[i]` are the `i`-th list (a source
/// of the mixture, see [`crate::mixture`]).
pub fn expand_sources(patterns: &[String]) -> Result<Vec<Vec<PathBuf>>> {
    if patterns.is_empty() {
        return Err(LoaderError::Config("no data paths given".into()));
    }
    let mut out: Vec<Vec<PathBuf>> = Vec::new();
    let mut seen: std::collections::HashMap<(u64, u64), String> = std::collections::HashMap::new();
    for p in patterns {
        let literal = PathBuf::from(p);
        let meta = std::fs::metadata(&literal);
        let found = if meta.is_ok() || !p.contains(['*', '?', '[']) {
            match meta {
                Ok(m) if m.is_file() => vec![literal],
                Ok(_) => return Err(LoaderError::file(p, "not a regular file")),
                Err(e) => return Err(path_error(&literal, "", &e)),
            }
        } else {
            // Hidden files only when the pattern's file name asks for them (`.*.csv`). (glob's own
            // require_literal_leading_dot drops every hidden entry, even for such a pattern.)
            let hidden_wanted = Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            let entries =
                glob::glob(p).map_err(|e| LoaderError::file(p, format!("bad glob: {e}")))?;
            let mut found = Vec::new();
            for entry in entries {
                let path = entry.map_err(|e| {
                    LoaderError::io(
                        e.path().display(),
                        &format!("cannot read while expanding {p}"),
                        e.error(),
                    )
                })?;
                let hidden = path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'));
                if !hidden_wanted && hidden {
                    continue;
                }
                match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => found.push(path),
                    Ok(_) => {} // a directory matched by the glob
                    // A broken symlink or a loop: a file the user meant, not to be skipped silently.
                    Err(e) => return Err(path_error(&path, "", &e)),
                }
            }
            if found.is_empty() {
                return Err(LoaderError::file(
                    shown_path(Path::new(p)),
                    "glob matches no file",
                ));
            }
            found.sort();
            found
        };
        let mut files = Vec::with_capacity(found.len());
        for path in found {
            // Device and inode: the same file through a symlink, a hard link or another spelling of the path.
            let id = std::fs::metadata(&path)
                .map(|m| (m.dev(), m.ino()))
                .map_err(|e| LoaderError::io(path.display(), "", &e))?;
            if let Some(first) = seen.insert(id, p.clone()) {
                return Err(LoaderError::file(
                    path.display(),
                    format!("named twice (by {first:?} and {p:?}); each file must be listed once"),
                ));
            }
            files.push(path);
        }
        out.push(files);
    }
    Ok(out)
}

/// `path` as the user gave it, with the directory a relative path was resolved against: `data/x.csv (resolved
/// against /home/u/proj)`.
pub fn shown_path(path: &Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => {
            format!("{} (resolved against {})", path.display(), cwd.display())
        }
        _ => path.display().to_string(),
    }
}

/// The operating system's number for "too many levels of symbolic links".
#[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
const ELOOP: i32 = 62;
#[cfg(not(any(target_os = "macos", target_os = "ios", target_os = "freebsd")))]
const ELOOP: i32 = 40;

/// The error for a path that cannot be opened: a symlink loop or a broken symlink said as such, a missing
/// relative path with the directory it was resolved against; the errno kept. `context` (may be empty) says what
/// was being done.
pub fn path_error(path: &Path, context: &str, e: &std::io::Error) -> LoaderError {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let reason = if e.raw_os_error() == Some(ELOOP) {
        "symlink loop (too many levels of symbolic links, ELOOP)".to_string()
    } else if e.kind() == std::io::ErrorKind::NotFound && link {
        let target =
            std::fs::read_link(path).map_or_else(|_| "?".into(), |t| t.display().to_string());
        format!("broken symlink: it points to {target}, which does not exist")
    } else if e.kind() == std::io::ErrorKind::NotFound {
        "no such file".to_string()
    } else {
        e.to_string()
    };
    LoaderError::File {
        path: shown_path(path),
        reason: if context.is_empty() {
            reason
        } else {
            format!("{context}: {reason}")
        },
        errno: e.raw_os_error(),
    }
}

/// The cache directory used when the data's directory is not writable.
pub fn cache_root(cache_dir: Option<&Path>) -> PathBuf {
    if let Some(d) = cache_dir {
        return d.to_path_buf();
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("recipe-trainer");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("recipe-trainer")
}

/// Writes via a temporary file and rename, so a reader never sees half a file.
pub fn write_atomic(
    dest: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let tmp = dest.with_extension(format!("tmp{}", std::process::id()));
    let res = (|| {
        let mut f = File::create(&tmp)?;
        write(&mut f)?;
        f.flush()?;
        std::fs::rename(&tmp, dest)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}
