//! Where the files live under the data directory, and the file operations every format shares:
//! optional reads (size 0 = absent), atomic replacement through `temp/`, directory fsync, and the
//! lock that keeps a second process out of a directory in use.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::WalError;
use crate::failpoint::{Failpoints, BEFORE_RENAME};
use crate::segment::segment_file_name;
use crate::Lsn;

pub const LOG_DIR: &str = "log";
pub const TEMP_DIR: &str = "temp";
pub const SNAPSHOT_FILE: &str = "mqstate.snapshot";
pub const METADATA_FILE: &str = "mqstate.metadata";
pub const LOCK_FILE: &str = "LOCK";
/// How long a data directory's lock must stay held before [`DataDir::lock`] gives up.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(300);

/// Proof that this process holds a data directory's lock ([`DataDir::lock`]).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// The data directory (`<data>/`), with `log/` and `temp/` below it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn log_dir(&self) -> PathBuf {
        self.root.join(LOG_DIR)
    }

    pub fn temp_dir(&self) -> PathBuf {
        self.root.join(TEMP_DIR)
    }

    pub fn snapshot_path(&self) -> PathBuf {
        self.root.join(SNAPSHOT_FILE)
    }

    pub fn metadata_path(&self) -> PathBuf {
        self.root.join(METADATA_FILE)
    }

    pub fn lock_path(&self) -> PathBuf {
        self.root.join(LOCK_FILE)
    }

    /// Takes the exclusive lock on `<data>/LOCK` (an advisory `flock`), or fails with
    /// [`WalError::Locked`] if another process holds it. Held until the [`DirLock`] is dropped; the
    /// kernel drops it when the process ends, however it ends, so a crash leaves nothing to clean.
    pub fn lock(&self) -> Result<DirLock, WalError> {
        let path = self.lock_path();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(WalError::io("open the lock file", &path))?;
        // A `flock` belongs to the open file, and a child that another thread of this process is
        // spawning holds a copy of every descriptor until its `exec` closes them: a lock this
        // process just released can look held for that moment (seen as a test that reopens a log
        // while another test spawns a process). A held lock is only reported after it stayed held
        // a little while; another process's lock stays held, so the answer is the same.
        let started = std::time::Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(DirLock { _file: file }),
                Err(TryLockError::WouldBlock) if started.elapsed() < LOCK_PATIENCE => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(WalError::Locked {
                        path: self.root.clone(),
                    })
                }
                Err(TryLockError::Error(e)) => return Err(WalError::io("lock", &path)(e)),
            }
        }
    }

    pub fn segment_path(&self, first_lsn: Lsn) -> PathBuf {
        self.log_dir().join(segment_file_name(first_lsn))
    }

    /// Creates `<data>/`, `log/` and `temp/` if missing.
    pub(crate) fn create(&self) -> Result<(), WalError> {
        for dir in [self.root.clone(), self.log_dir(), self.temp_dir()] {
            if dir.exists() && !dir.is_dir() {
                // create_dir_all would say only "File exists".
                let e = std::io::Error::new(
                    std::io::ErrorKind::NotADirectory,
                    "it is a file, not a directory",
                );
                return Err(WalError::io("use as a directory", &dir)(e));
            }
            fs::create_dir_all(&dir).map_err(WalError::io("create directory", &dir))?;
        }
        Ok(())
    }

    /// Removes leftovers of writes that a crash interrupted before their rename.
    pub(crate) fn clear_temp(&self) -> Result<(), WalError> {
        let temp = self.temp_dir();
        let entries = fs::read_dir(&temp).map_err(WalError::io("list", &temp))?;
        for entry in entries {
            let path = entry.map_err(WalError::io("list", &temp))?.path();
            if path.file_name() == Some(std::ffi::OsStr::new(crate::prealloc::PREPARED_NAME)) {
                tracing::debug!(path = %path.display(), "removing an unused prepared segment");
            } else {
                tracing::info!(path = %path.display(), "removing an unfinished temporary file");
            }
            fs::remove_file(&path).map_err(WalError::io("remove", &path))?;
        }
        Ok(())
    }
}

/// The whole file, or `None` if it does not exist or is empty (the format's "absent").
pub(crate) fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, WalError> {
    match fs::read(path) {
        Ok(bytes) if bytes.is_empty() => Ok(None),
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(WalError::io("read", path)(e)),
    }
}

/// Makes a create, rename or delete inside `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), WalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(WalError::io("fsync directory", dir))
}

/// Writes a file under `temp/`, fsyncs it, renames it over `target` and fsyncs the target's
/// directory, so `target` is always either the old or the new content.
pub(crate) fn replace_atomically(
    dir: &DataDir,
    target: &Path,
    failpoints: &Failpoints,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> Result<(), WalError> {
    let name = target.file_name().unwrap_or(target.as_os_str());
    let temp = dir.temp_dir().join(name);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temp)
        .map_err(WalError::io("create", &temp))?;
    write(&mut file)
        .and_then(|()| file.flush())
        .map_err(WalError::io("write", &temp))?;
    file.sync_all().map_err(WalError::io("fsync", &temp))?;
    drop(file);
    rename_into_place(dir, &temp, target, failpoints)
}

/// Replaces the file at `path` with `contents` so that a crash leaves the old file or the new one,
/// never half of one: a hidden temporary file beside it, fsynced, renamed over `path`, the directory
/// fsynced. The temporary file is created with `mode` (Unix permissions), so a secret written this
/// way is never readable by others, not even before the rename. For files outside a `DataDir`'s
/// layout (the control plane's, the password file); the log's own go through `temp/` and its
/// failpoints.
pub fn write_file_atomically(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a file name", path.display()),
        )
    })?;
    let temp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut options = OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options.open(&temp)?;
    file.write_all(contents)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&temp, path)?;
    File::open(dir)?.sync_all()
}

/// Renames a complete, fsynced file from `temp/` to `target` and fsyncs the target's directory.
pub(crate) fn rename_into_place(
    dir: &DataDir,
    temp: &Path,
    target: &Path,
    failpoints: &Failpoints,
) -> Result<(), WalError> {
    failpoints
        .check(BEFORE_RENAME)
        .map_err(WalError::io("rename", temp))?;
    fs::rename(temp, target).map_err(WalError::io("rename into place", target))?;
    let parent = target.parent().unwrap_or(dir.root());
    sync_dir(parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_written_atomically_is_replaced_whole_and_leaves_no_temp_file() {
        let temp = tempfile::tempdir().unwrap();
        let path = temp.path().join("passwd");
        write_file_atomically(&path, b"one", 0o600).unwrap();
        write_file_atomically(&path, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(
            fs::read_dir(temp.path()).unwrap().count(),
            1,
            "no temp file left"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
    }

    #[test]
    fn a_locked_directory_refuses_a_second_lock_until_released() {
        let temp = tempfile::tempdir().unwrap();
        let dir = DataDir::new(temp.path());
        let held = dir.lock().unwrap();
        let refused = dir.lock().unwrap_err();
        assert!(matches!(refused, WalError::Locked { .. }), "{refused}");
        assert!(refused.to_string().contains("in use"), "{refused}");
        drop(held);
        dir.lock().unwrap();
    }

    /// What a child being spawned by another thread does: it holds a copy of the lock's
    /// descriptor for a moment after this process released the lock.
    #[test]
    fn a_lock_released_while_a_copy_of_its_descriptor_lingers_is_taken_once_the_copy_is_gone() {
        let temp = tempfile::tempdir().unwrap();
        let dir = DataDir::new(temp.path());
        let held = dir.lock().unwrap();
        let lingering = held._file.try_clone().unwrap();
        drop(held);
        let closer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(lingering);
        });
        dir.lock().unwrap();
        closer.join().unwrap();
    }
}
