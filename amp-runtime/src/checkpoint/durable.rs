//! Writing a checkpoint so that a crash at any moment, a `kill -9` or a power loss, leaves either the
//! previous file or the new one, whole.
//!
//! The bytes go to a temporary file beside the target, with a name no other writer uses (this process's
//! id, a counter and the time; created with `create_new`, so an existing file is never reused); the file
//! is flushed to the disk (`fsync`) before it is renamed over the target, and the directory is flushed
//! after, so that the rename itself survives a power loss. On failure the temporary file is removed and
//! the target is untouched.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Distinguishes the temporary files of several saves in flight in one process.
static SAVES: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` atomically and durably.
pub(crate) fn replace_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (tmp, mut file) = create_temporary(path)?;
    let written = file.write_all(bytes).and_then(|()| file.sync_all()).and_then(|()| {
        drop(file);
        std::fs::rename(&tmp, path)
    });
    if let Err(err) = written {
        // Best effort: the temporary file is garbage either way, and the target was not touched.
        let _ = std::fs::remove_file(&tmp);
        return Err(err);
    }
    sync_directory(&directory_of(path))
}

/// The directory holding `path` (`.` for a bare file name).
fn directory_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A new file beside `path`, named `.{name}.{pid}.{counter}.{nanos}.partial`.
fn create_temporary(path: &Path) -> std::io::Result<(PathBuf, File)> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file"))?;
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let count = SAVES.fetch_add(1, Ordering::Relaxed);
    let unique = format!(".{}.{}.{count}.{nanos}.partial", name.to_string_lossy(), std::process::id());
    let tmp = directory_of(path).join(unique);
    let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    Ok((tmp, file))
}

/// Flushes a directory's entries (the rename) to the disk. Windows has no directory handles to flush:
/// there the rename's durability is the file system's.
fn sync_directory(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_replaces_the_file_whole_and_leaves_no_temporary_behind() {
        let dir = std::env::temp_dir().join(format!("amp-durable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.safetensors");
        replace_file(&path, b"first").unwrap();
        replace_file(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.safetensors")], "no temporary file is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_save_leaves_the_previous_file_untouched() {
        let dir = std::env::temp_dir().join(format!("amp-durable-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.safetensors");
        replace_file(&path, b"kept").unwrap();
        // A directory where the file should go: the rename fails, the old file stays.
        let blocked = dir.join("blocked");
        std::fs::create_dir_all(blocked.join("child")).unwrap();
        assert!(replace_file(&blocked, b"new").is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
        let partials = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".partial"))
            .count();
        assert_eq!(partials, 0, "the temporary file of the failed save is removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
