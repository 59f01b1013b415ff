//! A Parquet file's footer checked before the parquet crate decodes it.
//!
//! The footer is Thrift's compact protocol. The crate skips the fields it does not know, and it skips a list of
//! booleans without reading a byte per element (the protocol writes one), so a damaged footer declaring a list
//! of 2^31 booleans costs 2^31 loop turns, and a few such lists hours: found by the `read_file` fuzz target
//! (fuzz/), 679 bytes that took 25 s. Here the whole footer is walked once, generically, every element of a
//! list or map taking at least one byte: a footer that fits its bytes passes in time linear in its length, and
//! one that does not is refused before the crate sees it.
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

const MAGIC: &[u8; 4] = b"PAR1";
/// How deep structs, lists and maps nest in a footer that is walked: Parquet's own nest a few levels; the
/// crate stops skipping at 64.
const MAX_DEPTH: u32 = 64;

/// Reads the footer of the Parquet file `file` and walks it: Err with what is wrong where it does not hold
/// together (the file's position is left anywhere).
pub fn check(file: &mut File) -> Result<(), String> {
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len < 12 {
        return Err("too short for a Parquet file".into());
    }
    let mut tail = [0u8; 8];
    file.seek(SeekFrom::End(-8)).map_err(|e| e.to_string())?;
    file.read_exact(&mut tail).map_err(|e| e.to_string())?;
    if &tail[4..] != MAGIC {
        return Err("no PAR1 at its end (not Parquet, or truncated)".into());
    }
    let footer_len = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) as u64;
    if footer_len + 12 > len {
        return Err(format!("a footer of {footer_len} bytes in a file of {len}"));
    }
    let mut footer = vec![0u8; footer_len as usize];
    file.seek(SeekFrom::End(-8 - footer_len as i64))
        .map_err(|e| e.to_string())?;
    file.read_exact(&mut footer).map_err(|e| e.to_string())?;
    walk_struct(&footer)
}

/// Walks one compact-protocol struct that fills `bytes` from their start (what follows it is ignored).
pub fn walk_struct(bytes: &[u8]) -> Result<(), String> {
    let mut r = Reader { bytes, at: 0 };
    r.skip(STRUCT, MAX_DEPTH)
        .map_err(|e| format!("a damaged footer ({e} at byte {} of {})", r.at, bytes.len()))
}

// The compact protocol's type ids.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const BYTE: u8 = 3;
const I16: u8 = 4;
const I32: u8 = 5;
const I64: u8 = 6;
const DOUBLE: u8 = 7;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const SET: u8 = 10;
const MAP: u8 = 11;
const STRUCT: u8 = 12;
const UUID: u8 = 13;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn byte(&mut self) -> Result<u8, &'static str> {
        let b = *self.bytes.get(self.at).ok_or("ends inside a value")?;
        self.at += 1;
        Ok(b)
    }

    fn bytes(&mut self, n: u64) -> Result<(), &'static str> {
        if n > self.left() as u64 {
            return Err("a length past its end");
        }
        self.at += n as usize;
        Ok(())
    }

    fn varint(&mut self) -> Result<u64, &'static str> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a number of more than 64 bits")
    }

    /// A list's or map's element count, which cannot exceed the bytes left: every element takes one at least.
    fn count(&mut self, n: u64) -> Result<u64, &'static str> {
        if n > self.left() as u64 {
            return Err("more elements than bytes left");
        }
        Ok(n)
    }

    /// Skips a value of type `kind`; `in_list`: booleans take a byte there (a struct's boolean fields hold
    /// their value in the field's type).
    fn skip_value(&mut self, kind: u8, depth: u32, in_list: bool) -> Result<(), &'static str> {
        match kind {
            BOOL_TRUE | BOOL_FALSE if !in_list => Ok(()),
            BOOL_TRUE | BOOL_FALSE | BYTE => self.byte().map(drop),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.bytes(8),
            BINARY => {
                let n = self.varint()?;
                self.bytes(n)
            }
            UUID => self.bytes(16),
            LIST | SET | MAP | STRUCT => self.skip(kind, depth),
            _ => Err("an unknown type"),
        }
    }

    fn skip(&mut self, kind: u8, depth: u32) -> Result<(), &'static str> {
        let depth = depth.checked_sub(1).ok_or("nested too deep")?;
        match kind {
            STRUCT => loop {
                let header = self.byte()?;
                if header == 0 {
                    return Ok(()); // the struct's end
                }
                if header >> 4 == 0 {
                    self.varint()?; // the field's id in full (zigzag i16), not as a delta
                }
                self.skip_value(header & 0x0f, depth, false)?;
            },
            LIST | SET => {
                let header = self.byte()?;
                let n = match header >> 4 {
                    15 => self.varint()?,
                    short => u64::from(short),
                };
                for _ in 0..self.count(n)? {
                    self.skip_value(header & 0x0f, depth, true)?;
                }
                Ok(())
            }
            MAP => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let types = self.byte()?;
                for _ in 0..self.count(n)? {
                    self.skip_value(types >> 4, depth, true)?;
                    self.skip_value(types & 0x0f, depth, true)?;
                }
                Ok(())
            }
            _ => Err("an unknown type"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::walk_struct;

    #[test]
    fn a_list_of_more_booleans_than_bytes_is_refused_at_once() {
        // Field 1: a list (type 9) of 0x7fffffff booleans (element type 1), in 7 bytes.
        let footer = [0x19, 0xf1, 0xff, 0xff, 0xff, 0xff, 0x07, 0x00];
        let err = walk_struct(&footer).unwrap_err();
        assert!(err.contains("more elements than bytes left"), "{err}");
    }

    #[test]
    fn structs_lists_maps_and_scalars_that_fit_are_walked() {
        // i32 field 1 = 3; binary field 2 = "ab"; list field 3 of two i64; a nested struct with a true boolean
        // field; a map of one i32 -> binary; the struct's end.
        let footer = [
            0x15, 0x06, 0x18, 0x02, b'a', b'b', 0x19, 0x26, 0x02, 0x04, 0x1c, 0x11, 0x00, 0x1b,
            0x01, 0x58, 0x02, 0x01, b'x', 0x00,
        ];
        walk_struct(&footer).unwrap();
        assert!(walk_struct(&footer[..footer.len() - 1]).is_err()); // no end of struct
    }
}
