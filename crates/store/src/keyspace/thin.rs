//! [`ThinBytes`]: an owned byte string behind a one-word pointer, its length stored in the
//! allocation (`length varint | bytes`).
//!
//! Why `unsafe`: the keyspace's ordered set holds one handle per key, and B-tree nodes in the state
//! a load in key order leaves them (about half full) cost about twice the handle size per key. A
//! `Box<[u8]>` handle is two words; this one is one, which saves about 16 MB at a million keys
//! (decision 0015). No crate offers a thin owned slice without a header of its own (`thin-vec` keeps
//! length and capacity, 16 bytes), which would cost more in each allocation than it saves in the
//! tree. The unsafe surface is this file: allocation, reading, freeing, all with the one layout.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

pub(super) struct ThinBytes(NonNull<u8>);

// SAFETY: `ThinBytes` owns its allocation exclusively, like `Box<[u8]>`, and has no interior
// mutability; sending or sharing it is as safe as for `Box<[u8]>`.
unsafe impl Send for ThinBytes {}
// SAFETY: as above; `&ThinBytes` only gives out `&[u8]`.
unsafe impl Sync for ThinBytes {}

impl ThinBytes {
    pub(super) fn new(bytes: &[u8]) -> ThinBytes {
        ThinBytes::build(bytes.len(), |out| out.copy_from_slice(bytes))
    }

    /// `len` bytes written by `fill` (into zeroes), without an intermediate buffer.
    pub(super) fn build(len: usize, fill: impl FnOnce(&mut [u8])) -> ThinBytes {
        let prefix = varint_len(len as u64);
        let layout = layout(prefix + len);
        // SAFETY: the layout has a non-zero size (the prefix is at least one byte).
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            handle_alloc_error(layout)
        };
        // SAFETY: the allocation is `prefix + len` initialised (zeroed) bytes, exclusively ours.
        let all = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), prefix + len) };
        let (header, body) = all.split_at_mut(prefix);
        write_varint(header, len as u64);
        fill(body);
        ThinBytes(ptr)
    }

    /// The length and the size of its prefix. Runs on every key comparison: one- and two-byte
    /// prefixes (up to 16 KiB) take the short path.
    #[inline]
    fn header(&self) -> (usize, usize) {
        let p = self.0.as_ptr();
        // SAFETY: the prefix is at least one byte, and a second one exists whenever the first has
        // the continuation bit.
        let first = unsafe { *p };
        if first < 0x80 {
            return (usize::from(first), 1);
        }
        // SAFETY: see above.
        let second = unsafe { *p.add(1) };
        if second < 0x80 {
            return (usize::from(first & 0x7f) | usize::from(second) << 7, 2);
        }
        self.long_header()
    }

    #[cold]
    fn long_header(&self) -> (usize, usize) {
        let mut len = 0usize;
        for i in 0..MAX_VARINT_LEN {
            // SAFETY: `new` wrote a complete varint at the start of the allocation, and this reads
            // it byte by byte up to its last byte (the one without the continuation bit).
            let byte = unsafe { *self.0.as_ptr().add(i) };
            len |= usize::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return (len, i + 1);
            }
        }
        unreachable!("ThinBytes::new writes at most {MAX_VARINT_LEN} varint bytes")
    }

    #[inline]
    pub(super) fn as_slice(&self) -> &[u8] {
        let (len, prefix) = self.header();
        // SAFETY: `new` initialised `len` bytes after the prefix; they live as long as `self` and
        // are never mutated.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().add(prefix), len) }
    }
}

impl Drop for ThinBytes {
    fn drop(&mut self) {
        let (len, prefix) = self.header();
        // SAFETY: allocated in `new` with exactly this layout, and freed only here.
        unsafe { dealloc(self.0.as_ptr(), layout(prefix + len)) }
    }
}

impl Clone for ThinBytes {
    fn clone(&self) -> ThinBytes {
        ThinBytes::new(self.as_slice())
    }
}

/// A `u64` needs at most this many 7-bit groups.
const MAX_VARINT_LEN: usize = u64::BITS.div_ceil(7) as usize;

fn layout(size: usize) -> Layout {
    // Alignment 1 never fails; a size past `isize::MAX` cannot come from a slice.
    Layout::from_size_align(size, 1).unwrap_or_else(|_| unreachable!("a slice fits isize::MAX"))
}

pub(super) fn varint_len(mut value: u64) -> usize {
    let mut len = 1;
    while value >= 0x80 {
        value >>= 7;
        len += 1;
    }
    len
}

/// Writes `value` as LEB128 at the start of `out`; returns the bytes written.
pub(super) fn write_varint(out: &mut [u8], mut value: u64) -> usize {
    let mut i = 0;
    while value >= 0x80 {
        out[i] = (value as u8 & 0x7f) | 0x80;
        value >>= 7;
        i += 1;
    }
    out[i] = value as u8;
    i + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_any_length_and_clones_independently() {
        for len in [0usize, 1, 127, 128, 300, 16_383, 16_384, 70_000] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let thin = ThinBytes::new(&data);
            let copy = thin.clone();
            drop(thin);
            assert_eq!(copy.as_slice(), &data[..]);
            assert_eq!(
                std::mem::size_of::<ThinBytes>(),
                std::mem::size_of::<usize>()
            );
        }
    }

    #[test]
    fn varint_length_matches_what_is_written() {
        let mut buf = [0u8; MAX_VARINT_LEN];
        for value in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            assert_eq!(write_varint(&mut buf, value), varint_len(value));
        }
    }
}
