//! Stable hashing and a seeded PRNG (hand-written so no dependency upgrade changes orders or splits), and the
//! content hash of data files (xxh3-64, a fixed specification: its values do not change with the crate's version).
use std::io::Read;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use xxhash_rust::xxh3::Xxh3Default;

/// FNV-1a 64 with a splitmix64 finaliser.
pub fn hash_bytes(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hashes several strings unambiguously.
pub fn hash_parts(parts: &[&[u8]]) -> u64 {
    let mut buf = Vec::new();
    for p in parts {
        buf.extend_from_slice(&(p.len() as u64).to_le_bytes());
        buf.extend_from_slice(p);
    }
    hash_bytes(&buf)
}

/// Passes reads through and hashes every byte read (xxh3-64): the index pass hashes the file it scans for free.
pub struct HashingReader<R> {
    inner: R,
    state: Xxh3Default,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        HashingReader {
            inner,
            state: Xxh3Default::new(),
        }
    }
    /// The hash of the bytes read so far.
    pub fn digest(&self) -> u64 {
        self.state.digest()
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.state.update(&buf[..n]);
        Ok(n)
    }
}

/// xxh3-64 of a whole file, read in 1 MiB blocks; stops with [`crate::error::Cancelled`] once `stop` is set.
pub fn hash_file(path: &Path, stop: &AtomicBool) -> std::io::Result<u64> {
    let file = std::fs::File::open(path)?;
    let mut r = HashingReader::new(crate::cancel::CancellableRead::new(file, stop));
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match r.read(&mut buf) {
            Ok(0) => return Ok(r.digest()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// xoshiro256** (Blackman & Vigna) seeded with splitmix64: the one PRNG of the crate (epoch orders and the
/// sample generator). Fixed forever: changing it changes every generated file and every shuffled order.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            mix(x)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `0..n` (Lemire's multiply-shift on 32 bits; the bias is negligible). `0 < n < 2^32`.
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}
