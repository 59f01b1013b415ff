//! Record boundaries, shared by the indexing pass (`index`) and the sequential reader (`records`): CSV records
//! split by `csv_core` and JSONL lines, each kept to at most [`MAX_RECORD_BYTES`] in memory, with exact byte
//! ranges and `file:line` numbers whatever the line ends (`\n`, `\r\n` or a lone `\r` end a line).
use std::io::{BufRead, BufReader, Read};

use crate::formats::MAX_RECORD_BYTES;

/// One CSV record: its fields (empty when it is over [`MAX_RECORD_BYTES`]: `len` says so), its byte range in
/// the input and its first physical line (1-based).
#[derive(Debug)]
pub struct CsvRecord {
    pub fields: csv::ByteRecord,
    pub start: u64,
    pub len: u64,
    pub line: u64,
}

impl CsvRecord {
    /// Whether the record is over [`MAX_RECORD_BYTES`] (its fields were not kept).
    pub fn over_long(&self) -> bool {
        self.len > MAX_RECORD_BYTES as u64
    }

    /// A blank line (one field of whitespace), which both readers skip without counting.
    pub fn is_blank(&self) -> bool {
        !self.over_long()
            && self.fields.len() == 1
            && self
                .fields
                .get(0)
                .is_some_and(|f| f.iter().all(u8::is_ascii_whitespace))
    }
}

/// Splits CSV input into records with `csv_core` (the parser under the `csv` crate, same dialect), keeping at
/// most `MAX_RECORD_BYTES` of a record: an unclosed quote that swallows the rest of the file costs no memory.
/// It sees every byte, so a record's byte range and first line are exact whatever the line ends.
pub struct CsvRecords<R> {
    input: BufReader<R>,
    core: csv_core::Reader,
    pos: u64,
    newlines: u64,
    pending_cr: bool,
    out: Vec<u8>,
    ends: Vec<usize>,
    done: bool,
}

impl<R: Read> CsvRecords<R> {
    pub fn new(r: R) -> Self {
        CsvRecords {
            input: BufReader::with_capacity(1 << 20, r),
            core: csv_core::Reader::new(),
            pos: 0,
            newlines: 0,
            pending_cr: false,
            out: vec![0; 4096],
            ends: vec![0; 64],
            done: false,
        }
    }

    /// The next record (the header is the first), or None at the end.
    pub fn next_record(&mut self) -> std::io::Result<Option<CsvRecord>> {
        use csv_core::ReadRecordResult::*;
        if self.done {
            return Ok(None);
        }
        let (start, newlines_before) = (self.pos, self.newlines);
        // Line ends before the record's first byte of content: blank lines, or the end of the previous
        // record's line (csv_core ends a record at `\r`, so a CRLF's `\n` is read with the next one).
        let (mut leading, mut in_prefix) = (0u64, true);
        let (mut outlen, mut endlen, mut over) = (0, 0, false);
        loop {
            let input = match self.input.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let (res, nin, nout, nend) =
                self.core
                    .read_record(input, &mut self.out[outlen..], &mut self.ends[endlen..]);
            for &b in &input[..nin] {
                // A line ends at `\n`, or at a `\r` that no `\n` follows (old Mac files).
                let line_end = (b == b'\n' || self.pending_cr) as u64;
                self.pending_cr = b == b'\r';
                if in_prefix {
                    leading += line_end;
                    in_prefix = b == b'\r' || b == b'\n';
                }
                self.newlines += line_end;
            }
            self.input.consume(nin);
            self.pos += nin as u64;
            outlen += nout;
            endlen += nend;
            match res {
                InputEmpty => {}
                OutputFull if self.out.len() > MAX_RECORD_BYTES => (over, outlen) = (true, 0),
                OutputFull => self.out.resize(self.out.len() * 2, 0),
                OutputEndsFull if over => endlen = 0,
                OutputEndsFull => self.ends.resize(self.ends.len() * 2, 0),
                Record => break,
                End => {
                    self.done = true;
                    return Ok(None);
                }
            }
        }
        let len = self.pos - start;
        let mut fields = csv::ByteRecord::new();
        if !over {
            let mut from = 0;
            for &end in &self.ends[..endlen] {
                fields.push_field(&self.out[from..end]);
                from = end;
            }
        }
        Ok(Some(CsvRecord {
            fields,
            start,
            len: if over {
                len.max(MAX_RECORD_BYTES as u64 + 1)
            } else {
                len
            },
            line: 1 + newlines_before + leading,
        }))
    }
}

/// Reads one line (through its `\n`) and keeps at most `limit` bytes of it in `buf`, so an over-long line (a whole
/// JSON array on one line, say) costs no memory; returns the line's full length, 0 at the end.
pub fn read_line_bounded(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<usize> {
    let mut total = 0;
    loop {
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(total);
        }
        let (used, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        let keep = used.min(limit.saturating_sub(buf.len()));
        buf.extend_from_slice(&avail[..keep]);
        r.consume(used);
        total += used;
        if done {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(bytes: &[u8]) -> Vec<CsvRecord> {
        let mut r = CsvRecords::new(bytes);
        let mut out = Vec::new();
        while let Some(rec) = r.next_record().unwrap() {
            out.push(rec);
        }
        out
    }

    #[test]
    fn byte_ranges_and_lines_whatever_the_line_ends() {
        let text = b"a,b\r\n \r\n1,\"x\ny\"\r2,z\n";
        let recs = records(text);
        let lines: Vec<u64> = recs.iter().map(|r| r.line).collect();
        // The header, a line of whitespace (line 2), a record over lines 3-4 (the quoted newline), one on line 5 after
        // a lone `\r`.
        assert_eq!(lines, [1, 2, 3, 5]);
        assert!(recs[1].is_blank());
        assert_eq!(&recs[2].fields[1], b"x\ny");
        let last = &recs[3];
        assert_eq!(
            &text[last.start as usize..(last.start + last.len) as usize],
            b"2,z\n"
        );
    }

    #[test]
    fn an_unclosed_quote_keeps_no_more_than_the_limit() {
        let mut text = b"a,b\n1,\"".to_vec();
        text.extend(std::iter::repeat_n(b'x', 3 * MAX_RECORD_BYTES));
        let recs = records(&text);
        assert_eq!(recs.len(), 2);
        assert!(recs[1].over_long() && !recs[1].is_blank());
        assert_eq!(recs[1].fields.len(), 0);
    }

    #[test]
    fn a_long_line_is_measured_but_not_kept() {
        let mut r = BufReader::new(&b"abcdef\nxy"[..]);
        let mut buf = Vec::new();
        assert_eq!(read_line_bounded(&mut r, &mut buf, 3).unwrap(), 7);
        assert_eq!(buf, b"abc");
        buf.clear();
        assert_eq!(read_line_bounded(&mut r, &mut buf, 3).unwrap(), 2);
        assert_eq!(read_line_bounded(&mut r, &mut buf, 3).unwrap(), 0);
    }
}
