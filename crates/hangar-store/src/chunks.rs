//! Chunked hashing of canonical data.
//!
//! The data half of an id is a two-level BLAKE3 tree: the canonical data is
//! cut into [`CHUNK_SIZE`] chunks, each chunk is hashed with BLAKE3, and the
//! root is BLAKE3 over a domain tag, the data length and the chunk hashes in
//! order ([`data_root`]). Keeping the chunk hashes (32 bytes per MiB) lets
//! every reader verify exactly the bytes it reads — a view that needs a tenth
//! of an artifact, a peer transfer that dies half-way and resumes from another
//! source — without rehashing the whole artifact. Chunks are hashed on all
//! cores ([`hash_chunks`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::id::Digest;

/// Size of a hashed chunk of canonical data (the last chunk may be shorter).
pub const CHUNK_SIZE: u64 = 1 << 20;

/// Number of chunks of `data_len` bytes of data.
pub fn chunk_count(data_len: u64) -> usize {
    data_len.div_ceil(CHUNK_SIZE) as usize
}

/// Byte range `start..end` of chunk `i` in `data_len` bytes of data.
pub fn chunk_range(i: usize, data_len: u64) -> (u64, u64) {
    let start = i as u64 * CHUNK_SIZE;
    (start, (start + CHUNK_SIZE).min(data_len))
}

/// BLAKE3 of one chunk.
pub fn hash_chunk(bytes: &[u8]) -> Digest {
    *blake3::hash(bytes).as_bytes()
}

/// Root hash over chunk hashes: BLAKE3(`"hg1-data\0"` ‖ len as u64 LE ‖ hashes).
pub fn data_root(data_len: u64, chunk_hashes: &[Digest]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(b"hg1-data\0");
    h.update(&data_len.to_le_bytes());
    for c in chunk_hashes {
        h.update(c);
    }
    *h.finalize().as_bytes()
}

/// Encodes chunk hashes as the stored `chunks` file (32 bytes each).
pub fn encode(hashes: &[Digest]) -> Vec<u8> {
    hashes.concat()
}

/// Decodes a `chunks` file; `None` if its length is not a multiple of 32.
pub fn decode(bytes: &[u8]) -> Option<Vec<Digest>> {
    if bytes.len() % 32 != 0 {
        return None;
    }
    Some(bytes.chunks_exact(32).map(|c| c.try_into().expect("32 bytes")).collect())
}

/// Threads to use for hashing and copying: all cores.
pub fn parallelism() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `work(i)` for every chunk index `i < n` on all cores, chunks handed
/// out in order from a shared counter. Stops handing out work after the
/// first error and returns it.
pub fn for_each_chunk_parallel<E: Send>(
    n: usize,
    work: impl Fn(usize) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let next = AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..parallelism().min(n.max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                if let Err(e) = work(i) {
                    next.store(n, Ordering::Relaxed);
                    failed.lock().expect("not poisoned").get_or_insert(e);
                    break;
                }
            });
        }
    });
    match failed.into_inner().expect("not poisoned") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Runs `work(i, chunk)` over every [`CHUNK_SIZE`] chunk of `data` on all
/// cores, with mutable access to the chunk; stops at the first error.
pub fn for_each_chunk_mut_parallel<E: Send>(
    data: &mut [u8],
    work: impl Fn(usize, &mut [u8]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let slots: Vec<std::sync::Mutex<&mut [u8]>> =
        data.chunks_mut(CHUNK_SIZE as usize).map(std::sync::Mutex::new).collect();
    for_each_chunk_parallel(slots.len(), |i| work(i, &mut slots[i].lock().expect("not poisoned")))
}

/// Hashes every chunk of `data` on all cores.
pub fn hash_chunks(data: &[u8]) -> Vec<Digest> {
    let n = chunk_count(data.len() as u64);
    let out: Vec<std::sync::Mutex<Digest>> = (0..n).map(|_| std::sync::Mutex::new([0; 32])).collect();
    for_each_chunk_parallel::<()>(n, |i| {
        let (a, b) = chunk_range(i, data.len() as u64);
        *out[i].lock().expect("not poisoned") = hash_chunk(&data[a as usize..b as usize]);
        Ok(())
    })
    .expect("hashing cannot fail");
    out.into_iter().map(|m| m.into_inner().expect("not poisoned")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_depends_on_every_byte_and_the_length() {
        let mut data = vec![7u8; (CHUNK_SIZE as usize) * 2 + 5];
        let h = hash_chunks(&data);
        assert_eq!(h.len(), 3);
        let root = data_root(data.len() as u64, &h);
        data[CHUNK_SIZE as usize + 1] ^= 1;
        let h2 = hash_chunks(&data);
        assert_eq!((h[0], h[2]), (h2[0], h2[2]));
        assert_ne!(root, data_root(data.len() as u64, &h2));
        assert_ne!(root, data_root(data.len() as u64 + 1, &h));
        assert_eq!(decode(&encode(&h)).unwrap(), h);
        assert!(decode(&[0; 33]).is_none());
    }
}
