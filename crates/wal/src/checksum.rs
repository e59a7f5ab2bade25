//! The one checksum of every file: CRC-32/MPEG-2 (the seed's "network protocol" checksum).

use crc::{Crc, CRC_32_MPEG_2};

const CRC32_MPEG2: Crc<u32> = Crc::<u32>::new(&CRC_32_MPEG_2);

/// CRC-32/MPEG-2 of `bytes` (poly 0x04C11DB7, init 0xFFFFFFFF, not reflected, no final xor).
pub fn crc32(bytes: &[u8]) -> u32 {
    CRC32_MPEG2.checksum(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_value_matches_the_catalogue() {
        assert_eq!(crc32(b"123456789"), 0x0376_E6E7);
    }

    #[test]
    fn empty_input_is_the_init_value() {
        // No final xor: an empty record's checksum is the init value, which the format relies on.
        assert_eq!(crc32(b""), 0xFFFF_FFFF);
    }
}
