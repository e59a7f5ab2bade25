//! The snapshot file: the whole state as of `last_index`.
//!
//! ```text
//! marker B6 38 0F C9 | last index Int64 | last term Int64 | state Buffer | CRC UInt32 of state
//! ```

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use bytes::Bytes;

use crate::checksum::{crc32, digest};
use crate::codec::{put_i32, put_i64, put_u32, to_disk_i64, Reader};
use crate::error::{Damage, FormatError, WalError};
use crate::failpoint::{Failpoints, MID_SNAPSHOT};
use crate::layout::{read_optional, rename_into_place, replace_atomically, DataDir, SNAPSHOT_FILE};
use crate::{Lsn, Term};

pub const SNAPSHOT_MARKER: [u8; 4] = [0xB6, 0x38, 0x0F, 0xC9];

/// A snapshot: the application's serialized state with every record up to `last_index` applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub last_index: Lsn,
    pub last_term: Term,
    pub state: Bytes,
}

/// A decoded snapshot that borrows the state from the file's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotView<'a> {
    pub last_index: Lsn,
    pub last_term: Term,
    pub state: &'a [u8],
}

/// Everything before the state bytes. The state's length must fit an `Int32`.
fn encode_header(last_index: Lsn, last_term: Term, state_len: usize) -> Result<Vec<u8>, WalError> {
    let index = to_disk_i64(last_index).ok_or(WalError::OutOfRange {
        what: "snapshot last index",
        value: last_index,
    })?;
    let term = to_disk_i64(last_term).ok_or(WalError::OutOfRange {
        what: "snapshot last term",
        value: last_term,
    })?;
    let len = i32::try_from(state_len).map_err(|_| WalError::TooLarge {
        what: "snapshot state",
        len: state_len,
        max: i32::MAX as usize,
    })?;
    let mut out = Vec::with_capacity(24);
    out.extend_from_slice(&SNAPSHOT_MARKER);
    put_i64(&mut out, index);
    put_i64(&mut out, term);
    put_i32(&mut out, len);
    Ok(out)
}

/// The complete file content of a snapshot.
pub fn encode_snapshot(snapshot: &Snapshot) -> Result<Vec<u8>, WalError> {
    let mut out = encode_header(
        snapshot.last_index,
        snapshot.last_term,
        snapshot.state.len(),
    )?;
    out.extend_from_slice(&snapshot.state);
    put_u32(&mut out, crc32(&snapshot.state));
    Ok(out)
}

/// Decodes a whole snapshot file, checking marker, checksum and that nothing follows.
pub fn decode_snapshot(bytes: &[u8]) -> Result<SnapshotView<'_>, FormatError> {
    let mut r = Reader::new(bytes);
    let found = r.array4()?;
    if found != SNAPSHOT_MARKER {
        return Err(FormatError {
            offset: 0,
            damage: Damage::BadFileMarker {
                kind: "snapshot",
                expected: SNAPSHOT_MARKER,
                found,
            },
        });
    }
    let last_index = r.non_negative_i64("snapshot last index")?;
    let last_term = r.non_negative_i64("snapshot last term")?;
    let state = r.buffer(usize::MAX)?;
    let checksum_at = r.pos() as u64;
    let stored = r.u32()?;
    let computed = crc32(state);
    if stored != computed {
        return Err(FormatError {
            offset: checksum_at,
            damage: Damage::ChecksumMismatch { stored, computed },
        });
    }
    r.expect_end()?;
    Ok(SnapshotView {
        last_index,
        last_term,
        state,
    })
}

/// Writes the snapshot to `temp/`, fsyncs, renames it over `<data>/mqstate.snapshot`, fsyncs the
/// directory. Touches no log file, so it may run on any thread while appends continue.
pub fn write_snapshot(
    dir: &DataDir,
    snapshot: &Snapshot,
    failpoints: &Failpoints,
) -> Result<(), WalError> {
    let header = encode_header(
        snapshot.last_index,
        snapshot.last_term,
        snapshot.state.len(),
    )?;
    let checksum = crc32(&snapshot.state).to_be_bytes();
    replace_atomically(dir, &dir.snapshot_path(), failpoints, |file| {
        file.write_all(&header)?;
        let (first, second) = snapshot.state.split_at(snapshot.state.len() / 2);
        file.write_all(first)?;
        failpoints.check(MID_SNAPSHOT)?;
        file.write_all(second)?;
        file.write_all(&checksum)
    })
}

/// Offset of the state length field in the header.
const STATE_LEN_AT: u64 = 20;

/// A snapshot written to its file chunk by chunk, so the encoded state is never held whole in
/// memory: the header goes first with the state length left 0, each chunk is appended (buffered)
/// and added to the checksum as it passes, and [`SnapshotWriter::finish`] patches the length in
/// place, appends the checksum, fsyncs and renames the file over `<data>/mqstate.snapshot`. Until
/// then the file is only under `temp/` (cleared at start): a crash or a drop leaves the old
/// snapshot in place. Snapshots share one temp name: write one at a time. Blocking I/O.
pub struct SnapshotWriter {
    dir: DataDir,
    failpoints: Failpoints,
    temp: PathBuf,
    file: BufWriter<File>,
    state_len: u64,
    checksum: crc::Digest<'static, u32, crc::Table<16>>,
    chunks: u64,
    /// A byte already written was changed ([`SnapshotWriter::patch`]): the checksum is computed
    /// again from the file at the end.
    patched: bool,
}

impl std::fmt::Debug for SnapshotWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotWriter")
            .field("temp", &self.temp)
            .field("state_len", &self.state_len)
            .finish_non_exhaustive()
    }
}

impl SnapshotWriter {
    /// Starts `temp/mqstate.snapshot` for a state with every record up to `last_index` applied.
    pub fn create(
        dir: &DataDir,
        last_index: Lsn,
        last_term: Term,
        failpoints: &Failpoints,
    ) -> Result<SnapshotWriter, WalError> {
        let header = encode_header(last_index, last_term, 0)?;
        let temp = dir.temp_dir().join(SNAPSHOT_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temp)
            .map_err(WalError::io("create", &temp))?;
        let mut file = BufWriter::with_capacity(256 * 1024, file);
        file.write_all(&header)
            .map_err(WalError::io("write", &temp))?;
        Ok(SnapshotWriter {
            dir: dir.clone(),
            failpoints: failpoints.clone(),
            temp,
            file,
            state_len: 0,
            checksum: digest(),
            chunks: 0,
            patched: false,
        })
    }

    /// Appends the next piece of the state.
    pub fn write(&mut self, chunk: &[u8]) -> Result<(), WalError> {
        let len = self.state_len + chunk.len() as u64;
        if len > i32::MAX as u64 {
            return Err(WalError::TooLarge {
                what: "snapshot state",
                len: usize::try_from(len).unwrap_or(usize::MAX),
                max: i32::MAX as usize,
            });
        }
        if self.chunks == 1 {
            self.failpoints
                .check(MID_SNAPSHOT)
                .map_err(WalError::io("write", &self.temp))?;
        }
        self.file
            .write_all(chunk)
            .map_err(WalError::io("write", &self.temp))?;
        self.checksum.update(chunk);
        self.state_len = len;
        self.chunks += 1;
        Ok(())
    }

    /// Overwrites state bytes already written, from `offset` (in the state) on: for fields only
    /// known at the end, such as a count in the state's own header. The checksum is then computed
    /// again by reading the state back from the file at [`SnapshotWriter::finish`] (page cache,
    /// one buffer of 1 MiB), so memory stays bounded.
    pub fn patch(&mut self, offset: u64, bytes: &[u8]) -> Result<(), WalError> {
        if offset.saturating_add(bytes.len() as u64) > self.state_len {
            return Err(WalError::TooLarge {
                what: "snapshot patch",
                len: bytes.len(),
                max: usize::try_from(self.state_len.saturating_sub(offset)).unwrap_or(0),
            });
        }
        self.file
            .flush()
            .and_then(|()| {
                self.file
                    .get_ref()
                    .write_all_at(bytes, STATE_LEN_AT + 4 + offset)
            })
            .map_err(WalError::io("write", &self.temp))?;
        self.patched = true;
        Ok(())
    }

    /// Bytes of state written so far.
    pub fn state_len(&self) -> u64 {
        self.state_len
    }

    /// Completes the file and renames it into place (fsynced, directory fsynced).
    pub fn finish(self) -> Result<(), WalError> {
        let SnapshotWriter {
            dir,
            failpoints,
            temp,
            file,
            state_len,
            checksum,
            patched,
            ..
        } = self;
        let mut file = file
            .into_inner()
            .map_err(|e| WalError::io("write", &temp)(e.into_error()))?;
        let checksum = if patched {
            checksum_of_file(&file, STATE_LEN_AT + 4, state_len)
                .map_err(WalError::io("read back", &temp))?
        } else {
            checksum.finalize()
        };
        let len = i32::try_from(state_len).unwrap_or(i32::MAX);
        file.write_all(&checksum.to_be_bytes())
            .and_then(|()| file.write_all_at(&len.to_be_bytes(), STATE_LEN_AT))
            .and_then(|()| file.sync_all())
            .map_err(WalError::io("write", &temp))?;
        drop(file);
        rename_into_place(&dir, &temp, &dir.snapshot_path(), &failpoints)
    }
}

/// CRC of `len` bytes of `file` from `from`, read a buffer at a time.
fn checksum_of_file(file: &File, from: u64, len: u64) -> std::io::Result<u32> {
    let mut checksum = digest();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < len {
        let n = usize::try_from((len - done).min(buf.len() as u64)).unwrap_or(buf.len());
        file.read_exact_at(&mut buf[..n], from + done)?;
        checksum.update(&buf[..n]);
        done += n as u64;
    }
    Ok(checksum.finalize())
}

/// Reads `<data>/mqstate.snapshot`; `None` if absent or empty.
pub fn read_snapshot(dir: &DataDir) -> Result<Option<Snapshot>, WalError> {
    let path = dir.snapshot_path();
    let Some(bytes) = read_optional(&path)? else {
        return Ok(None);
    };
    let bytes = Bytes::from(bytes);
    let view = decode_snapshot(&bytes).map_err(|e| WalError::corrupt(&path, e))?;
    Ok(Some(Snapshot {
        last_index: view.last_index,
        last_term: view.last_term,
        state: bytes.slice_ref(view.state),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_snapshot_header() {
        let snapshot = Snapshot {
            last_index: 0x0102,
            last_term: 3,
            state: Bytes::from_static(b"123456789"),
        };
        #[rustfmt::skip]
        let expected: Vec<u8> = [
            &[0xB6, 0x38, 0x0F, 0xC9][..],   // marker
            &[0, 0, 0, 0, 0, 0, 0x01, 0x02], // last index
            &[0, 0, 0, 0, 0, 0, 0, 3],       // last term
            &[0, 0, 0, 9], b"123456789",     // state
            &[0x03, 0x76, 0xE6, 0xE7],       // CRC of the state (the catalogue check value)
        ].concat();
        assert_eq!(encode_snapshot(&snapshot).unwrap(), expected);
        let view = decode_snapshot(&expected).unwrap();
        assert_eq!(
            (view.last_index, view.last_term, view.state),
            (0x0102, 3, &b"123456789"[..])
        );
    }

    #[test]
    fn bad_checksum_names_its_offset() {
        let mut bytes = encode_snapshot(&Snapshot {
            last_index: 1,
            last_term: 1,
            state: Bytes::from_static(b"state"),
        })
        .unwrap();
        bytes[24] ^= 1;
        let err = decode_snapshot(&bytes).unwrap_err();
        assert_eq!(err.offset, 29);
        assert!(matches!(err.damage, Damage::ChecksumMismatch { .. }));
    }

    #[test]
    fn a_snapshot_written_in_chunks_is_the_snapshot_written_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = DataDir::new(tmp.path());
        dir.create().unwrap();
        let state: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut writer = SnapshotWriter::create(&dir, 77, 3, &Failpoints::default()).unwrap();
        // The first 8 bytes written as zeros and patched at the end, as a count would be.
        writer.write(&[0; 8]).unwrap();
        for chunk in state[8..].chunks(4096) {
            writer.write(chunk).unwrap();
        }
        writer.patch(0, &state[..8]).unwrap();
        assert!(writer.patch(state.len() as u64 - 2, b"xyz").is_err());
        assert_eq!(writer.state_len(), state.len() as u64);
        writer.finish().unwrap();
        let streamed = std::fs::read(dir.snapshot_path()).unwrap();
        let whole = encode_snapshot(&Snapshot {
            last_index: 77,
            last_term: 3,
            state: Bytes::from(state),
        })
        .unwrap();
        assert_eq!(streamed, whole);
    }

    #[test]
    fn an_unfinished_streamed_snapshot_leaves_the_old_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = DataDir::new(tmp.path());
        dir.create().unwrap();
        let old = Snapshot {
            last_index: 1,
            last_term: 1,
            state: Bytes::from_static(b"old"),
        };
        write_snapshot(&dir, &old, &Failpoints::default()).unwrap();
        let mut writer = SnapshotWriter::create(&dir, 9, 1, &Failpoints::default()).unwrap();
        writer.write(b"new state").unwrap();
        drop(writer);
        assert_eq!(read_snapshot(&dir).unwrap(), Some(old));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = decode_snapshot(&bytes);
        }

        #[test]
        fn round_trip(index in 0..=i64::MAX as u64, term in 0..=i64::MAX as u64,
                      state in proptest::collection::vec(any::<u8>(), 0..256)) {
            let snapshot = Snapshot { last_index: index, last_term: term, state: Bytes::from(state) };
            let bytes = encode_snapshot(&snapshot).unwrap();
            let view = decode_snapshot(&bytes).unwrap();
            prop_assert_eq!((view.last_index, view.last_term, view.state),
                            (index, term, &snapshot.state[..]));
        }
    }
}
